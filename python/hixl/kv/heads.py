"""Head-sliced transfers: when tensor parallelism shards the KV heads differently on the two sides
(a prefill with TP 2 and a decoder with TP 1, or the reverse), one side's block holds more heads than
the other's, and a transfer moves only the heads both hold, from their place in one block into their
place in the other (no staging copy).

A :class:`HeadSlice` says which of the model's KV heads a side's blocks hold and how a *unit* (one
block of one layer and one part, as :class:`~hixl.kv.layout.BlockMemory` addresses it) is laid out
inside: ``order == "head"``: ``[heads][tokens][row]`` (vLLM's CPU cache ``[blocks, heads, tokens,
2 * head_size]``, K and V packed in the row; the GPU HND layouts ``[.., heads, tokens, head_size]``):
a head range is one contiguous run; ``order == "token"``: ``[tokens][heads][row]`` (the GPU NHD layout
``[2, blocks, tokens, heads, head_size]``): a head range is one run per token. ``row`` is the bytes of
one (head, token) in a unit.

:func:`head_range` is vLLM's sharding of the heads over TP ranks (replicated heads when a model has
fewer KV heads than ranks), :func:`head_sources` which remote ranks to take a head range from,
:func:`head_runs` the byte runs of one unit and :func:`sliced_desc_array` the descriptors of a
transfer (numpy arrays, no Python object per descriptor).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .layout import BlockMemory, merge_runs

ORDERS = ("head", "token")


@dataclass(frozen=True)
class HeadSlice:
    """The KV heads ``[lo, hi)`` (of the model's) a side's blocks hold, and a unit's interior."""

    lo: int
    hi: int
    order: str      # "head": [heads][tokens][row]; "token": [tokens][heads][row]
    tokens: int     # tokens per block
    row: int        # bytes of one (head, token) in a unit

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"HeadSlice.order must be one of {ORDERS}, not {self.order!r}")
        for name in ("lo", "hi", "tokens", "row"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"HeadSlice.{name} must be a non-negative int, not {v!r}")
        if not self.lo < self.hi or self.tokens <= 0 or self.row <= 0:
            raise ValueError(f"HeadSlice: heads [{self.lo}, {self.hi}), {self.tokens} tokens, rows of "
                             f"{self.row} B is empty")

    @property
    def n(self) -> int:
        return self.hi - self.lo

    @property
    def unit_bytes(self) -> int:
        return self.n * self.tokens * self.row

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "HeadSlice":
        if not isinstance(d, dict) or set(d) != {"lo", "hi", "order", "tokens", "row"}:
            raise ValueError(f"HeadSlice must be a dict of lo, hi, order, tokens, row, not {d!r}")
        return cls(**d)


def head_range(rank: int, tp: int, total: int) -> Tuple[int, int]:
    """The KV heads ``[lo, hi)`` TP rank ``rank`` of ``tp`` holds of ``total`` (vLLM's sharding: an
    equal share each, or, with fewer heads than ranks, head ``rank * total // tp`` replicated on
    ``tp // total`` ranks). Raises ValueError when the heads do not divide."""
    if not (isinstance(tp, int) and tp > 0 and isinstance(total, int) and total > 0 and 0 <= rank < tp):
        raise ValueError(f"head_range: rank {rank!r} of TP {tp!r} with {total!r} KV heads")
    if total >= tp:
        if total % tp:
            raise ValueError(f"head_range: {total} KV heads do not divide over TP {tp}")
        n = total // tp
        return rank * n, (rank + 1) * n
    if tp % total:
        raise ValueError(f"head_range: TP {tp} is not a multiple of the {total} KV heads it replicates")
    h = rank * total // tp
    return h, h + 1


def head_sources(lo: int, hi: int, remote_tp: int, total: int, prefer: int = 0) -> List[Tuple[int, int, int]]:
    """Where to take the heads ``[lo, hi)`` from: ``(remote rank, a, b)`` per remote rank, heads
    ``[a, b)`` from it, covering ``[lo, hi)`` once. A head held by several remote ranks (replicated)
    comes from one of them: the ``prefer``-th (modulo their number), so that the local ranks spread
    over them."""
    ranges = [head_range(q, remote_tp, total) for q in range(remote_tp)]
    out: List[List[int]] = []
    for h in range(lo, hi):
        holders = [q for q, (a, b) in enumerate(ranges) if a <= h < b]
        if not holders:
            raise ValueError(f"head_sources: no rank of TP {remote_tp} holds KV head {h} of {total}")
        q = holders[prefer % len(holders)]
        if out and out[-1][0] == q and out[-1][2] == h:
            out[-1][2] = h + 1
        else:
            out.append([q, h, h + 1])
    return [(q, a, b) for q, a, b in out]


def head_fanin(rank: int, tp: int, peer_tp: int, total: int) -> int:
    """How many ranks of the peer side (TP ``peer_tp``) take heads from rank ``rank`` of this side
    (TP ``tp``), each choosing by :func:`head_sources` with ``prefer`` = its own rank."""
    n = 0
    for r in range(peer_tp):
        lo, hi = head_range(r, peer_tp, total)
        n += any(q == rank for q, _, _ in head_sources(lo, hi, tp, total, prefer=r))
    return n


