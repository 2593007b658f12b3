"""vLLM's KV cache tensors as hixl.kv moves them: each KV cache group (:class:`~hixl.vllm.specs.GroupSpec`)
described as a :class:`CacheGroup` (a :class:`hixl.kv.KVLayout`, a :class:`hixl.kv.BlockMemory` over vLLM's
own tensors, the block interior both ends must agree on, this rank's KV heads), and all of them as
:class:`CacheGroups` (the :class:`hixl.kv.KVGroups` of one pool, the layers' numbering, what a peer must
match).

With vLLM's hybrid KV cache the groups alias one allocation (layer ``i`` of every group starts at the same
address; a block id belongs to one group at a time): memory is registered once, and a transfer moves each
layer's units at the block ids of its own group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import kv
from .plan import GroupPlan
from .specs import GroupSpec, backoff_of

__all__ = ["CacheGroup", "CacheGroups", "describe_kv_caches", "describe_group", "head_slice_of"]

_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
           "torch.float8_e4m3fn": "float8_e4m3", "torch.float8_e5m2": "float8_e5m2", "torch.uint8": "uint8",
           "torch.int8": "int8"}


def _dtype_of(t: Any) -> str:
    dtype = _DTYPES.get(str(t.dtype))
    if dtype is None:
        raise NotImplementedError(f"HixlConnector: KV cache dtype {t.dtype} is not supported")
    return dtype


def _uniform(kv_caches: Dict[str, Any], names: Sequence[str]) -> Tuple[Any, Tuple[int, ...], Tuple[int, ...]]:
    """The first layer's tensor, shape and stride; NotImplementedError when another layer differs."""
    t = kv_caches[names[0]]
    if isinstance(t, (list, tuple)):
        raise NotImplementedError(f"HixlConnector: layer {names[0]}'s KV cache is a {type(t).__name__} of "
                                  f"{len(t)} tensors, not one tensor")
    shape, stride = tuple(t.shape), tuple(t.stride())
    for n in names:
        o = kv_caches[n]
        if tuple(o.shape) != shape or tuple(o.stride()) != stride or o.dtype != t.dtype:
            raise NotImplementedError(f"HixlConnector: layer {n} has a KV cache of shape {tuple(o.shape)}, stride "
                                      f"{tuple(o.stride())}, {o.dtype}; layer {names[0]} has {shape}, {stride}, "
                                      f"{t.dtype}")
    return t, shape, stride


def describe_kv_caches(kv_caches: Dict[str, Any], names: Sequence[str], num_blocks: int, block_size: int,
                       num_kv_heads: int, head_size: int) -> Tuple[kv.KVLayout, kv.BlockMemory, str]:
    """Attention layers' KV cache tensors as a :class:`hixl.kv.KVLayout`, a :class:`hixl.kv.BlockMemory`
    (where each layer's blocks are) and a string naming the block interior (both ends must agree).

    Known shapes (each block's bytes contiguous): ``[blocks, heads, tokens, 2 * head]`` (the CPU
    backend: K and V packed in one block, one unit per (layer, block)); ``[2, blocks, ...]`` and
    ``[blocks, 2, ...]`` (K and V in blocks of their own). Blocks always move whole."""
    t, shape, stride = _uniform(kv_caches, names)
    dtype = _dtype_of(t)
    layout = kv.KVLayout(n_layers=len(names), n_kv_heads=num_kv_heads, head_dim=head_size, dtype=dtype,
                         block_tokens=block_size)
    isz = t.element_size()
    block = layout.block_bytes  # one of K or V
    if len(shape) >= 2 and shape[0] == num_blocks and t[0].is_contiguous() and t[0].nbytes == 2 * block:
        parts, part_stride, block_stride, unit = 1, 0, stride[0] * isz, 2 * block
        interior = f"packed{shape[1:]}"
    elif len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks and t[0, 0].is_contiguous() \
            and t[0, 0].nbytes == block:
        parts, part_stride, block_stride, unit = 2, stride[0] * isz, stride[1] * isz, block
        interior = f"kv-outer{shape[2:]}"
    elif len(shape) >= 3 and shape[0] == num_blocks and shape[1] == 2 and t[0, 0].is_contiguous() \
            and t[0, 0].nbytes == block:
        parts, part_stride, block_stride, unit = 2, stride[1] * isz, stride[0] * isz, block
        interior = f"kv-inner{shape[2:]}"
    else:
        raise NotImplementedError(f"HixlConnector: a KV cache of shape {shape} and stride {stride} "
                                  f"({num_blocks} blocks of {block_size} tokens, {num_kv_heads} heads of "
                                  f"{head_size}) is not a layout it knows")
    memory = kv.BlockMemory(layer_addrs=tuple(kv_caches[n].data_ptr() for n in names), num_blocks=num_blocks,
                            block_stride=block_stride, unit_bytes=unit, parts=parts, part_stride=part_stride,
                            token_major=False)
    return layout, memory, f"{dtype}:{interior}"


