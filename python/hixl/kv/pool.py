"""``KVPool``: registered memory for the KV blocks of every layer, plus per-request aux slots."""
from __future__ import annotations

import ctypes
import hashlib
import threading
from typing import Iterable, List, Optional, Sequence, Tuple

import numpy as np

from ..engine import Hixl
from ..types import SUCCESS, MemDesc, MemType
from .errors import KVError, PoolExhausted
from .groups import KVGroups
from .layout import BlockMemory, KVLayout

_PAGE = 4096


class _Ids:
    """A pool of integer ids [0, n) taken and given back in batches; ``take`` can wait."""

    def __init__(self, n: int, what: str):
        self._free: List[int] = list(range(n - 1, -1, -1))  # pop() hands out low ids first
        self._n, self._what = n, what
        self._cv = threading.Condition()

    @property
    def free(self) -> int:
        with self._cv:
            return len(self._free)

    def take(self, count: int, timeout: Optional[float]) -> List[int]:
        if count > self._n:
            raise PoolExhausted(f"{count} {self._what} requested, the pool has {self._n} in all")
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._free) >= count, timeout):
                raise PoolExhausted(f"{count} {self._what} requested, {len(self._free)} of {self._n} free"
                                    + (f" after waiting {timeout:g} s" if timeout else ""))
            out = [self._free.pop() for _ in range(count)]
        return sorted(out)  # sorted: adjacent ids merge into one descriptor more often

    def give(self, ids: Iterable[int]) -> None:
        with self._cv:
            self._free.extend(ids)
            self._free.sort(reverse=True)
            self._cv.notify_all()


