"""vLLM's KV cache groups as the connector sees them: :class:`GroupSpec`, one per group that moves (vLLM's
``transfer_group_ids``), from vLLM's ``KVCacheConfig`` (:func:`group_specs`).

Four kinds move: ``full`` (full attention), ``sliding`` (a sliding window: vLLM keeps, and the decoder wants,
only the blocks the window still covers), ``mla`` (the latent of multi-head latent attention: one tensor per
layer, the same on every TP rank) and ``mamba`` (linear attention / SSM state: one state per request, the
state after the prompt). Any other kind stops the instance at start-up, naming it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

__all__ = ["GroupSpec", "group_specs", "KINDS", "backoff_of", "latent_of"]

KINDS = ("full", "sliding", "mla", "mamba")


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group: ``index`` in vLLM's ``kv_cache_groups`` (its block ids' position in the tuples vLLM
    hands out), ``kind``, tokens per block (a Mamba group: tokens one state block stands for), its layers
    (vLLM's names), and per kind: the KV heads of this rank, their total over the TP ranks and the head
    size (attention), the window (``sliding``); ``detail``: what else both ends must agree on (``mla``: the
    latent's split, kv_lora_rank + rope dim, which its width alone does not tell; ``mamba``: the states'
    kind, shapes and dtypes, and vLLM's Mamba cache mode); ``cache_dtype``
    vLLM's ``--kv-cache-dtype`` of attention and MLA groups (FP8 KV is stored as bytes: the tensors do not
    tell its formats apart)."""

    kind: str
    block_size: int
    layer_names: Tuple[str, ...] = ()   # () (a single group only): every layer vLLM registers
    num_kv_heads: int = 1
    head_size: int = 0
    total_kv_heads: int = 0             # 0: num_kv_heads times the TP size
    window: int = 0
    detail: str = ""
    index: int = 0
    cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"GroupSpec.kind must be one of {KINDS}, not {self.kind!r}")
        object.__setattr__(self, "layer_names", tuple(self.layer_names))

    def describe(self) -> str:
        what = {"full": "full attention", "sliding": f"sliding window of {self.window}", "mla": "MLA latent",
                "mamba": "Mamba state"}[self.kind]
        return f"{what}, {len(self.layer_names)} layers, blocks of {self.block_size} tokens"


def _spec_kind(spec: Any) -> Tuple[str, dict]:
    """``(kind, extra fields)`` of a vLLM KVCacheSpec; NotImplementedError naming any other."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec
    t = type(spec)
    if t is MLAAttentionSpec:
        return "mla", {"head_size": spec.head_size}  # the latent's split comes from the model (group_specs)
    if t is FullAttentionSpec:
        if getattr(spec, "attention_chunk_size", None):
            raise NotImplementedError("HixlConnector does not move chunked local attention KV")
        return "full", {"num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size}
    if t is SlidingWindowSpec:
        if getattr(spec, "extra_retained_tokens", 0):
            raise NotImplementedError(f"HixlConnector does not move a sliding window that keeps "
                                      f"{spec.extra_retained_tokens} extra tokens")
        return "sliding", {"num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
                           "window": int(spec.sliding_window)}
    if t is MambaSpec:
        if getattr(spec, "num_speculative_blocks", 0):
            raise NotImplementedError("HixlConnector does not move Mamba state with speculative blocks")
        state = (f"{getattr(spec.mamba_type, 'name', spec.mamba_type)}:{tuple(map(tuple, spec.shapes))}:"
                 f"{tuple(str(d).replace('torch.', '') for d in spec.dtypes)}:{spec.mamba_cache_mode}")
        return "mamba", {"detail": state}
    raise NotImplementedError(f"HixlConnector does not move KV cache groups of {t.__name__} (it moves full "
                              f"attention, sliding window, MLA and Mamba state groups)")


def group_specs(kv_cache_config: Any, total_kv_heads: int = 0, cache_dtype: str = "auto",
                latent: str = "") -> List[GroupSpec]:
    """The groups of vLLM's ``KVCacheConfig`` that move (``enable_kv_transfer``), in vLLM's order;
    ``cache_dtype``: vLLM's ``cache_config.cache_dtype`` (``fp8`` is ``fp8_e4m3``); ``latent``: an MLA
    model's split of its latent (:func:`latent_of`)."""
    cache_dtype = "fp8_e4m3" if cache_dtype == "fp8" else str(cache_dtype)
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        if not getattr(g, "enable_kv_transfer", True):
            continue
        kind, extra = _spec_kind(g.kv_cache_spec)
        if kind == "mla":
            extra["detail"] = latent
        out.append(GroupSpec(kind=kind, block_size=int(g.kv_cache_spec.block_size), layer_names=tuple(g.layer_names),
                             total_kv_heads=total_kv_heads if kind in ("full", "sliding") else 0, index=i,
                             cache_dtype=cache_dtype if kind != "mamba" else "auto", **extra))
    if not out:
        raise NotImplementedError("HixlConnector: the model has no KV cache group to move")
    return out


def latent_of(hf_config: Any) -> str:
    """An MLA model's latent split, ``"kv_lora_rank 512 + rope 64"`` (``""`` for other models)."""
    rank, rope = getattr(hf_config, "kv_lora_rank", None), getattr(hf_config, "qk_rope_head_dim", None)
    return f"kv_lora_rank {rank} + rope {rope}" if rank and rope else ""


def backoff_of(specs: List[GroupSpec]) -> int:
    """Prompt tokens the prefill leaves for the decoder to compute (vLLM's contract, as NIXL's): after a
    whole prompt came by transfer vLLM's decoder computes its last token again, which a Mamba state would
    then take twice, and for which a sliding window would lack the block of its oldest token when
    ``(n - window + 1)`` is a multiple of the block size. With such a group, the prefill computes
    ``n - 1`` tokens and the decoder the last one, from the state and window after ``n - 1``."""
    return 1 if any(s.kind in ("sliding", "mamba") for s in specs) else 0
