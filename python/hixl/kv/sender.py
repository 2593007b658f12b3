"""``KVSender``: the prefill side - local KV blocks pushed layer chunk by layer chunk to decoders."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import asdict
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..engine import Hixl
from ..types import SUCCESS, TransferStatus, WRITE
from .errors import KVError, KVTimeout, TransferFailed
from .grant import Grant
from .heads import HeadSlice, check_sliced, head_runs, layouts_match, sliced_desc_array
from .layout import BlockMemory, KVLayout, block_desc_array
from .pool import KVPool

_log = logging.getLogger("hixl.kv")


class _Target:
    __slots__ = ("grant", "memory", "remote", "js", "pushed", "flagged", "aux_slot", "failed", "fail_sent", "heads",
                 "want")

    def __init__(self, grant: Grant, memory: BlockMemory, js: range, aux_slot: Optional[int]):
        self.grant, self.memory, self.js = grant, memory, js
        self.heads, self.want = grant.head_slice()  # the decoder's heads, those it wants from us (or None)
        self.remote = grant.request_blocks()  # the decoder's block of each request block j
        self.pushed: set = set()  # (layer, j) pairs sent
        self.flagged = False
        self.failed: Optional[str] = None  # why a push to this target failed (the decoder is told: fail_flag)
        self.fail_sent = False
        self.aux_slot = aux_slot  # our staging slot for this target's aux bytes (one per target: an
        # earlier target's aux transfer may still be reading its slot when a later one is staged);
        # None: the grant has no aux area (or our pool is wrapped memory without one)

    @property
    def need(self) -> int:
        lo, hi = self.grant.layers
        return (hi - lo) * len(self.js)


class _Request:
    __slots__ = ("blocks", "n_tokens", "aux", "targets", "inflight", "errors", "bytes", "descs",
                 "intervals", "t_first_submit", "external")

    def __init__(self, blocks: List[int], n_tokens: int, external: bool = False):
        self.blocks, self.n_tokens = blocks, n_tokens
        self.external = external  # blocks of the caller's (add_request), not of our pool
        self.aux: Optional[bytes] = None
        self.targets: List[_Target] = []
        self.inflight = 0
        self.errors: List[str] = []
        self.bytes = 0
        self.descs = 0
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

    ``KVSender(engine, layout, num_blocks)`` allocates and registers a pool of its own
    (:meth:`allocate`, :meth:`store`); ``KVSender(engine, layout, pool=KVPool.wrap(...))`` pushes
    blocks of memory the caller owns (:meth:`add_request` names them, e.g. vLLM's block ids).

    A reaper thread waits on the submitted transfers (GIL released, in 1 s slices), records when each
    completed and releases in-flight credit; :meth:`push` waits for credit when ``max_inflight``
    transfers are outstanding (backpressure)."""

    def __init__(self, engine: Hixl, layout: KVLayout, num_blocks: Optional[int] = None, *,
                 max_requests: Optional[int] = None, max_targets: int = 8, aux_bytes: int = 256,
                 memory: str = "acl", max_inflight: int = 64, timeout: float = 60.0,
                 pool: Optional[KVPool] = None, heads: Optional[HeadSlice] = None,
                 on_settled: Optional[Callable[[str], None]] = None):
        """``max_requests`` requests at once (default ``num_blocks``), each sent to at most
        ``max_targets`` decoders on average (each target stages its aux bytes in a slot of its own).
        ``heads``: the KV heads our blocks hold (tensor parallelism), which head-sliced grants need.
        ``on_settled(request_id)``: called (on the reaper thread) when a request has no write in flight
        any more, so a caller can wait for that instead of polling :meth:`stats`."""
        self.engine, self.layout, self.heads = engine, layout, heads
        self._own_pool = pool is None  # a pool passed in is the caller's: close() leaves it open
        if pool is None:
            if num_blocks is None:
                raise ValueError("KVSender needs num_blocks (a pool of its own) or pool=")
            pool = KVPool(engine, layout, num_blocks, max_requests=(max_requests or num_blocks) * max_targets,
                          aux_bytes=aux_bytes, memory=memory)
        elif pool.layout != layout:
            raise ValueError(f"KVSender: the pool's layout {pool.layout} is not {layout}")
        self.pool = pool
        self.max_inflight, self.timeout = int(max_inflight), float(timeout)
        self._on_settled = on_settled
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
        if self.pool.external:
            raise KVError("kv: allocate() hands out blocks of a pool of our own; this pool is wrapped "
                          "memory whose owner allocates them: use add_request()")
        if not isinstance(n_tokens, int) or n_tokens <= 0:
            raise ValueError(f"n_tokens must be a positive int, not {n_tokens!r}")
        with self._cv:
            if request_id in self._reqs:
                raise KVError(f"request {request_id!r} is already allocated")
        blocks = self.pool.blocks.take(self.layout.blocks_for(n_tokens), timeout)
        with self._cv:
            self._reqs[request_id] = _Request(blocks, n_tokens)
        return blocks

    def add_request(self, request_id: str, blocks: Sequence[int], n_tokens: int, *, partial: bool = False) -> None:
        """A request whose KV the caller already holds in ``blocks`` of the pool (request block j
        is ``blocks[j]``); the sender never gives them back, :meth:`release` only forgets them.
        ``partial``: fewer blocks than ``n_tokens`` need so far (a chunked prefill allocates them
        as it goes: :meth:`set_blocks` names more; a push of a block not named yet is refused)."""
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens <= 0:
            raise ValueError(f"n_tokens must be a positive int, not {n_tokens!r}")
        blocks = self._check_blocks(blocks, n_tokens, partial)
        with self._cv:
            if request_id in self._reqs:
                raise KVError(f"request {request_id!r} is already on this sender")
            self._reqs[request_id] = _Request(blocks, n_tokens, external=True)

    def set_blocks(self, request_id: str, blocks: Sequence[int], *, partial: bool = False) -> None:
        """The request's blocks as known now (an :meth:`add_request` request; those named before
        must not change)."""
        r = self._req(request_id)
        blocks = self._check_blocks(blocks, r.n_tokens, partial)
        with self._cv:
            if not r.external or blocks[:len(r.blocks)] != r.blocks[:len(blocks)]:
                raise KVError(f"request {request_id!r}: its blocks cannot change ({r.blocks} -> {blocks})")
            r.blocks = blocks

    def _check_blocks(self, blocks: Sequence[int], n_tokens: int, partial: bool) -> List[int]:
        blocks = [int(b) for b in blocks]
        need = self.layout.blocks_for(n_tokens)
        if len(blocks) > need or (len(blocks) < need and not partial):
            raise ValueError(f"{n_tokens} tokens need {need} blocks, {len(blocks)} given")
        if any(not 0 <= b < self.pool.num_blocks for b in blocks):
            raise ValueError(f"blocks {blocks} outside the pool of {self.pool.num_blocks}")
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
        """Send this request's KV (the grant's layers and blocks) to the grant's decoder (connecting
        to it first when this engine has no link to it yet)."""
        g = grant if isinstance(grant, Grant) else Grant.from_dict(grant)
        r = self._req(request_id)
        if g.request_id != request_id:
            raise KVError(f"grant is for request {g.request_id!r}, not {request_id!r}")
        try:
            theirs, want = g.head_slice()
        except ValueError as e:
            raise KVError(str(e)) from None
        if not layouts_match(g.layout, asdict(self.layout), theirs is not None):
            raise KVError(f"grant for {request_id!r} has layout {g.layout}, this sender has {asdict(self.layout)}")
        if g.n_tokens != r.n_tokens:
            raise KVError(f"grant for {request_id!r} is for {g.n_tokens} tokens, the request has {r.n_tokens}")
        nb = self.layout.blocks_for(g.n_tokens)
        if (not isinstance(g.first_block, int) or not 0 <= g.first_block < nb or len(g.blocks) < nb - g.first_block
                or not 0 <= g.layers[0] < g.layers[1] <= self.layout.n_layers):
            raise KVError(f"grant for {request_id!r} is malformed: {len(g.blocks)} blocks from block "
                          f"{g.first_block!r}, layers {g.layers}")
        mem = self._target_memory(request_id, g, theirs, want)
        if any(not 0 <= b < mem.num_blocks for b in g.blocks):
            raise KVError(f"grant for {request_id!r} names blocks outside the decoder's pool of {mem.num_blocks}")
        if self.engine.get_transport(g.decode)[0] != SUCCESS:  # not linked yet: connect now
            rc = self.engine.connect(g.decode, int(self.timeout * 1000))
            if rc != SUCCESS:
                raise TransferFailed(f"kv: connect to decoder {g.decode} failed: {self.engine.last_error()}", rc)
        with self._cv:
            if any(t.grant.decode == g.decode and max(t.grant.layers[0], g.layers[0]) < min(t.grant.layers[1], g.layers[1])
                   for t in r.targets):
                raise KVError(f"request {request_id!r} already sends layers overlapping {g.layers} to {g.decode}")
            aux_slot = None
            if g.aux_bytes > 0 and not self.pool.external:
                aux_slot = self.pool.aux_slots.take(1, 0.0)[0]
            r.targets.append(_Target(g, mem, range(g.first_block, nb), aux_slot))

    def _target_memory(self, request_id: str, g: Grant, theirs: Optional[HeadSlice],
                       want: Optional[Tuple[int, int]]) -> BlockMemory:
        """The grant's decoder memory, checked against our blocks (whole, or head-sliced)."""
        try:
            mem = g.block_memory(self.layout)
            if theirs is None:
                mem.check(self.layout)
            else:
                if self.heads is None:
                    raise ValueError("the grant is head-sliced, this sender has no HeadSlice of its own")
                check_sliced(mem, theirs, self.layout.n_layers, "the decoder's memory")
                if not len(head_runs(self.heads, theirs, want)):
                    raise ValueError(f"it wants heads {want} of {theirs}, we hold {self.heads}: none in common")
        except (TypeError, ValueError) as e:
            raise KVError(f"grant for {request_id!r} has a bad memory description: {e}") from e
        if mem.parts != self.pool.memory.parts or (theirs is None and mem.unit_bytes != self.pool.memory.unit_bytes):
            raise KVError(f"grant for {request_id!r}: the decoder packs its blocks differently ({mem.parts} parts "
                          f"of {mem.unit_bytes} B, ours {self.pool.memory.parts} of {self.pool.memory.unit_bytes} B)")
        return mem

    def targets(self, request_id: str) -> List[str]:
        """The decoders this request goes to."""
        with self._cv:
            return [t.grant.decode for t in self._req(request_id).targets]

    def _descs(self, r: _Request, t: _Target, layers: List[int], js: Iterable[int]) -> np.ndarray:
        """One descriptor per (layer, K|V, block), adjacent ones merged: a descriptor array (no
        Python object per descriptor); head-sliced targets get only the heads they want."""
        if t.heads is not None:
            return sliced_desc_array(self.pool.memory, self.heads, r.blocks, t.memory, t.heads, t.remote, layers, js,
                                     want=t.want)
        return block_desc_array(self.layout, self.pool.memory, r.blocks, t.memory, t.remote, layers, r.n_tokens, js)

    def _set_aux(self, r: _Request, aux: Optional[bytes]) -> None:
        if aux is not None:
            aux = bytes(aux)
            if len(aux) > self.pool.aux_bytes:
                raise ValueError(f"aux is {len(aux)} bytes, at most {self.pool.aux_bytes}")
            r.aux = aux

    def push(self, request_id: str, layers: Union[int, Iterable[int]], *, blocks: Optional[Iterable[int]] = None,
             aux: Optional[bytes] = None, complete: Optional[bool] = None) -> int:
        """Start moving ``layers`` (already stored) to every target; returns the bytes submitted.

        ``blocks``: the request blocks (indices ``j`` into its block list) to move, default all: a
        chunked prefill pushes each block once it is full. Each (layer, block) goes to a target
        once; a target gets those of its grant only.

        Non-blocking unless ``max_inflight`` transfers are outstanding (then it waits for credit).
        With ``complete=None`` the push that completes a target's layers and blocks also writes the
        aux bytes (``aux``, or those given to an earlier push) and carries the completion flag; with
        ``complete=False`` no flag goes yet: :meth:`complete` sends it later (so the last layers can
        travel while the first token is still being computed); ``complete=True`` flags this push
        (the caller knows it is the last one)."""
        r = self._req(request_id)
        want = sorted({layers} if isinstance(layers, int) else set(layers))
        if any(not 0 <= x < self.layout.n_layers for x in want):
            raise ValueError(f"layers {want} outside [0, {self.layout.n_layers})")
        nb = len(r.blocks)
        js_all = range(nb) if blocks is None else sorted(set(blocks))
        if any(not 0 <= j < nb for j in js_all):
            raise ValueError(f"blocks {list(js_all)} outside the request's {nb} known blocks")
        self._set_aux(r, aux)
        if not r.targets:
            raise KVError(f"request {request_id!r} has no target: add_target() first")
        total = 0
        for t in r.targets:
            if t.flagged:
                continue
            lo, hi = t.grant.layers
            mine = [x for x in want if lo <= x < hi]
            js = [j for j in js_all if j in t.js]
            new = [(x, j) for x in mine for j in js if (x, j) not in t.pushed]
            flag = None
            if not new:
                if complete:
                    total += self._complete_target(request_id, r, t)
                continue
            t.pushed.update(new)
            new_layers = sorted({x for x, _ in new})
            new_js = sorted({j for _, j in new})
            if len(new) == len(new_layers) * len(new_js):
                descs = self._descs(r, t, new_layers, new_js)
            else:  # a ragged set: per layer
                descs = np.concatenate([self._descs(r, t, [x], [j for y, j in new if y == x]) for x in new_layers])
            if complete or (complete is None and len(t.pushed) == t.need):
                descs, flag = self._stage_flag(r, t, descs)
            total += self._submit(request_id, r, t, descs, flag, f"layers {new_layers} blocks {new_js}")
        return total

    def complete(self, request_id: str, *, aux: Optional[bytes] = None) -> int:
        """Send the completion flag (with the aux bytes) to every target that has all its layers
        and no flag yet; returns the bytes submitted. Without any aux, one zero byte is written to
        the target's aux area (a transfer carries the flag); a target without an aux area gets its
        last block again (the same bytes) with the flag."""
        r = self._req(request_id)
        self._set_aux(r, aux)
        missing = {t.grant.decode: t.need - len(t.pushed) for t in r.targets if len(t.pushed) < t.need}
        if missing:
            raise KVError(f"kv: complete({request_id!r}): (layer, block) pairs not pushed yet: {missing}")
        return sum(self._complete_target(request_id, r, t) for t in r.targets if not t.flagged)

    def _complete_target(self, request_id: str, r: _Request, t: _Target) -> int:
        descs = np.zeros((0, 3), np.uint64)
        if t.aux_slot is None:  # no aux area: the flag rides on the last block, sent again
            lo, hi = t.grant.layers
            descs = self._descs(r, t, [hi - 1], [t.js[-1]])
        descs, flag = self._stage_flag(r, t, descs)
        return self._submit(request_id, r, t, descs, flag, "completion flag")

    def _stage_flag(self, r: _Request, t: _Target, descs: np.ndarray) -> Tuple[np.ndarray, int]:
        """``descs`` with the aux write (staged in the target's own slot) appended, and the flag."""
        if t.aux_slot is not None:
            aux = r.aux if r.aux is not None else (b"\0" if not len(descs) else None)
            if aux is not None:
                if len(aux) > t.grant.aux_bytes:
                    raise ValueError(f"aux is {len(aux)} bytes, the decoder's area {t.grant.aux_bytes}")
                a = self.pool.aux_at(t.aux_slot)
                self.pool.bytes[a:a + len(aux)] = np.frombuffer(aux, np.uint8)
                row = np.array([[self.pool.addr + a, t.grant.aux_addr, len(aux)]], np.uint64)
                descs = np.concatenate([descs, row])
        t.flagged = True
        return descs, t.grant.ticket

    def _submit(self, request_id: str, r: _Request, t: _Target, descs: np.ndarray,
                flag: Optional[int], what: str) -> int:
        nbytes = int(descs[:, 2].sum())
        self._acquire_credit()
        now = time.monotonic()
        rc, req = self.engine.transfer_async(t.grant.decode, WRITE, descs, flag=flag)
        if rc != SUCCESS:
            why = f"push of {what} to {t.grant.decode} failed: {self.engine.last_error()}"
            with self._cv:
                self._inflight -= 1
                r.errors.append(why)
                t.failed = t.failed or why
                tell = self._failures_to_send_locked(r)
                self._cv.notify_all()
            self._send_failures(request_id, tell)
            raise TransferFailed(f"kv: push of {request_id!r} {what} to {t.grant.decode} failed: "
                                 f"{self.engine.last_error()}", rc)
        with self._cv:
            if not r.t_first_submit:
                r.t_first_submit = now
            r.inflight += 1
            r.bytes += nbytes
            r.descs += len(descs)
            self._queue.append((req, request_id, now, t))
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
                req, rid, t_sub, target = self._queue[0]
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
            tell: List[_Target] = []
            settled = False
            with self._cv:
                self._queue.popleft()
                self._inflight -= 1
                r = self._reqs.get(rid)
                if r is not None:
                    r.inflight -= 1
                    settled = r.inflight == 0
                    r.intervals.append((t_sub, t_done))
                    if err:
                        r.errors.append(err)
                        target.failed = target.failed or f"push to {target.grant.decode} {err}"
                    tell = self._failures_to_send_locked(r)
                self._cv.notify_all()
            self._send_failures(rid, tell)
            if settled and self._on_settled is not None:
                try:
                    self._on_settled(rid)
                except Exception:  # the caller's bug must not end the reaper: every later write waits on it
                    _log.exception("kv: on_settled(%r)", rid)

    def _failures_to_send_locked(self, r: _Request) -> List[_Target]:
        """The targets whose push failed, once none of the request's transfers is in flight any
        more (so none of its writes can land after the decoder is told); each is told once."""
        if r.inflight:
            return []
        out = [t for t in r.targets if t.failed and not t.fail_sent]
        for t in out:
            t.fail_sent = True
        return out

    def _send_failures(self, request_id: str, targets: List[_Target]) -> None:
        """Tell each decoder at once that its flag will not come (its wait ends with our reason
        instead of its own timeout). Without a link the decoder learns from the link's end."""
        for t in targets:
            rc = self.engine.fail_flag(t.grant.decode, t.grant.ticket,
                                       f"the prefill {self.engine.local_engine} failed request {request_id!r}: "
                                       f"{t.failed}")
            if rc != SUCCESS:
                _log.info("kv: could not tell %s that request %r failed (%s); it learns from the link's end",
                          t.grant.decode, request_id, self.engine.last_error())

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
            return {"bytes": r.bytes, "descriptors": r.descs, "transfers": len(iv), "inflight": r.inflight,
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
                    if not r.external:
                        self.pool.blocks.give(r.blocks)
                    slots = [t.aux_slot for t in r.targets if t.aux_slot is not None]
                    if slots:
                        self.pool.aux_slots.give(slots)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._reaper.join(5)
        if self._own_pool:
            self.pool.close()
