"""``qwen3-next``: Qwen3-Next's Gated DeltaNet (GDN) linear-attention layers and a full-attention layer
(3 + 1 by default, Qwen3-Next's own ratio; 2 layers give 1 + 1), a mixture of 4 experts, bfloat16 (vLLM's
CPU GDN kernels need it; they also need linear key/value head dims of 64). Full attention: 8 query / 2 KV
heads of 64; GDN: 4 key / 8 value heads of 64.

Random weights do not give robust greedy tokens in bfloat16: the top-2 logits of a random model tie or lie
within one bf16 step of each other (a random logit distribution has no outlier), and computing the same
weights in float32 moves single logits by up to ~0.5 standard deviation. So the weights are random where they do
not decide the tokens and built where they do, and the tokens depend on both kinds of cache:

* the residual stream is split: dimension 0 holds a constant, the next 64 a one-hot hash of the token
  (64 buckets), the next 64 the GDN's output ("induction"), the rest the token's random embedding, which
  the (untied) head reads; every other layer writes only into that last part, scaled down;
* GDN layer 0 is an induction layer: its key is the hash of the previous token (the causal conv's tap),
  its query the hash of the current one, no decay and beta 1, so its state maps each bucket to the token
  that last followed it, and its output at t is the token that followed the last earlier occurrence of
  x_t (zero when there was none) - it needs the whole prompt's state;
* the full-attention layer attends to the position OFFSET tokens back, whatever the content (query and key
  read the constant dimension, then RMS-normalised per head, so only RoPE's relative phase remains; the
  frequencies' weights are chosen so that no other offset below 2048 comes within 0.16 of the peak), and
  copies the induction output found there into the head's space (strong), and that position's token (weak).

The token predicted at position t is then the induction output at t - OFFSET (the token that once
followed x_(t-OFFSET)) or, when that was empty, x_(t-OFFSET) itself: the first OFFSET decode steps read the
transferred KV, the later ones also the decoder's own GDN state. Zeroing the full-attention KV after the
prompt changes ~80% of the greedy tokens, zeroing the GDN states ~40%; the smallest greedy gap is ~0.65
of the logits' spread in bfloat16 (computing in float32 moves it by < 0.06).
"""
from __future__ import annotations

from typing import Dict

from .base import TinyArch

__all__ = ["Qwen3Next"]

# RoPE frequency pairs' weights of the positional attention (Qwen3-Next rotates 16 of 64 dims: 8 pairs)
_PAIR_WEIGHTS = (3, 1, 1, 2, 1, 1, 0, 0)
_WRITERS = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


class Qwen3Next(TinyArch):
    name = "qwen3-next"
    summary = "Qwen3-Next, Gated DeltaNet x3 + full attention, 4 experts (bfloat16)"
    model_class = "Qwen3NextForCausalLM"
    dtype = "bfloat16"
    seed = 1
    layers = (4, 2)
    hidden_multiple = 64

    def check_args(self, layers: int, hidden: int):
        return super().check_args(layers, hidden) or (None if hidden >= 256 else "--hidden must be >= 256")

    def spec(self, seed: int, layers: int, hidden: int, head_scale: float = 16.0, offset: int = 8,
             sharpness: float = 4.0, induction: float = 8.0, fallback: float = 3.0, quiet: float = 0.25) -> Dict:
        types = ["linear_attention"] * (layers - 1) + ["full_attention"]
        return {"seed": seed, "layers": layers, "hidden": hidden, "heads": 8, "kv_heads": 2, "head_dim": 64,
                "linear_key_heads": 4, "linear_value_heads": 8, "linear_head_dim": 64, "experts": 4,
                "experts_per_token": 2, "intermediate": hidden, "layer_types": types, "head_scale": head_scale,
                "offset": offset, "sharpness": sharpness, "induction": induction, "fallback": fallback,
                "quiet": quiet, "pair_weights": list(_PAIR_WEIGHTS), "version": 1}

    def config(self, spec: Dict, vocab: int, special):
        from transformers import Qwen3NextConfig
        return Qwen3NextConfig(
            vocab_size=vocab, hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
            num_hidden_layers=spec["layers"], layer_types=spec["layer_types"], num_attention_heads=spec["heads"],
            num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"],
            linear_num_key_heads=spec["linear_key_heads"], linear_num_value_heads=spec["linear_value_heads"],
            linear_key_head_dim=spec["linear_head_dim"], linear_value_head_dim=spec["linear_head_dim"],
            num_experts=spec["experts"], num_experts_per_tok=spec["experts_per_token"],
            moe_intermediate_size=spec["intermediate"], shared_expert_intermediate_size=spec["intermediate"],
            max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="bfloat16", **special)

    def describe(self, spec: Dict) -> str:
        return "%d GDN + 1 full-attention layers, hidden %d, %d/%d heads, GDN %d/%d heads" % (
            spec["layers"] - 1, spec["hidden"], spec["heads"], spec["kv_heads"], spec["linear_key_heads"],
            spec["linear_value_heads"])

    def shape(self, model, spec: Dict) -> None:
        from . import qwen3_next_parts as parts
        lay = parts.Layout(spec["hidden"], spec["linear_head_dim"])
        parts.embed_and_head(model, lay, spec["head_scale"])
        for name, p in model.named_parameters():  # every writer into the token part only, scaled down
            if name.endswith(_WRITERS):
                rows = p[:, :lay.tok.start, :] if p.dim() == 3 else p[:lay.tok.start]
                rows.zero_()
                p.mul_(spec["quiet"])
        layers = model.model.layers
        fwd = parts.induction(layers[0].linear_attn, lay)
        parts.positional_copy(layers[-1].self_attn, lay, spec, _PAIR_WEIGHTS, model.config, fwd)
