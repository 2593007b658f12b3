"""``gemma3``: the Gemma 3 text model (``Gemma3ForCausalLM``, ``gemma3_text``) with Gemma's own pattern of
sliding-window layers followed by one full-attention layer (3 + 1 by default: 4 layers; 2 layers give 1 + 1),
a 128-token window (a multiple of vLLM's CPU block size, 128; a 900-token prompt spans 7 windows),
4 query / 2 KV heads of 64. Gemma normalises each attention and MLP output before adding it (sandwich
norms), so attention already moves the residual stream; only the (untied) head is scaled."""
from __future__ import annotations

from typing import Dict

from .base import TinyArch

__all__ = ["Gemma3"]


class Gemma3(TinyArch):
    name = "gemma3"
    summary = "Gemma 3 text, sliding window 128 x3 + full attention, 4 query / 2 KV heads (float32)"
    model_class = "Gemma3ForCausalLM"
    seed = 3
    layers = (4, 2, 3)

    def spec(self, seed: int, layers: int, hidden: int, head_scale: float = 16.0, window: int = 128) -> Dict:
        types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        return {"seed": seed, "layers": layers, "hidden": hidden, "heads": 4, "kv_heads": 2, "head_dim": 64,
                "intermediate": 2 * hidden, "sliding_window": window, "layer_types": types,
                "head_scale": head_scale, "version": 1}

    def config(self, spec: Dict, vocab: int, special):
        from transformers import Gemma3TextConfig
        return Gemma3TextConfig(
            vocab_size=vocab, hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
            num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
            num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"],
            query_pre_attn_scalar=spec["head_dim"], sliding_window=spec["sliding_window"],
            layer_types=spec["layer_types"], max_position_embeddings=2048, tie_word_embeddings=False,
            torch_dtype="float32", **special)

    def shape(self, model, spec: Dict) -> None:
        model.lm_head.weight.mul_(spec["head_scale"])

    def describe(self, spec: Dict) -> str:
        n = spec["layer_types"].count("sliding_attention")
        return "%d sliding-window (%d) + %d full-attention layers, hidden %d, %d/%d heads" % (
            n, spec["sliding_window"], spec["layers"] - n, spec["hidden"], spec["heads"], spec["kv_heads"])
