"""``gpt-oss``: GPT-OSS's alternation of sliding-window (even layers, what vLLM assumes) and full-attention
layers with attention sinks, a 128-token window (GPT-OSS's own, a multiple of vLLM's CPU block size), and a
mixture of 4 experts (2 a token) unquantized (vLLM's CPU unquantized experts). 4 query / 2 KV heads of 64.
The head is untied and scaled, and the attention's value and output projections are scaled so that
attention moves the residual stream."""
from __future__ import annotations

from typing import Dict

from .base import TinyArch, scale_params

__all__ = ["GptOss"]


class GptOss(TinyArch):
    name = "gpt-oss"
    summary = "GPT-OSS, sliding window 128 / full attention alternating, 4 experts (float32)"
    model_class = "GptOssForCausalLM"
    seed = 1
    layers = (4, 2)

    def spec(self, seed: int, layers: int, hidden: int, head_scale: float = 16.0, attn_scale: float = 4.0,
             window: int = 128) -> Dict:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        return {"seed": seed, "layers": layers, "hidden": hidden, "heads": 4, "kv_heads": 2, "head_dim": 64,
                "experts": 4, "experts_per_token": 2, "intermediate": hidden, "sliding_window": window,
                "layer_types": types, "head_scale": head_scale, "attn_scale": attn_scale, "version": 1}

    def config(self, spec: Dict, vocab: int, special):  # GPT-OSS's YaRN RoPE (x32 of 4096: 131072)
        from transformers import GptOssConfig
        return GptOssConfig(
            vocab_size=vocab, hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
            num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
            num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"], num_local_experts=spec["experts"],
            num_experts_per_tok=spec["experts_per_token"], sliding_window=spec["sliding_window"],
            layer_types=spec["layer_types"], max_position_embeddings=131072, tie_word_embeddings=False,
            torch_dtype="float32", **special)

    def shape(self, model, spec: Dict) -> None:
        model.lm_head.weight.mul_(spec["head_scale"])
        scale_params(model, ("self_attn.v_proj.weight", "self_attn.o_proj.weight"), spec["attn_scale"])

    def describe(self, spec: Dict) -> str:
        return "%d layers alternating sliding window %d / full, hidden %d, %d/%d heads, %d experts" % (
            spec["layers"], spec["sliding_window"], spec["hidden"], spec["heads"], spec["kv_heads"],
            spec["experts"])
