"""``llama``: 8 query heads and 4 KV heads (both divide by 2, unlike SmolLM2-135M's 9 and 3), full attention.

With the plain initialisation the smallest greedy gap was ~6e-4 of logits whose spread is ~0.3. A tied
embedding scaled x4 widens the gap but the model then repeats the prompt's last token whatever came before
it (the residual stream is that token's embedding, and the tied head ranks it first): a wrong KV would still
give the same tokens. So the head is untied and scaled (``head_scale``: logits spread like a trained
model's) and the attention's value and output projections are scaled (``attn_scale``) so that attention
moves the residual stream. The spec is the one ``hixl model tiny-llama`` always wrote, so its earlier
exports are kept."""
from __future__ import annotations

from typing import Dict

from .base import TinyArch, scale_params

__all__ = ["Llama"]


class Llama(TinyArch):
    name = "llama"
    summary = "Llama, 8 query / 4 KV heads of hidden/8, full attention (float32)"
    model_class = "LlamaForCausalLM"
    seed = 3

    def spec(self, seed: int, layers: int, hidden: int, head_scale: float = 16.0, attn_scale: float = 4.0) -> Dict:
        return {"seed": seed, "layers": layers, "hidden": hidden, "heads": 8, "kv_heads": 4,
                "intermediate": 2 * hidden, "head_scale": head_scale, "attn_scale": attn_scale, "version": 2}

    def config(self, spec: Dict, vocab: int, special):
        from transformers import LlamaConfig
        return LlamaConfig(vocab_size=vocab, hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                           num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                           num_key_value_heads=spec["kv_heads"], head_dim=spec["hidden"] // spec["heads"],
                           max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
                           torch_dtype="float32", **special)

    def shape(self, model, spec: Dict) -> None:
        model.lm_head.weight.mul_(spec["head_scale"])
        scale_params(model, ("self_attn.v_proj.weight", "self_attn.o_proj.weight"), spec["attn_scale"])
