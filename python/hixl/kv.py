"""``hixl.kv``: the KV-cache layer of a prefill/decode (PD) disaggregated pipeline.

What an inference engine imports. It sits on :class:`hixl.Hixl` and so runs over every transport
(rdma, shm, tcp) with the same semantics.

* :class:`KVLayout` - layers, KV heads, head dim, dtype and tokens per block (paged, vLLM-style).
* :class:`KVPool` - registered memory laid out as ``[layer][K|V][block][token][head][dim]`` plus a small
  per-request *aux* area; :meth:`KVPool.offset` is the one place a byte offset is computed.
* :class:`KVReceiver` (decode side) - hands out request *slots* (a block table and a ticket) as
  :class:`Grant` objects, learns that a request's KV is complete from its completion flag, and gives
  back the K/V. Three ways to wait: :meth:`KVReceiver.poll` (non-blocking), :meth:`KVReceiver.wait`
  (blocks on the completion event, optionally with a timeout) and :meth:`KVReceiver.fileno` for
  ``select``/``asyncio``.
* :class:`KVSender` (prefill side) - :meth:`KVSender.push` is non-blocking and is called as soon as a
  chunk of layers is computed, so their transfer overlaps the compute of the next ones. A request may
  go to several decoders (replicated, or layer-sharded: each grant names its layers). The last push to
  a decoder carries the completion flag (RDMA: WRITE_WITH_IMM; shm/tcp: the ordered flag frame).
  In-flight transfers are bounded (``max_inflight``): a push beyond waits, never overflows a queue.

Isolation: blocks are owned by exactly one live slot; a grant addresses only its own blocks; a flag
whose ticket is unknown (stale) or that comes from another engine than the one the grant was made
for is ignored (and logged). A slot freed before its flag arrived keeps its blocks *quarantined*
until that flag arrives or :meth:`KVReceiver.reclaim` is called, so a late writer never lands in
another request's blocks.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from .engine import Hixl
from .types import SUCCESS, MemDesc, MemType, TransferOpDesc, TransferStatus, WRITE

__all__ = [
    "KVError", "PoolExhausted", "KVTimeout", "TransferFailed",
    "KVLayout", "KVPool", "Grant", "KVReceiver", "KVSender",
]

_log = logging.getLogger("hixl.kv")
_PAGE = 4096


# ------------------------------------------------------------------------------------ errors
class KVError(Exception):
    """Base class. ``code`` is the hixl status code of the engine call that failed, if one did."""

    def __init__(self, msg: str, code: Optional[int] = None):
        super().__init__(msg)
        self.code = code


class PoolExhausted(KVError):
    """Not enough free blocks (or request slots) within the timeout."""


class KVTimeout(KVError):
    """A wait or a transfer did not finish within its timeout."""


class TransferFailed(KVError):
    """A transfer of a request failed (peer gone, link torn down, range refused)."""


# ------------------------------------------------------------------------------------ layout
_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "float8": 1}


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's K (or V) in one layer, and the paging.

    A block holds ``block_tokens`` tokens of one (layer, K|V): ``[block_tokens, n_kv_heads, head_dim]``
    elements, contiguous. ``dtype`` is a name (``float32``, ``float16``, ``bfloat16``, ...); numpy
    has no bfloat16, so its views use ``uint16`` bit patterns.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_tokens: int = 16

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "block_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, not {v!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype of views (bfloat16 -> uint16, float8 -> uint8: bit patterns)."""
        return np.dtype({"bfloat16": "uint16", "float8": "uint8"}.get(self.dtype, self.dtype))

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.n_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.token_bytes

    def blocks_for(self, n_tokens: int) -> int:
        return -(-int(n_tokens) // self.block_tokens)

    def kv_bytes(self, n_tokens: int, layers: Optional[Tuple[int, int]] = None) -> int:
        """Bytes of K plus V of ``n_tokens`` tokens over ``layers`` (default: all)."""
        lo, hi = layers or (0, self.n_layers)
        return (hi - lo) * 2 * int(n_tokens) * self.token_bytes

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def for_model(cls, config: Any, dtype: str = "float32", block_tokens: int = 16) -> "KVLayout":
        """From a model config with ``n_layers``, ``n_kv_heads`` and ``head_dim`` attributes."""
        return cls(int(config.n_layers), int(config.n_kv_heads), int(config.head_dim), dtype, block_tokens)


# ------------------------------------------------------------------------------------ allocator
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


# ------------------------------------------------------------------------------------ pool
class KVPool:
    """Registered memory for ``num_blocks`` blocks of every (layer, K|V), plus ``max_requests`` aux
    slots of ``aux_bytes`` (small per-request metadata that travels with the last chunk, e.g. the
    first generated token).

    ``memory="acl"`` (default) allocates from :mod:`hixl.acl` (memfd-backed: the shm transport maps
    it and copies with memcpy) and registers it as ``MEM_DEVICE``; ``"host"`` uses a numpy array.
    """

    def __init__(self, engine: Hixl, layout: KVLayout, num_blocks: int, *, max_requests: Optional[int] = None,
                 aux_bytes: int = 256, memory: str = "acl"):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, not {num_blocks!r}")
        if memory not in ("acl", "host"):
            raise ValueError(f"memory must be 'acl' or 'host', not {memory!r}")
        self.engine, self.layout, self.num_blocks = engine, layout, num_blocks
        self.max_requests = int(max_requests or num_blocks)
        self.aux_bytes = int(aux_bytes)
        kv = layout.n_layers * 2 * num_blocks * layout.block_bytes
        self.aux_offset = -(-kv // _PAGE) * _PAGE
        self.nbytes = self.aux_offset + self.max_requests * self.aux_bytes
        self._acl_addr = 0
        self._host: Optional[np.ndarray] = None
        if memory == "acl":
            from . import acl
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
        self.blocks = _Ids(num_blocks, "blocks")
        self.aux_slots = _Ids(self.max_requests, "aux slots")

    # The one place where (layer, K|V, block, token) becomes a byte offset.
    def offset(self, layer: int, kv: int, block: int, token: int = 0) -> int:
        L = self.layout
        return ((layer * 2 + kv) * self.num_blocks + block) * L.block_bytes + token * L.token_bytes

    def aux_at(self, slot: int) -> int:
        return self.aux_offset + slot * self.aux_bytes

    def kv_view(self, layer: int, kv: int) -> np.ndarray:
        """``[num_blocks, block_tokens, n_kv_heads, head_dim]`` view of one (layer, K|V)."""
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

    def checksum(self, blocks: Sequence[int], n_tokens: int, layers: Tuple[int, int]) -> str:
        """SHA-256 over the request's K/V bytes (tokens in order, layers ``lo..hi``, K then V)."""
        h = hashlib.sha256()
        for layer in range(*layers):
            for kv in (0, 1):
                h.update(self.gather(layer, kv, blocks, n_tokens).tobytes())
        return h.hexdigest()

    def _free_memory(self) -> None:
        if self._acl_addr:
            from . import acl
            acl.aclrtFree(self._acl_addr)
            self._acl_addr = 0
        self._host = None

    def close(self) -> None:
        """Deregisters and frees the memory (the engine must still be initialized to deregister)."""
        if getattr(self, "_handle", None) is None:
            return
        self.engine.deregister_mem(self._handle)
        self._handle = None
        self.bytes = np.zeros(0, np.uint8)
        self._free_memory()


# ------------------------------------------------------------------------------------ grant
@dataclass(frozen=True)
class Grant:
    """A decode-side slot as the prefill side needs to know it (JSON-able with :meth:`to_dict`).

    It travels from the decoder to the prefill instance through whatever the deployment uses to
    route requests (the demo: a pipe). Addresses are the decoder's; nothing here is a secret the
    peer could not already read from the region list the engine handshake gives it."""

    request_id: str
    decode: str                   # the decoder's engine address
    ticket: int                   # u32, the completion flag value
    blocks: Tuple[int, ...]
    n_tokens: int
    layers: Tuple[int, int]       # [lo, hi): the layers this decoder receives
    pool_addr: int
    num_blocks: int
    aux_addr: int
    aux_bytes: int
    layout: Dict[str, Any] = field(default_factory=dict)
    prefill: Optional[str] = None  # the engine allowed to complete it (None: any)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["blocks"], d["layers"] = list(self.blocks), list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Grant":
        d = dict(d)
        d["blocks"], d["layers"] = tuple(d["blocks"]), tuple(d["layers"])
        return cls(**d)


# ------------------------------------------------------------------------------------ decode side
class _Slot:
    __slots__ = ("grant", "aux_slot", "complete", "freed", "t_alloc", "t_done", "peer")

    def __init__(self, grant: Grant, aux_slot: int):
        self.grant, self.aux_slot = grant, aux_slot
        self.complete = self.freed = False
        self.t_alloc, self.t_done, self.peer = time.monotonic(), 0.0, ""


class KVReceiver:
    """Decode side: a registered KV pool carved into request slots, completed by flags."""

    def __init__(self, engine: Hixl, layout: KVLayout, num_blocks: int, *, max_requests: Optional[int] = None,
                 aux_bytes: int = 256, memory: str = "acl"):
        self.engine, self.layout = engine, layout
        self.pool = KVPool(engine, layout, num_blocks, max_requests=max_requests, aux_bytes=aux_bytes, memory=memory)
        self._cv = threading.Condition()
        self._slots: Dict[str, _Slot] = {}
        self._by_ticket: Dict[int, _Slot] = {}
        self._completed: Deque[str] = deque()  # completed, not yet returned by poll()/wait_any()
        self._next_ticket = 1
        self._pumping = False
        self._quarantined = 0  # freed slots whose flag has not arrived yet
        self.ignored_flags = 0

    # -- slots -------------------------------------------------------------------------------
    def allocate(self, request_id: str, n_tokens: int, *, extra_tokens: int = 0,
                 layers: Optional[Tuple[int, int]] = None, prefill: Optional[str] = None,
                 timeout: Optional[float] = 0.0) -> Grant:
        """A slot for ``n_tokens`` pushed tokens plus ``extra_tokens`` of room (decode's own tokens).

        ``timeout``: 0 raises :class:`PoolExhausted` at once when the pool is short; None waits
        without limit; seconds wait that long, then raise. ``prefill``: only flags from this engine
        complete the slot. ``layers``: ``(lo, hi)`` for a layer-sharded decoder (default all)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty str")
        if not isinstance(n_tokens, int) or n_tokens <= 0 or extra_tokens < 0:
            raise ValueError(f"n_tokens must be a positive int and extra_tokens >= 0 (got {n_tokens!r}, {extra_tokens!r})")
        lo, hi = layers or (0, self.layout.n_layers)
        if not 0 <= lo < hi <= self.layout.n_layers:
            raise ValueError(f"layers {layers!r} outside [0, {self.layout.n_layers})")
        with self._cv:
            if request_id in self._slots:
                raise KVError(f"request {request_id!r} already has a slot")
        deadline = None if timeout is None else time.monotonic() + timeout
        aux = self._take(self.pool.aux_slots, 1, deadline)
        try:
            blocks = self._take(self.pool.blocks, self.layout.blocks_for(n_tokens + extra_tokens), deadline)
        except BaseException:
            self.pool.aux_slots.give(aux)
            raise
        with self._cv:
            if request_id in self._slots:  # lost a race with another allocate of the same id
                self.pool.blocks.give(blocks)
                self.pool.aux_slots.give(aux)
                raise KVError(f"request {request_id!r} already has a slot")
            ticket = self._new_ticket_locked()
            g = Grant(request_id=request_id, decode=self.engine.local_engine, ticket=ticket, blocks=tuple(blocks),
                      n_tokens=n_tokens, layers=(lo, hi), pool_addr=self.pool.addr, num_blocks=self.pool.num_blocks,
                      aux_addr=self.pool.addr + self.pool.aux_at(aux[0]), aux_bytes=self.pool.aux_bytes,
                      layout=asdict(self.layout), prefill=prefill)
            slot = _Slot(g, aux[0])
            self._slots[request_id] = slot
            self._by_ticket[ticket] = slot
        self.pool.bytes[self.pool.aux_at(aux[0]):self.pool.aux_at(aux[0]) + self.pool.aux_bytes] = 0
        return g

    def _take(self, ids: _Ids, count: int, deadline: Optional[float]) -> List[int]:
        """ids.take(), but while quarantined slots wait for their late flags it takes in the flags
        too (in 50 ms slices), since one of them may be what frees enough blocks."""
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            quarantined = self._quarantined > 0
            try:
                return ids.take(count, 0.0 if quarantined else left)
            except PoolExhausted:
                if not quarantined or left == 0.0:
                    raise
            with self._cv:
                self._pump_locked(0.05 if left is None else min(0.05, left))

    def _new_ticket_locked(self) -> int:
        while True:
            t = self._next_ticket
            self._next_ticket = self._next_ticket % 0xFFFFFFFF + 1  # 1..2**32-1, never 0
            if t not in self._by_ticket:
                return t

    def free(self, request_id: str) -> None:
        """Give the slot back. A slot whose flag has not arrived stays quarantined (its blocks are
        not reused) until the flag arrives or :meth:`reclaim` is called."""
        with self._cv:
            slot = self._slots.pop(request_id, None)
            if slot is None:
                raise KVError(f"request {request_id!r} has no slot")
            slot.freed = True
            if not slot.complete:
                self._quarantined += 1
                _log.info("kv: slot of %r freed before its KV arrived: quarantined until its flag arrives", request_id)
                return
            del self._by_ticket[slot.grant.ticket]
        self._release(slot)

    def reclaim(self, request_id: str) -> None:
        """Return a quarantined slot's blocks now: only once the prefill that held its grant can no
        longer write (it finished, or its link is gone)."""
        with self._cv:
            slot = next((s for s in self._by_ticket.values() if s.freed and s.grant.request_id == request_id), None)
            if slot is None:
                raise KVError(f"request {request_id!r} has no quarantined slot")
            del self._by_ticket[slot.grant.ticket]
            self._quarantined -= 1
        self._release(slot)

    def _release(self, slot: _Slot) -> None:
        self.pool.blocks.give(slot.grant.blocks)
        self.pool.aux_slots.give([slot.aux_slot])

    @property
    def free_blocks(self) -> int:
        return self.pool.blocks.free

    # -- completion ----------------------------------------------------------------------------
    def _dispatch_locked(self, flags: List[Tuple[str, int]]) -> None:
        for peer, ticket in flags:
            slot = self._by_ticket.get(int(ticket))
            if slot is None or slot.complete:
                self.ignored_flags += 1
                _log.warning("kv: completion flag %d from %s matches no waiting slot (stale or duplicate): ignored",
                             ticket, peer)
                continue
            if slot.grant.prefill and peer != slot.grant.prefill:
                self.ignored_flags += 1
                _log.warning("kv: completion flag for %r came from %s, not from %s: ignored",
                             slot.grant.request_id, peer, slot.grant.prefill)
                continue
            slot.complete, slot.t_done, slot.peer = True, time.monotonic(), peer
            if slot.freed:  # quarantined: the late writer is done, the blocks can go back
                del self._by_ticket[slot.grant.ticket]
                self._quarantined -= 1
                self._release(slot)
            else:
                self._completed.append(slot.grant.request_id)
        if flags:
            self._cv.notify_all()

    def _check(self, rc: int, call: str) -> None:
        if rc != SUCCESS:
            raise KVError(f"kv: {call} failed: {self.engine.last_error()}", rc)

    def _pump_locked(self, timeout: Optional[float]) -> None:
        """Wait (lock released) up to ``timeout`` for flags; one thread waits on the engine, the
        others on the condition it notifies."""
        if self._pumping:
            self._cv.wait(timeout)
            return
        self._pumping = True
        self._cv.release()
        try:
            ms = None if timeout is None else max(0, int(timeout * 1000))
            rc, flags = self.engine.wait_flags(ms)
        finally:
            self._cv.acquire()
            self._pumping = False
            self._cv.notify_all()
        self._check(rc, "wait_flags")
        self._dispatch_locked(flags)

    def poll(self) -> List[str]:
        """Request ids whose KV became complete since the last poll()/wait_any(); never blocks."""
        rc, flags = self.engine.poll_flags()
        with self._cv:
            self._check(rc, "poll_flags")
            self._dispatch_locked(flags)
            out = list(self._completed)
            self._completed.clear()
        return out

    def wait_any(self, timeout: Optional[float] = None) -> List[str]:
        """Like :meth:`poll`, but blocks until at least one request completed or ``timeout`` passed
        (then an empty list)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not self._completed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return []
                self._pump_locked(left)
            out = list(self._completed)
            self._completed.clear()
        return out

    def wait(self, request_id: str, timeout: Optional[float] = None, *, warm: bool = False) -> float:
        """Blocks until ``request_id``'s KV is complete (GIL released while waiting); raises
        :class:`KVTimeout` after ``timeout`` seconds (None: no limit). Returns the time the flag
        arrived (``time.monotonic()``). ``warm=True`` then touches every byte of the slot once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                slot = self._slots.get(request_id)
                if slot is None:
                    raise KVError(f"request {request_id!r} has no slot")
                if slot.complete:
                    try:
                        self._completed.remove(request_id)
                    except ValueError:
                        pass
                    t = slot.t_done
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise KVTimeout(f"kv: KV of request {request_id!r} not complete within {timeout:g} s")
                self._pump_locked(left)
        if warm:
            self.warm(request_id)
        return t

    def fileno(self) -> int:
        """An fd readable while completion flags are pending (select/poll/asyncio), then :meth:`poll`."""
        return self.engine.flag_fd()

    def is_complete(self, request_id: str) -> bool:
        with self._cv:
            slot = self._slots.get(request_id)
            return bool(slot and slot.complete)

    # -- data ------------------------------------------------------------------------------------
    def _grant(self, request_id: str) -> Grant:
        with self._cv:
            slot = self._slots.get(request_id)
        if slot is None:
            raise KVError(f"request {request_id!r} has no slot")
        return slot.grant

    def grant(self, request_id: str) -> Grant:
        return self._grant(request_id)

    def kv(self, request_id: str, layer: int) -> Tuple[np.ndarray, np.ndarray]:
        """``(K, V)`` of one layer as ``[n_tokens, n_kv_heads, head_dim]`` arrays (copies)."""
        g = self._grant(request_id)
        if not g.layers[0] <= layer < g.layers[1]:
            raise ValueError(f"layer {layer} is not in this slot's layers {g.layers}")
        return (self.pool.gather(layer, 0, g.blocks, g.n_tokens), self.pool.gather(layer, 1, g.blocks, g.n_tokens))

    def aux(self, request_id: str) -> bytes:
        """The slot's aux bytes (what the prefill passed as ``aux`` with its last push; zeros before)."""
        g = self._grant(request_id)
        o = g.aux_addr - self.pool.addr
        return bytes(self.pool.bytes[o:o + g.aux_bytes])

    def warm(self, request_id: str) -> str:
        """Read every byte of the slot once (faults pages in, warms caches); returns their SHA-256
        (the same value as :meth:`KVSender.checksum` on the prefill side)."""
        g = self._grant(request_id)
        return self.pool.checksum(g.blocks, g.n_tokens, g.layers)

    def close(self) -> None:
        self.pool.close()


# ------------------------------------------------------------------------------------ prefill side
class _Target:
    __slots__ = ("grant", "pushed", "flagged", "aux_slot")

    def __init__(self, grant: Grant, aux_slot: int):
        self.grant, self.pushed, self.flagged = grant, set(), False
        self.aux_slot = aux_slot  # our staging slot for this target's aux bytes (one per target: an
        # earlier target's aux transfer may still be reading its slot when a later one is staged)


class _Request:
    __slots__ = ("blocks", "n_tokens", "aux", "targets", "inflight", "errors", "bytes",
                 "intervals", "t_first_submit")

    def __init__(self, blocks: List[int], n_tokens: int):
        self.blocks, self.n_tokens = blocks, n_tokens
        self.aux: Optional[bytes] = None
        self.targets: List[_Target] = []
        self.inflight = 0
        self.errors: List[str] = []
        self.bytes = 0
        self.intervals: List[Tuple[float, float]] = []  # (submitted, completed), monotonic seconds
        self.t_first_submit = 0.0


def union_seconds(intervals: Iterable[Sequence[float]], after: float = float("-inf")) -> float:
    """Length of the union of ``[a, b]`` intervals (e.g. :meth:`KVSender.stats` ``intervals``),
    counting only the part after ``after``."""
    total, end = 0.0, after
    for a, b in sorted((max(a, after), b) for a, b in intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


class KVSender:
    """Prefill side: local KV blocks per request, pushed layer chunk by layer chunk to decoders.

    A reaper thread waits on the submitted transfers (GIL released, in 1 s slices), records when each
    completed and releases in-flight credit; :meth:`push` waits for credit when ``max_inflight``
    transfers are outstanding (backpressure)."""

    def __init__(self, engine: Hixl, layout: KVLayout, num_blocks: int, *, max_requests: Optional[int] = None,
                 max_targets: int = 8, aux_bytes: int = 256, memory: str = "acl", max_inflight: int = 64,
                 timeout: float = 60.0):
        """``max_requests`` requests at once (default ``num_blocks``), each sent to at most
        ``max_targets`` decoders on average (each target stages its aux bytes in a slot of its own)."""
        self.engine, self.layout = engine, layout
        self.pool = KVPool(engine, layout, num_blocks, max_requests=(max_requests or num_blocks) * max_targets,
                           aux_bytes=aux_bytes, memory=memory)
        self.max_inflight, self.timeout = int(max_inflight), float(timeout)
        self._cv = threading.Condition()
        self._reqs: Dict[str, _Request] = {}
        self._queue: Deque[Tuple[int, str, float]] = deque()  # (engine req, request id, submitted)
        self._inflight = 0
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="hixl-kv-reaper", daemon=True)
        self._reaper.start()

    # -- local blocks --------------------------------------------------------------------------
    def allocate(self, request_id: str, n_tokens: int, timeout: Optional[float] = 0.0) -> List[int]:
        """Local blocks for ``n_tokens`` tokens of ``request_id`` (raises :class:`PoolExhausted`)."""
        if not isinstance(n_tokens, int) or n_tokens <= 0:
            raise ValueError(f"n_tokens must be a positive int, not {n_tokens!r}")
        with self._cv:
            if request_id in self._reqs:
                raise KVError(f"request {request_id!r} is already allocated")
        blocks = self.pool.blocks.take(self.layout.blocks_for(n_tokens), timeout)
        with self._cv:
            self._reqs[request_id] = _Request(blocks, n_tokens)
        return blocks

    def _req(self, request_id: str) -> _Request:
        r = self._reqs.get(request_id)
        if r is None:
            raise KVError(f"request {request_id!r} is not allocated on this sender")
        return r

    def store(self, request_id: str, layer: int, k: np.ndarray, v: np.ndarray, start: int = 0) -> None:
        """Write one layer's K and V (``[T, heads, dim]``) into the request's blocks from token ``start``."""
        r = self._req(request_id)
        if not 0 <= layer < self.layout.n_layers:
            raise ValueError(f"layer {layer} outside [0, {self.layout.n_layers})")
        self.pool.scatter(layer, 0, r.blocks, k, start)
        self.pool.scatter(layer, 1, r.blocks, v, start)

    def checksum(self, request_id: str, layers: Optional[Tuple[int, int]] = None) -> str:
        r = self._req(request_id)
        return self.pool.checksum(r.blocks, r.n_tokens, layers or (0, self.layout.n_layers))

    # -- targets and pushes ----------------------------------------------------------------------
    def add_target(self, request_id: str, grant: Union[Grant, Dict[str, Any]]) -> None:
        """Send this request's KV (the grant's layers) to the grant's decoder (connecting to it
        first when this engine has no link to it yet)."""
        g = grant if isinstance(grant, Grant) else Grant.from_dict(grant)
        r = self._req(request_id)
        if g.request_id != request_id:
            raise KVError(f"grant is for request {g.request_id!r}, not {request_id!r}")
        if g.layout != asdict(self.layout):
            raise KVError(f"grant for {request_id!r} has layout {g.layout}, this sender has {asdict(self.layout)}")
        if g.n_tokens != r.n_tokens:
            raise KVError(f"grant for {request_id!r} is for {g.n_tokens} tokens, the request has {r.n_tokens}")
        if len(g.blocks) < self.layout.blocks_for(g.n_tokens) or not 0 <= g.layers[0] < g.layers[1] <= self.layout.n_layers:
            raise KVError(f"grant for {request_id!r} is malformed: {len(g.blocks)} blocks, layers {g.layers}")
        if any(not 0 <= b < g.num_blocks for b in g.blocks):
            raise KVError(f"grant for {request_id!r} names blocks outside the decoder's pool of {g.num_blocks}")
        if self.engine.get_transport(g.decode)[0] != SUCCESS:  # not linked yet: connect now
            rc = self.engine.connect(g.decode, int(self.timeout * 1000))
            if rc != SUCCESS:
                raise TransferFailed(f"kv: connect to decoder {g.decode} failed: {self.engine.last_error()}", rc)
        with self._cv:
            if any(t.grant.decode == g.decode and max(t.grant.layers[0], g.layers[0]) < min(t.grant.layers[1], g.layers[1])
                   for t in r.targets):
                raise KVError(f"request {request_id!r} already sends layers overlapping {g.layers} to {g.decode}")
            r.targets.append(_Target(g, self.pool.aux_slots.take(1, 0.0)[0]))

    def _descs(self, r: _Request, g: Grant, layers: List[int]) -> List[TransferOpDesc]:
        """One descriptor per (layer, K|V, block), adjacent ones merged."""
        L, out = self.layout, []
        remote_block = lambda layer, kv, b: g.pool_addr + ((layer * 2 + kv) * g.num_blocks + b) * L.block_bytes  # noqa: E731
        last = None  # [local, remote, len]
        for layer in layers:
            for kv in (0, 1):
                for j in range(L.blocks_for(r.n_tokens)):
                    n = min(L.block_tokens, r.n_tokens - j * L.block_tokens) * L.token_bytes
                    loc = self.pool.addr + self.pool.offset(layer, kv, r.blocks[j])
                    rem = remote_block(layer, kv, g.blocks[j])
                    if last is not None and last[0] + last[2] == loc and last[1] + last[2] == rem:
                        last[2] += n
                    else:
                        last = [loc, rem, n]
                        out.append(last)
        return [TransferOpDesc(a, b, n) for a, b, n in out]

    def _set_aux(self, r: _Request, aux: Optional[bytes]) -> None:
        if aux is not None:
            aux = bytes(aux)
            if len(aux) > self.pool.aux_bytes:
                raise ValueError(f"aux is {len(aux)} bytes, at most {self.pool.aux_bytes}")
            r.aux = aux

    def push(self, request_id: str, layers: Union[int, Iterable[int]], *, aux: Optional[bytes] = None,
             complete: Optional[bool] = None) -> int:
        """Start moving ``layers`` (already stored) to every target; returns the bytes submitted.

        Non-blocking unless ``max_inflight`` transfers are outstanding (then it waits for credit).
        With ``complete=None`` the push that completes a target's layers also writes the aux bytes
        (``aux``, or those given to an earlier push) and carries the completion flag; with
        ``complete=False`` no flag goes yet: :meth:`complete` sends it later (so the last layers can
        travel while the first token is still being computed)."""
        r = self._req(request_id)
        want = sorted({layers} if isinstance(layers, int) else set(layers))
        if any(not 0 <= x < self.layout.n_layers for x in want):
            raise ValueError(f"layers {want} outside [0, {self.layout.n_layers})")
        self._set_aux(r, aux)
        if not r.targets:
            raise KVError(f"request {request_id!r} has no target: add_target() first")
        total = 0
        for t in r.targets:
            lo, hi = t.grant.layers
            mine = [x for x in want if lo <= x < hi and x not in t.pushed]
            if not mine:
                continue
            descs = self._descs(r, t.grant, mine)
            t.pushed.update(mine)
            flag = None
            if complete is not False and len(t.pushed) == hi - lo:
                flag = self._stage_flag(r, t, descs)
            total += self._submit(request_id, r, t, descs, flag, f"layers {mine}")
        return total

    def complete(self, request_id: str, *, aux: Optional[bytes] = None) -> int:
        """Send the completion flag (with the aux bytes) to every target that has all its layers
        and no flag yet; returns the bytes submitted. Without any aux, one zero byte is written to
        the target's aux area (a transfer carries the flag)."""
        r = self._req(request_id)
        self._set_aux(r, aux)
        missing = {t.grant.decode: sorted(set(range(*t.grant.layers)) - t.pushed) for t in r.targets}
        missing = {k: v for k, v in missing.items() if v}
        if missing:
            raise KVError(f"kv: complete({request_id!r}): layers not pushed yet: {missing}")
        total = 0
        for t in r.targets:
            if not t.flagged:
                descs: List[TransferOpDesc] = []
                flag = self._stage_flag(r, t, descs)
                total += self._submit(request_id, r, t, descs, flag, "completion flag")
        return total

    def _stage_flag(self, r: _Request, t: _Target, descs: List[TransferOpDesc]) -> int:
        """Appends the aux write (staged in the target's own slot) to ``descs``; returns the flag."""
        aux = r.aux if r.aux is not None else (b"\0" if not descs else None)
        if aux is not None:
            a = self.pool.aux_at(t.aux_slot)
            self.pool.bytes[a:a + len(aux)] = np.frombuffer(aux, np.uint8)
            descs.append(TransferOpDesc(self.pool.addr + a, t.grant.aux_addr, len(aux)))
        t.flagged = True
        return t.grant.ticket

    def _submit(self, request_id: str, r: _Request, t: _Target, descs: List[TransferOpDesc],
                flag: Optional[int], what: str) -> int:
        nbytes = sum(d.len for d in descs)
        self._acquire_credit()
        now = time.monotonic()
        rc, req = self.engine.transfer_async(t.grant.decode, WRITE, descs, flag=flag)
        if rc != SUCCESS:
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()
            raise TransferFailed(f"kv: push of {request_id!r} {what} to {t.grant.decode} failed: "
                                 f"{self.engine.last_error()}", rc)
        with self._cv:
            if not r.t_first_submit:
                r.t_first_submit = now
            r.inflight += 1
            r.bytes += nbytes
            self._queue.append((req, request_id, now))
            self._cv.notify_all()
        return nbytes

    def _acquire_credit(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._inflight < self.max_inflight or self._closed)
            if self._closed:
                raise KVError("kv: sender closed")
            self._inflight += 1

    def _reap(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                req, rid, t_sub = self._queue[0]
            err = None
            while True:
                rc, st = self.engine.transfer_wait(req, 1000)
                if rc == SUCCESS and st == TransferStatus.WAITING:
                    if time.monotonic() - t_sub > self.timeout:
                        err = f"transfer not complete within {self.timeout:g} s"
                        break
                    if self._closed:
                        err = "sender closed"
                        break
                    continue
                if rc != SUCCESS or st != TransferStatus.COMPLETED:
                    err = f"transfer ended {TransferStatus(st).name}: {self.engine.last_error()}"
                break
            t_done = time.monotonic()
            with self._cv:
                self._queue.popleft()
                self._inflight -= 1
                r = self._reqs.get(rid)
                if r is not None:
                    r.inflight -= 1
                    r.intervals.append((t_sub, t_done))
                    if err:
                        r.errors.append(err)
                self._cv.notify_all()

    def flush(self, request_id: Optional[str] = None, timeout: Optional[float] = None) -> None:
        """Waits until the request's (or every) transfer ended; raises :class:`TransferFailed` if one
        failed, :class:`KVTimeout` after ``timeout`` seconds."""
        with self._cv:
            reqs = [self._req(request_id)] if request_id is not None else list(self._reqs.values())
            if not self._cv.wait_for(lambda: all(r.inflight == 0 for r in reqs), timeout):
                raise KVTimeout(f"kv: transfers of {request_id or 'all requests'} not done within {timeout:g} s")
            errors = [e for r in reqs for e in r.errors]
        if errors:
            raise TransferFailed(f"kv: {len(errors)} transfer(s) of {request_id or 'the requests'} failed: {errors[0]}")

    def stats(self, request_id: str) -> Dict[str, Any]:
        """bytes, transfers, busy seconds (union of submit..completion intervals), first submit and
        last completion (monotonic seconds), whether every target got its flag."""
        with self._cv:
            r = self._req(request_id)
            iv = list(r.intervals)
            return {"bytes": r.bytes, "transfers": len(iv), "inflight": r.inflight,
                    "busy_s": union_seconds(iv), "first_submit": r.t_first_submit,
                    "last_done": max((b for _, b in iv), default=0.0), "intervals": iv,
                    "flagged": all(t.flagged for t in r.targets) and bool(r.targets), "errors": list(r.errors)}

    def release(self, request_id: str, timeout: Optional[float] = None) -> None:
        """Flush the request, then give its local blocks back (raises like :meth:`flush`; the blocks
        are given back either way once nothing is in flight)."""
        try:
            self.flush(request_id, timeout)
        finally:
            with self._cv:
                r = self._reqs.get(request_id)
                if r is not None and r.inflight == 0:
                    del self._reqs[request_id]
                    self.pool.blocks.give(r.blocks)
                    self.pool.aux_slots.give([t.aux_slot for t in r.targets])

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._reaper.join(5)
        self.pool.close()