def _describe_latent(kv_caches: Dict[str, Any], names: Sequence[str], num_blocks: int,
                     spec: GroupSpec) -> Tuple[kv.KVLayout, kv.BlockMemory, str]:
    """MLA: ``[blocks, 1, tokens, latent]`` or ``[blocks, tokens, latent]``, one plane per block."""
    t, shape, stride = _uniform(kv_caches, names)
    dtype = _dtype_of(t)
    latent = shape[-1]
    if not (shape[0] == num_blocks and shape[1:] in ((1, spec.block_size, latent), (spec.block_size, latent))
            and t[0].is_contiguous()):
        raise NotImplementedError(f"HixlConnector: an MLA cache of shape {shape} and stride {stride} ({num_blocks} "
                                  f"blocks of {spec.block_size} tokens) is not a layout it knows")
    layout = kv.KVLayout(n_layers=len(names), n_kv_heads=1, head_dim=latent, dtype=dtype,
                         block_tokens=spec.block_size, kind="latent")
    memory = kv.BlockMemory(layer_addrs=tuple(kv_caches[n].data_ptr() for n in names), num_blocks=num_blocks,
                            block_stride=stride[0] * t.element_size(), unit_bytes=t[0].nbytes, parts=1,
                            token_major=True)
    return layout, memory, f"{dtype}:latent{shape[1:]}" + (f":{spec.detail}" if spec.detail else "")


def _describe_state(kv_caches: Dict[str, Any], names: Sequence[str], num_blocks: int,
                    spec: GroupSpec) -> Tuple[kv.KVLayout, kv.BlockMemory, str]:
    """Mamba: a byte view ``[blocks, ..., state bytes]`` of padded pages (each page: the conv state, then the
    SSM state); a unit is a block's states, without the page's padding."""
    t, shape, stride = _uniform(kv_caches, names)
    if shape[0] != num_blocks or not t[0].is_contiguous():
        raise NotImplementedError(f"HixlConnector: a Mamba state cache of shape {shape} and stride {stride} "
                                  f"({num_blocks} blocks) is not a layout it knows")
    unit = t[0].nbytes
    layout = kv.KVLayout(n_layers=len(names), n_kv_heads=1, head_dim=unit, dtype="uint8",
                         block_tokens=spec.block_size, kind="state")
    memory = kv.BlockMemory(layer_addrs=tuple(kv_caches[n].data_ptr() for n in names), num_blocks=num_blocks,
                            block_stride=stride[0] * t.element_size(), unit_bytes=unit, parts=1, token_major=False)
    return layout, memory, f"state({unit}):{spec.detail}"


def head_slice_of(interior: str, num_kv_heads: int, block_size: int, lo: int, hi: int) -> Optional[kv.HeadSlice]:
    """The :class:`hixl.kv.HeadSlice` of blocks of ``interior`` (:func:`describe_kv_caches`) holding the
    KV heads ``[lo, hi)``; None when the interior does not say where its heads are (a block of as many
    tokens as heads, heads and tokens not told apart: such blocks move whole only)."""
    try:
        dtype, rest = interior.split(":", 1)
        kind, dims_s = rest.split("(", 1)
        dims = tuple(int(x) for x in dims_s.rstrip(")").split(",") if x.strip())
        isz = kv.KVLayout(n_layers=1, n_kv_heads=1, head_dim=1, dtype=dtype).itemsize
    except ValueError:
        return None
    if len(dims) != 3 or hi - lo != num_kv_heads:
        return None
    if dims[:2] == (num_kv_heads, block_size) and (num_kv_heads != block_size or kind == "packed"):
        order = "head"
    elif dims[:2] == (block_size, num_kv_heads) and num_kv_heads != block_size:
        order = "token"
    else:
        return None
    return kv.HeadSlice(lo=lo, hi=hi, order=order, tokens=block_size, row=dims[2] * isz)