def head_runs(local: HeadSlice, remote: HeadSlice, want: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """The runs moving heads ``want`` (default: all both hold) between a unit here and a unit there,
    as an ``(R, 3)`` int64 array of ``(local offset, remote offset, length)``; empty when the sides
    share no head. Raises ValueError when the two interiors differ (other than in heads)."""
    if (local.order, local.tokens, local.row) != (remote.order, remote.tokens, remote.row):
        raise ValueError(f"head_runs: the block interiors differ beyond their heads: {local} vs {remote}")
    a, b = max(local.lo, remote.lo), min(local.hi, remote.hi)
    if want is not None:
        a, b = max(a, int(want[0])), min(b, int(want[1]))
    if a >= b:
        return np.zeros((0, 3), np.int64)
    if local.order == "head":
        per = local.tokens * local.row
        return np.array([[(a - local.lo) * per, (a - remote.lo) * per, (b - a) * per]], np.int64)
    t = np.arange(local.tokens, dtype=np.int64)
    out = np.empty((local.tokens, 3), np.int64)
    out[:, 0] = t * local.n * local.row + (a - local.lo) * local.row
    out[:, 1] = t * remote.n * remote.row + (a - remote.lo) * remote.row
    out[:, 2] = (b - a) * local.row
    return out


def _unit_bases(mem: BlockMemory, blocks: np.ndarray, layers: Sequence[int]) -> np.ndarray:
    """Each (layer, part, block) unit's address, in that order, flattened."""
    la = np.asarray([mem.layer_addrs[x] for x in layers], np.int64)
    parts = np.arange(mem.parts, dtype=np.int64)
    return (la[:, None, None] + parts[None, :, None] * mem.part_stride
            + blocks[None, None, :] * mem.block_stride).ravel()


def sliced_desc_array(local: BlockMemory, local_heads: HeadSlice, local_blocks: Sequence[Optional[int]],
                      remote: BlockMemory, remote_heads: HeadSlice, remote_blocks: Sequence[Optional[int]],
                      layers: Iterable[int], js: Iterable[int],
                      want: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """The descriptors moving heads ``want`` (default: all both hold) of request blocks ``js`` and
    ``layers``, whole blocks, as an ``(N, 3)`` uint64 ``(local, remote, len)`` array for
    :meth:`hixl.Hixl.transfer_async`: request block ``j`` is ``local_blocks[j]`` here and
    ``remote_blocks[j]`` there (``None``: not moved). Descriptors go in (layer, part, block, run)
    order, adjacent ones merged."""
    if local.parts != remote.parts:
        raise ValueError(f"the two sides pack K and V differently ({local.parts} vs {remote.parts} parts per block)")
    for mem, hs, side in ((local, local_heads, "local"), (remote, remote_heads, "remote")):
        if mem.unit_bytes != hs.unit_bytes:
            raise ValueError(f"the {side} blocks are {mem.unit_bytes} B, its heads {hs} make {hs.unit_bytes} B")
    runs = head_runs(local_heads, remote_heads, want)
    js = [j for j in sorted(set(js)) if local_blocks[j] is not None and remote_blocks[j] is not None]
    layers = list(layers)
    if not js or not layers or not len(runs):
        return np.zeros((0, 3), np.uint64)
    lb = np.asarray([local_blocks[j] for j in js], np.int64)
    rb = np.asarray([remote_blocks[j] for j in js], np.int64)
    loc = (_unit_bases(local, lb, layers)[:, None] + runs[None, :, 0]).ravel()
    rem = (_unit_bases(remote, rb, layers)[:, None] + runs[None, :, 1]).ravel()
    ln = np.broadcast_to(runs[:, 2], (len(loc) // len(runs), len(runs))).ravel()
    return merge_runs(loc, rem, ln)


def layouts_match(a: Dict[str, Any], b: Dict[str, Any], sliced: bool) -> bool:
    """Whether two sides' :class:`~hixl.kv.layout.KVLayout` dicts can be copied between: equal, or
    (``sliced``: head-sliced transfers) equal but for their KV heads."""
    if not sliced:
        return a == b
    return {k: v for k, v in a.items() if k != "n_kv_heads"} == {k: v for k, v in b.items() if k != "n_kv_heads"}


def check_sliced(mem: BlockMemory, heads: HeadSlice, n_layers: int, what: str) -> None:
    """Raises ValueError when ``mem`` cannot hold ``n_layers`` layers of units of ``heads``."""
    if len(mem.layer_addrs) != n_layers:
        raise ValueError(f"{what} has {len(mem.layer_addrs)} layers, the layout {n_layers}")
    if mem.unit_bytes != heads.unit_bytes:
        raise ValueError(f"{what}'s blocks are {mem.unit_bytes} B, its heads {heads} make {heads.unit_bytes} B")
