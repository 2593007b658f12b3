"""``KVLayout``: the shape of one token's K (or V) in one layer, and the paging."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "float8": 1,
           "float8_e4m3": 1, "float8_e5m2": 1}
KINDS = ("kv", "latent", "state")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's K (or V) in one layer, and the paging.

    A block holds ``block_tokens`` tokens of one (layer, K|V): ``[block_tokens, n_kv_heads, head_dim]``
    elements, contiguous. ``dtype`` is a name (``float32``, ``float16``, ``bfloat16``, ...); numpy
    has no bfloat16, so its views use ``uint16`` bit patterns.

    ``kind`` says what a block holds: ``"kv"`` K and V (two planes, the default); ``"latent"`` one
    tensor per token and layer (MLA's compressed latent, ``n_kv_heads`` 1 and ``head_dim`` the latent
    width); ``"state"`` one request's recurrent state after the block's tokens (Mamba / linear
    attention: conv and SSM state), ``n_kv_heads * head_dim`` elements per block whatever its tokens.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_tokens: int = 16
    kind: str = "kv"

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "block_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, not {v!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.kind not in KINDS:
            raise ValueError(f"KVLayout.kind {self.kind!r} is not one of {KINDS}")

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype of views (bfloat16 -> uint16, float8 -> uint8: bit patterns)."""
        return np.dtype("uint8" if self.dtype.startswith("float8") else
                        {"bfloat16": "uint16"}.get(self.dtype, self.dtype))

    @property
    def planes(self) -> int:
        """Tensors per (layer, block): 2 (K and V) for ``kv``, 1 otherwise."""
        return 2 if self.kind == "kv" else 1

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V, or latent) in one layer (of a state: its whole block)."""
        return self.n_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one plane."""
        return self.token_bytes if self.kind == "state" else self.block_tokens * self.token_bytes

    def blocks_for(self, n_tokens: int) -> int:
        return -(-int(n_tokens) // self.block_tokens)

    def kv_bytes(self, n_tokens: int, layers: Optional[Tuple[int, int]] = None) -> int:
        """Bytes of K plus V (every plane) of ``n_tokens`` tokens over ``layers`` (default: all); of a
        state, its blocks'."""
        lo, hi = layers or (0, self.n_layers)
        if self.kind == "state":
            return (hi - lo) * self.blocks_for(n_tokens) * self.block_bytes
        return (hi - lo) * self.planes * int(n_tokens) * self.token_bytes

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def for_model(cls, config: Any, dtype: str = "float32", block_tokens: int = 16) -> "KVLayout":
        """From a model config with ``n_layers``, ``n_kv_heads`` and ``head_dim`` attributes."""
        return cls(int(config.n_layers), int(config.n_kv_heads), int(config.head_dim), dtype, block_tokens)


_U64 = 2 ** 64


@dataclass(frozen=True)
class BlockMemory:
    """Where one side's KV blocks live: the addressing a transfer needs, for memory ``hixl.kv``
    allocated itself (:class:`KVPool`) or memory an inference engine owns (bring your own memory:
    :meth:`KVPool.wrap`, e.g. vLLM's KV cache tensors).

    The unit of transfer is one block of one layer and one *part*: with ``parts == 2`` K and V sit
    in blocks of their own (part 0 is K, part 1 is V); with ``parts == 1`` a block holds both (vLLM's
    CPU cache packs K and V into the last dimension). Unit ``(layer, part, block)`` starts at
    ``layer_addrs[layer] + part * part_stride + block * block_stride`` and is ``unit_bytes`` long.
    ``token_major``: a block's first ``t`` tokens are its first ``t * unit_bytes / block_tokens``
    bytes, so a partly filled last block may be sent short; otherwise (head-major interiors, e.g.
    vLLM's ``[head][token][dim]``) whole blocks are sent.
    """

    layer_addrs: Tuple[int, ...]
    num_blocks: int
    block_stride: int
    unit_bytes: int
    parts: int = 2
    part_stride: int = 0
    token_major: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_addrs", tuple(int(a) for a in self.layer_addrs))
        for name in ("num_blocks", "block_stride", "unit_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"BlockMemory.{name} must be a positive int, not {v!r}")
        if self.parts not in (1, 2):
            raise ValueError(f"BlockMemory.parts must be 1 (K and V packed) or 2, not {self.parts!r}")
        if self.parts == 2 and (not isinstance(self.part_stride, int) or self.part_stride <= 0):
            raise ValueError(f"BlockMemory.part_stride must be a positive int with parts=2, not {self.part_stride!r}")
        if not self.layer_addrs or any(a <= 0 or a + self.span > _U64 for a in self.layer_addrs):
            raise ValueError("BlockMemory.layer_addrs must be non-empty u64 addresses with room for every block")
        if self.block_stride < self.unit_bytes and self.num_blocks > 1:
            raise ValueError(f"BlockMemory: blocks overlap (block_stride {self.block_stride} < unit_bytes "
                             f"{self.unit_bytes})")

    @property
    def span(self) -> int:
        """Bytes from a layer's address to the end of its last unit."""
        return (self.parts - 1) * self.part_stride + (self.num_blocks - 1) * self.block_stride + self.unit_bytes

    def addr(self, layer: int, part: int, block: int) -> int:
        """The one place a unit's address is computed."""
        return self.layer_addrs[layer] + part * self.part_stride + block * self.block_stride

    def ranges(self) -> List[Tuple[int, int]]:
        """The memory the units cover, as merged ``(addr, len)`` ranges (what to register)."""
        return merge_ranges((a, self.span) for a in self.layer_addrs)

    def check(self, layout: "KVLayout") -> None:
        """Raises ValueError when this memory cannot hold ``layout``."""
        if len(self.layer_addrs) != layout.n_layers:
            raise ValueError(f"BlockMemory has {len(self.layer_addrs)} layers, the layout {layout.n_layers}")
        if layout.planes % self.parts:
            raise ValueError(f"BlockMemory has {self.parts} parts per block, a {layout.kind} layout "
                             f"{layout.planes} plane(s)")
        per = layout.planes // self.parts
        want = layout.block_bytes * per
        if self.unit_bytes != want:
            raise ValueError(f"BlockMemory.unit_bytes is {self.unit_bytes}, the layout needs {want} "
                             f"({layout.block_bytes} B per {layout.kind} block x {per})")

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["layer_addrs"] = list(self.layer_addrs)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "BlockMemory":
        if not isinstance(d, dict):
            raise ValueError(f"BlockMemory must be a dict, not {type(d).__name__}")
        known = {"layer_addrs", "num_blocks", "block_stride", "unit_bytes", "parts", "part_stride", "token_major"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"BlockMemory: unknown fields {sorted(unknown)}")
        return cls(**d)


def merge_ranges(ranges: Iterable[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """``(addr, len)`` ranges merged where they overlap or touch, in address order."""
    out: List[List[int]] = []
    for a, b in sorted((a, a + n) for a, n in ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b - a) for a, b in out]


def block_desc_array(layout: KVLayout, local: BlockMemory, local_blocks: Sequence[Optional[int]],
                     remote: BlockMemory, remote_blocks: Sequence[Optional[int]], layers: Iterable[int], n_tokens: int,
                     js: Optional[Iterable[int]] = None) -> np.ndarray:
    """The descriptors moving request blocks ``js`` (default all) of ``layers``, as a ``(N, 3)`` uint64
    descriptor array ``(local, remote, len)`` for :meth:`hixl.Hixl.transfer_async` (no Python object
    per descriptor): request block ``j`` is ``local_blocks[j]`` here and ``remote_blocks[j]`` there
    (``None`` entries are not moved). One descriptor per (layer, part, block) in that order, adjacent
    ones merged; a partly filled last block is sent short only when both sides are token-major."""
    if local.parts != remote.parts:
        raise ValueError(f"the two sides pack K and V differently ({local.parts} vs {remote.parts} parts per block)")
    if local.unit_bytes != remote.unit_bytes:
        raise ValueError(f"the two sides' blocks differ in size ({local.unit_bytes} vs {remote.unit_bytes} B)")
    nb = layout.blocks_for(n_tokens)
    js = list(range(nb)) if js is None else sorted(set(js))
    js = [j for j in js if local_blocks[j] is not None and remote_blocks[j] is not None]
    layers = list(layers)
    if not js or not layers:
        return np.zeros((0, 3), np.uint64)
    j = np.asarray(js, np.int64)
    lb = np.asarray([local_blocks[x] for x in js], np.int64)
    rb = np.asarray([remote_blocks[x] for x in js], np.int64)
    n = np.full(len(js), local.unit_bytes, np.int64)
    if local.token_major and remote.token_major and layout.kind != "state":
        tail = n_tokens - (nb - 1) * layout.block_tokens  # tokens in the last block
        n[j == nb - 1] = local.unit_bytes * tail // layout.block_tokens
    parts = np.arange(local.parts, dtype=np.int64)
    la = np.asarray([local.layer_addrs[x] for x in layers], np.int64)
    ra = np.asarray([remote.layer_addrs[x] for x in layers], np.int64)
    # (layer, part, block) order, flattened
    loc = (la[:, None, None] + parts[None, :, None] * local.part_stride + lb[None, None, :] * local.block_stride).ravel()
    rem = (ra[:, None, None] + parts[None, :, None] * remote.part_stride + rb[None, None, :] * remote.block_stride).ravel()
    ln = np.broadcast_to(n, (len(layers), local.parts, len(js))).ravel()
    return merge_runs(loc, rem, ln)  # descriptor k+1 continues k when both sides are contiguous


def block_descs(layout: KVLayout, local: BlockMemory, local_blocks: Sequence[Optional[int]], remote: BlockMemory,
                remote_blocks: Sequence[Optional[int]], layers: Iterable[int], n_tokens: int,
                js: Optional[Iterable[int]] = None) -> List[Tuple[int, int, int]]:
    """:func:`block_desc_array` as a list of ``(local, remote, len)`` tuples."""
    return [(int(a), int(b), int(n)) for a, b, n in
            block_desc_array(layout, local, local_blocks, remote, remote_blocks, layers, n_tokens, js)]


def merge_runs(loc: np.ndarray, rem: np.ndarray, ln: np.ndarray) -> np.ndarray:
    """``(local, remote, len)`` runs as a ``(N, 3)`` uint64 descriptor array, each run that continues
    the one before on both sides merged into it."""
    if not len(loc):
        return np.zeros((0, 3), np.uint64)
    cont = (loc[:-1] + ln[:-1] == loc[1:]) & (rem[:-1] + ln[:-1] == rem[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    out = np.empty((len(starts), 3), np.uint64)
    out[:, 0] = loc[starts]
    out[:, 1] = rem[starts]
    out[:, 2] = np.add.reduceat(ln, starts)
    return out