def _blocks_said(kind: Any, block_size: Any, window: Any, cache_dtype: Any) -> str:
    return (f"{kind} blocks of {block_size} tokens" + (f" (window {window})" if window else "")
            + (f", KV cache dtype {cache_dtype}" if cache_dtype != "auto" else ""))


@dataclass(frozen=True)
class CacheGroup:
    """One group's layers (in their order here), layout, memory, block interior and this rank's KV heads
    (attention groups whose interior says where heads are; None: blocks move whole)."""

    spec: GroupSpec
    names: Tuple[str, ...]
    layout: kv.KVLayout
    memory: kv.BlockMemory
    interior: str
    heads: Optional[kv.HeadSlice] = None

    def info(self) -> Dict[str, Any]:
        """What a peer must agree on (and, for a pull, needs) about this group."""
        return {"kind": self.spec.kind, "block_size": self.spec.block_size, "window": self.spec.window,
                "cache_dtype": self.spec.cache_dtype, "interior": self.interior, "layout": dict(vars(self.layout)),
                "memory": self.memory.to_dict(), "heads": self.heads.to_dict() if self.heads is not None else None}


def describe_group(spec: GroupSpec, kv_caches: Dict[str, Any], names: Sequence[str], num_blocks: int,
                   rank: int = 0, tp: int = 1) -> CacheGroup:
    """A :class:`CacheGroup` of ``spec``'s layers ``names`` (their tensors in ``kv_caches``)."""
    if spec.kind == "mla":
        layout, memory, interior = _describe_latent(kv_caches, names, num_blocks, spec)
        return CacheGroup(spec, tuple(names), layout, memory, interior)
    if spec.kind == "mamba":
        layout, memory, interior = _describe_state(kv_caches, names, num_blocks, spec)
        return CacheGroup(spec, tuple(names), layout, memory, interior)
    layout, memory, interior = describe_kv_caches(kv_caches, names, num_blocks, spec.block_size, spec.num_kv_heads,
                                                  spec.head_size)
    heads = None
    try:
        lo, hi = kv.head_range(rank, tp, spec.total_kv_heads or spec.num_kv_heads * tp)
        heads = head_slice_of(interior, spec.num_kv_heads, spec.block_size, lo, hi)
    except ValueError:
        pass  # heads that do not divide over the ranks: blocks move whole only (a peer of another TP is refused)
    return CacheGroup(spec, tuple(names), layout, memory, interior, heads)