class KVPool:
    """Registered memory for ``num_blocks`` blocks of every (layer, K|V), plus ``max_requests`` aux
    slots of ``aux_bytes`` (small per-request metadata that travels with the last chunk, e.g. the
    first generated token).

    ``memory="acl"`` (default) allocates from :mod:`hixl.acl` (memfd-backed: the shm transport maps
    it and copies with memcpy) and registers it as ``MEM_DEVICE``; ``"host"`` uses a numpy array.

    :meth:`KVPool.wrap` makes a pool over memory somebody else allocated and owns (an inference
    engine's KV cache) in that owner's layout (:class:`BlockMemory`): it registers it and nothing
    more; its blocks are handed out by the owner, not by :attr:`blocks`, and it has no aux area.
    :meth:`KVPool.wrap_groups` does so for several KV cache groups (:class:`KVGroups`, e.g. vLLM's
    hybrid cache); :attr:`groups` is the pool's groups (one for the other pools), :attr:`layout` and
    :attr:`memory` its first group's.
    """

    external = False

    def __init__(self, engine: Hixl, layout: KVLayout, num_blocks: int, *, max_requests: Optional[int] = None,
                 aux_bytes: int = 256, memory: str = "acl"):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, not {num_blocks!r}")
        if memory not in ("acl", "host"):
            raise ValueError(f"memory must be 'acl' or 'host', not {memory!r}")
        if layout.kind != "kv":
            raise ValueError(f"KVPool lays out K and V blocks; a {layout.kind} layout needs memory of its "
                             f"owner's (KVPool.wrap)")
        self.engine, self.layout, self.num_blocks = engine, layout, num_blocks
        self.max_requests = int(max_requests or num_blocks)
        self.aux_bytes = int(aux_bytes)
        kv = layout.n_layers * 2 * num_blocks * layout.block_bytes
        self.aux_offset = -(-kv // _PAGE) * _PAGE
        self.nbytes = self.aux_offset + self.max_requests * self.aux_bytes
        self._acl_addr = 0
        self._host: Optional[np.ndarray] = None
        if memory == "acl":
            from .. import acl
            rc, self._acl_addr = acl.aclrtMalloc(self.nbytes, acl.ACL_MEM_MALLOC_HUGE_FIRST)
            if rc != acl.ACL_SUCCESS:
                raise KVError(f"KVPool: aclrtMalloc({self.nbytes}) failed ({rc}): {acl.last_error()}")
            self.addr = self._acl_addr
            self.bytes = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self.addr))
            mem_type = MemType.MEM_DEVICE
        else:
            self._host = np.zeros(self.nbytes, np.uint8)
            self.addr, self.bytes, mem_type = self._host.ctypes.data, self._host, MemType.MEM_HOST
        rc, self._handle = engine.register_mem(MemDesc(self.addr, self.nbytes), mem_type)
        if rc != SUCCESS:
            err = engine.last_error()
            self._free_memory()
            raise KVError(f"KVPool: register_mem({self.nbytes} bytes) failed: {err}", rc)
        self._handles = [self._handle]
        self.blocks = _Ids(num_blocks, "blocks")
        self.aux_slots = _Ids(self.max_requests, "aux slots")
        self.memory = BlockMemory(
            layer_addrs=tuple(self.addr + self.offset(layer, 0, 0) for layer in range(layout.n_layers)),
            num_blocks=num_blocks, block_stride=layout.block_bytes, unit_bytes=layout.block_bytes, parts=2,
            part_stride=num_blocks * layout.block_bytes, token_major=True)
        self.groups = KVGroups.single(layout, self.memory)

    @classmethod
    def wrap(cls, engine: Hixl, layout: KVLayout, memory: BlockMemory, *,
             mem_type: MemType = MemType.MEM_HOST) -> "KVPool":
        """A pool over memory the caller owns and keeps alive (e.g. vLLM's KV cache tensors), laid
        out as ``memory`` says. Registers the ranges it covers (adjacent layers merged into one
        region) with ``engine``; :meth:`close` deregisters them and frees nothing."""
        memory.check(layout)
        return cls.wrap_groups(engine, KVGroups.single(layout, memory), mem_type=mem_type)

    @classmethod
    def wrap_groups(cls, engine: Hixl, groups: KVGroups, *, mem_type: MemType = MemType.MEM_HOST) -> "KVPool":
        """:meth:`wrap` for several KV cache groups: each group's memory as its :class:`BlockMemory`
        says; memory the groups share is registered once."""
        self = cls.__new__(cls)
        self.engine, self.groups = engine, groups
        self.layout, self.memory = groups.layouts[0], groups.memories[0]
        self.num_blocks = self.memory.num_blocks
        self.external = True
        self.max_requests, self.aux_bytes, self.aux_offset = 0, 0, 0
        self._acl_addr, self._host, self._handle = 0, None, None
        self.blocks = None  # the owner hands out the blocks
        self.aux_slots = None
        self._handles = []
        ranges = groups.ranges()
        self.addr, self.nbytes = ranges[0][0], sum(n for _, n in ranges)
        for a, n in ranges:
            rc, h = engine.register_mem(MemDesc(a, n), mem_type)
            if rc != SUCCESS:
                err = engine.last_error()
                self.close()
                raise KVError(f"KVPool.wrap: register_mem(addr=0x{a:x}, len={n}) failed: {err}", rc)
            self._handles.append(h)
        self._handle = self._handles[0]
        self.bytes = np.zeros(0, np.uint8)
        return self
    # The one place where (layer, K|V, block, token) becomes a byte offset.
    def offset(self, layer: int, kv: int, block: int, token: int = 0) -> int:
        L = self.layout
        return ((layer * 2 + kv) * self.num_blocks + block) * L.block_bytes + token * L.token_bytes

    def aux_at(self, slot: int) -> int:
        return self.aux_offset + slot * self.aux_bytes

    def kv_view(self, layer: int, kv: int) -> np.ndarray:
        """``[num_blocks, block_tokens, n_kv_heads, head_dim]`` view of one (layer, K|V)."""
        if self.external:
            raise KVError("KVPool: a wrapped pool's block interior is its owner's layout; use unit()")
        L = self.layout
        o = self.offset(layer, kv, 0)
        raw = self.bytes[o:o + self.num_blocks * L.block_bytes]
        return raw.view(L.np_dtype).reshape(self.num_blocks, L.block_tokens, L.n_kv_heads, L.head_dim)

    def gather(self, layer: int, kv: int, blocks: Sequence[int], n_tokens: int) -> np.ndarray:
        """The first ``n_tokens`` tokens held in ``blocks`` as one ``[n_tokens, heads, dim]`` array (a copy)."""
        v = self.kv_view(layer, kv)
        L = self.layout
        return v[list(blocks)].reshape(-1, L.n_kv_heads, L.head_dim)[:n_tokens].copy()

    def scatter(self, layer: int, kv: int, blocks: Sequence[int], data: np.ndarray, start: int = 0) -> None:
        """Write ``data`` (``[T, heads, dim]``) into tokens ``start..start+T`` of ``blocks`` (what a
        paged-attention kernel's cache write does)."""
        L = self.layout
        data = np.asarray(data)
        if data.ndim != 3 or data.shape[1:] != (L.n_kv_heads, L.head_dim):
            raise ValueError(f"K/V must be [T, {L.n_kv_heads}, {L.head_dim}], got {data.shape}")
        if data.dtype != L.np_dtype:
            raise ValueError(f"K/V dtype {data.dtype} != layout dtype {L.np_dtype}")
        end = start + data.shape[0]
        if start < 0 or end > len(blocks) * L.block_tokens:
            raise ValueError(f"tokens {start}..{end} do not fit in {len(blocks)} blocks")
        v = self.kv_view(layer, kv)
        t = start
        while t < end:
            b, off = divmod(t, L.block_tokens)
            n = min(L.block_tokens - off, end - t)
            v[blocks[b], off:off + n] = data[t - start:t - start + n]
            t += n

    def unit(self, layer: int, part: int, block: int) -> np.ndarray:
        """The bytes of one transfer unit (a view, no copy); for wrapped memory too. ``layer`` is
        global (:meth:`KVGroups.group_of`)."""
        if not 0 <= layer < self.groups.n_layers:
            raise IndexError(f"unit ({layer}, {part}, {block}) outside the pool")
        g, i = self.groups.group_of(layer)
        m = self.groups.memories[g]
        if not (0 <= part < m.parts and 0 <= block < m.num_blocks):
            raise IndexError(f"unit ({layer}, {part}, {block}) outside the pool")
        return np.ctypeslib.as_array((ctypes.c_uint8 * m.unit_bytes).from_address(m.addr(i, part, block)))

    def checksum(self, blocks: Sequence, n_tokens: int, layers: Tuple[int, int]) -> str:
        """SHA-256 over the request's K/V bytes (tokens in order, layers ``lo..hi``, K then V). For
        wrapped memory: over its whole blocks, in (layer, part, block) order (what a push sends);
        ``blocks`` then per group (:meth:`KVGroups.per_group`)."""
        h = hashlib.sha256()
        if self.external:
            per = self.groups.per_group(blocks)
            for layer in range(*layers):
                g, _ = self.groups.group_of(layer)
                for part in range(self.groups.memories[g].parts):
                    for j in range(self.groups.layouts[g].blocks_for(n_tokens)):
                        if j < len(per[g]) and per[g][j] is not None:
                            h.update(self.unit(layer, part, per[g][j]).tobytes())
            return h.hexdigest()
        for layer in range(*layers):
            for kv in (0, 1):
                h.update(self.gather(layer, kv, blocks, n_tokens).tobytes())
        return h.hexdigest()

    def _free_memory(self) -> None:
        if self._acl_addr:
            from .. import acl
            acl.aclrtFree(self._acl_addr)
            self._acl_addr = 0
        self._host = None

    def close(self) -> None:
        """Deregisters and frees the memory (the engine must still be initialized to deregister);
        wrapped memory is only deregistered."""
        handles = getattr(self, "_handles", [])
        if not handles:
            return
        for h in handles:
            self.engine.deregister_mem(h)
        self._handles, self._handle = [], None
        self.bytes = np.zeros(0, np.uint8)
        self._free_memory()