class CacheGroups:
    """Every group that moves: ``kv`` the :class:`hixl.kv.KVGroups` of the pool (layers numbered group
    after group), ``index`` a layer's global number by its vLLM name, ``order`` the layers in the order
    the forward pass computes them, ``hooked`` those whose vLLM ``save_kv_layer`` hook runs (attention
    and MLA layers; Mamba layers have none: their state moves when the step's forward ends)."""

    @classmethod
    def single(cls, layout: kv.KVLayout, memory: kv.BlockMemory, interior: str,
               heads: Optional[kv.HeadSlice] = None, total_kv_heads: int = 0) -> "CacheGroups":
        """One full-attention group over ``memory`` (its layers named ``layer.<i>``): for a caller with
        a pool of its own (tests)."""
        names = tuple(f"layer.{i}" for i in range(layout.n_layers))
        spec = GroupSpec("full", layout.block_tokens, names, layout.n_kv_heads, layout.head_dim, total_kv_heads)
        return cls([CacheGroup(spec, names, layout, memory, interior, heads)], {n: i for i, n in enumerate(names)})

    def __init__(self, groups: List[CacheGroup], layer_order: Dict[str, int]):
        self.items = list(groups)
        self.kv = kv.KVGroups(tuple(g.layout for g in groups), tuple(g.memory for g in groups))
        self.index: Dict[str, int] = {}
        for k, g in enumerate(groups):
            for i, n in enumerate(g.names):
                self.index[n] = self.kv.layers(k).start + i
        self.order = sorted(self.index.values(), key=lambda x: layer_order[self._name(x)])
        self.hooked = {x for x in self.index.values() if self.kind_of(x) != "mamba"}
        self.backoff = backoff_of([g.spec for g in groups])
        self.plans = [GroupPlan(g.spec.kind, g.spec.total_kv_heads or g.layout.n_kv_heads, g.heads is not None)
                      for g in groups]
        # the MLA latent crosses the network once, the other decoder ranks copying it (a relay), when it is
        # all the model moves; beside other groups it comes from a prefill rank to each decoder rank
        self.relay = all(g.spec.kind == "mla" for g in groups)

    def _name(self, layer: int) -> str:
        g, i = self.kv.group_of(layer)
        return self.items[g].names[i]

    def kind_of(self, layer: int) -> str:
        return self.items[self.kv.group_of(layer)[0]].spec.kind

    def __len__(self) -> int:
        return len(self.items)

    @property
    def heads(self) -> List[Optional[kv.HeadSlice]]:
        return [g.heads for g in self.items]

    def infos(self) -> List[Dict[str, Any]]:
        return [g.info() for g in self.items]

    def mismatch(self, theirs: Any, sliced: Sequence[bool] = ()) -> Optional[str]:
        """Why a peer's groups (its :meth:`infos`) cannot be copied to or from ours as they are, naming
        the group and both sides; None when they can. ``sliced[k]``: group ``k`` moves head-sliced
        (the two sides hold different KV heads: their interiors may differ in heads only)."""
        if not isinstance(theirs, list) or len(theirs) != len(self.items):
            if not isinstance(theirs, list) or not all(isinstance(t, dict) for t in theirs):
                return (f"the peer's KV cache groups are {theirs!r:.200}, this side has {len(self.items)} "
                        f"({self.describe()})")
            said = "; ".join(f"{k}: {_blocks_said(t.get('kind'), t.get('block_size'), t.get('window'), t.get('cache_dtype'))}"
                             for k, t in enumerate(theirs))
            return (f"the peer has {len(theirs)} KV cache group(s) ({said}), this side has {len(self.items)} "
                    f"({self.describe()})")
        for k, (g, t) in enumerate(zip(self.items, theirs)):
            if not isinstance(t, dict):
                return f"KV cache group {k} of the peer is {t!r:.100}"
            cut = k < len(sliced) and sliced[k]
            mine = (g.spec.kind, g.spec.block_size, g.spec.window, g.spec.cache_dtype,
                    g.interior.split("(")[0] if cut else g.interior)
            other = (t.get("kind"), t.get("block_size"), t.get("window"), t.get("cache_dtype"),
                     str(t.get("interior")).split("(")[0] if cut else t.get("interior"))
            if mine != other:
                return (f"KV cache group {k}: this side has {_blocks_said(*mine[:4])}, {g.interior}; the peer "
                        f"{_blocks_said(*other[:4])}, {t.get('interior')}")
        return None

    def describe(self) -> str:
        return "; ".join(f"{k}: {g.spec.describe()}" for k, g in enumerate(self.items))

    def unit_bytes(self, blocks: Sequence[Sequence[Optional[int]]], n_tokens: int) -> Dict[str, int]:
        """Bytes a transfer of ``blocks`` (per group, None: not moved) of ``n_tokens`` tokens moves, by group
        kind (a token-major block that is partly filled moves its tokens only)."""
        out: Dict[str, int] = {}
        for g, lst in zip(self.items, blocks):
            unit = g.memory.unit_bytes * g.memory.parts
            n = 0
            for j, b in enumerate(lst):
                if b is not None:
                    tokens = min(g.layout.block_tokens, n_tokens - j * g.layout.block_tokens)
                    n += unit * tokens // g.layout.block_tokens if g.memory.token_major and g.layout.kind != "state" \
                        else unit
            out[g.spec.kind] = out.get(g.spec.kind, 0) + n * g.layout.n_layers
        return out
