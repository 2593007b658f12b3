"""``KVReceiver``: the decode side - request slots completed by flags."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import asdict
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..engine import Hixl
from ..types import ALREADY_CONNECTED, READ, SUCCESS, TransferStatus
from .errors import KVError, KVTimeout, PoolExhausted, TransferFailed
from .grant import Grant, GroupGrant
from .heads import HeadSlice, check_sliced, layouts_match, sliced_desc_array
from .layout import KVLayout, block_desc_array
from .pool import KVPool, _Ids

_log = logging.getLogger("hixl.kv")


class _Slot:
    __slots__ = ("grant", "aux_slot", "complete", "freed", "t_alloc", "t_done", "peer", "pull", "pull_bytes")

    def __init__(self, grant: Grant, aux_slot: Optional[int]):
        self.grant, self.aux_slot = grant, aux_slot  # aux_slot None: the caller owns the blocks (expect())
        self.complete = self.freed = False
        self.t_alloc, self.t_done, self.peer = time.monotonic(), 0.0, ""
        self.pull = 0  # the engine request of a pull (READ) in flight, 0: none
        self.pull_bytes = 0


class KVReceiver:
    """Decode side: a registered KV pool carved into request slots, completed by flags.

    ``KVReceiver(engine, layout, num_blocks)`` allocates and registers a pool of its own;
    ``KVReceiver(engine, layout, pool=KVPool.wrap(...))`` works in memory the caller owns (an
    inference engine's KV cache): :meth:`expect` then makes a slot over blocks the caller allocated.
    Besides pushes completed by a flag, a slot can be filled by a pull (:meth:`pull`: the decoder
    READs the prefill's blocks). A pool of several KV cache groups (:meth:`KVPool.wrap_groups`) takes
    block ids per group (:meth:`expect`); ``layout`` is then None or the first group's."""

    def __init__(self, engine: Hixl, layout: Optional[KVLayout], num_blocks: Optional[int] = None, *,
                 max_requests: Optional[int] = None, aux_bytes: int = 256, memory: str = "acl",
                 pool: Optional[KVPool] = None, heads: Any = None):
        """``heads``: the KV heads our blocks hold (tensor parallelism), for head-sliced grants and pulls
        (several groups: one HeadSlice or None per group)."""
        self.engine = engine
        self._own_pool = pool is None  # a pool passed in is the caller's: close() leaves it open
        if pool is None:
            if num_blocks is None:
                raise ValueError("KVReceiver needs num_blocks (a pool of its own) or pool=")
            pool = KVPool(engine, layout, num_blocks, max_requests=max_requests, aux_bytes=aux_bytes, memory=memory)
        elif layout is not None and pool.layout != layout:
            raise ValueError(f"KVReceiver: the pool's layout {pool.layout} is not {layout}")
        self.pool, self.groups, self.layout = pool, pool.groups, pool.layout
        self.group_heads = self.groups.heads(heads)
        self.heads = self.group_heads[0]
        engine.poll_flag_failures()  # subscribes: flags that will not come end their slots at once
        self._failed: Dict[str, str] = {}  # request id -> why, not yet returned by take_failed()
        self._pulls: Dict[str, _Slot] = {}  # slots with a pull in flight
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
        if self.pool.external:
            raise KVError("kv: allocate() hands out blocks of a pool of our own; this pool is wrapped "
                          "memory whose owner allocates them: use expect()")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty str")
        if not isinstance(n_tokens, int) or n_tokens <= 0 or extra_tokens < 0:
            raise ValueError(f"n_tokens must be a positive int and extra_tokens >= 0 (got {n_tokens!r}, {extra_tokens!r})")
        lo, hi = self._layers_of(request_id, layers)
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

    def expect(self, request_id: str, blocks: Sequence[int], n_tokens: int, *, first_block: int = 0,
               layers: Optional[Tuple[int, int]] = None, prefill: Optional[str] = None,
               want: Optional[Tuple[int, int]] = None) -> Grant:
        """A slot over blocks the caller allocated in a wrapped pool (:meth:`KVPool.wrap`):
        ``blocks[k]`` is to hold the request's block ``first_block + k`` (the first ``first_block``
        blocks the caller has already, e.g. from a prefix cache). The grant has no aux area.

        The caller owns the blocks: before it reuses those of a slot that failed or was freed
        before its KV arrived, it must make sure the prefill can no longer write them (its link
        is gone: ``engine.disconnect``).

        ``want``: only the KV heads ``[a, b)`` come from this slot's prefill (head-sliced: the
        receiver's ``heads`` go with the grant); several slots over the same blocks then take their
        heads from several prefills, each completed by its own flag.

        Several KV cache groups: ``blocks`` is one list per group, as long as ``n_tokens`` takes in
        that group, ``None`` for each block not to come from this slot's prefill (``first_block`` is
        then 0), and ``want`` None, one head range for every group whose heads are known, or one
        entry per group (None: whole blocks)."""
        if len(self.groups) > 1 or (blocks and not all(isinstance(b, int) for b in blocks)):
            return self._expect_groups(request_id, blocks, n_tokens, first_block, layers, prefill, want)
        if want is not None and self.heads is None:
            raise ValueError("expect(want=...) needs a KVReceiver with heads=")
        heads = None if want is None else {"slice": self.heads.to_dict(), "want": [int(want[0]), int(want[1])]}
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty str")
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens <= 0:
            raise ValueError(f"n_tokens must be a positive int, not {n_tokens!r}")
        nb = self.layout.blocks_for(n_tokens)
        blocks = tuple(int(b) for b in blocks)
        if not isinstance(first_block, int) or not 0 <= first_block < nb or len(blocks) != nb - first_block:
            raise ValueError(f"{n_tokens} tokens need {nb} blocks: first_block {first_block!r} and "
                             f"{len(blocks)} blocks given")
        if any(not 0 <= b < self.pool.num_blocks for b in blocks):
            raise ValueError(f"blocks {blocks} outside the pool of {self.pool.num_blocks}")
        lo, hi = self._layers_of(request_id, layers)
        with self._cv:
            if request_id in self._slots:
                raise KVError(f"request {request_id!r} already has a slot")
            ticket = self._new_ticket_locked()
            g = Grant(request_id=request_id, decode=self.engine.local_engine, ticket=ticket, blocks=blocks,
                      n_tokens=n_tokens, layers=(lo, hi), pool_addr=self.pool.addr, num_blocks=self.pool.num_blocks,
                      aux_addr=0, aux_bytes=0, layout=asdict(self.layout), prefill=prefill, first_block=first_block,
                      memory=self.pool.memory.to_dict(), heads=heads)
            slot = _Slot(g, None)
            self._slots[request_id] = slot
            self._by_ticket[ticket] = slot
        return g

    def _expect_groups(self, request_id: str, blocks: Sequence, n_tokens: int, first_block: int,
                       layers: Optional[Tuple[int, int]], prefill: Optional[str], want: Any) -> Grant:
        """:meth:`expect` for block lists per group: a grant of :class:`GroupGrant` groups."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty str")
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens <= 0:
            raise ValueError(f"n_tokens must be a positive int, not {n_tokens!r}")
        if first_block:
            raise ValueError("expect() with block lists per group takes None for the blocks it has, not first_block")
        lists = self.groups.per_group(blocks)
        for g, (lst, nb) in enumerate(zip(lists, self.groups.blocks_for(n_tokens))):
            if len(lst) != nb:
                raise ValueError(f"{n_tokens} tokens need {nb} blocks in KV cache group {g}, {len(lst)} given")
        wants = list(want) if isinstance(want, list) else \
            [None if want is None or h is None else want for h in self.group_heads]
        if len(wants) != len(self.groups):
            raise ValueError(f"expect(want=...): {len(wants)} head ranges for {len(self.groups)} KV cache groups")
        parts = []
        for g, (lst, w) in enumerate(zip(lists, wants)):
            if w is not None and self.group_heads[g] is None:
                raise ValueError(f"expect(want=...) of KV cache group {g} needs its heads (heads=)")
            parts.append(GroupGrant(tuple(lst), asdict(self.groups.layouts[g]), self.groups.memories[g],
                                    self.group_heads[g] if w is not None else None,
                                    None if w is None else (int(w[0]), int(w[1]))).to_dict())
        if not any(b is not None for lst in lists for b in lst):
            raise ValueError(f"expect({request_id!r}): no block to receive in any KV cache group")
        lo, hi = self._layers_of(request_id, layers)
        with self._cv:
            if request_id in self._slots:
                raise KVError(f"request {request_id!r} already has a slot")
            ticket = self._new_ticket_locked()
            g = Grant(request_id=request_id, decode=self.engine.local_engine, ticket=ticket, blocks=(),
                      n_tokens=n_tokens, layers=(lo, hi), pool_addr=self.pool.addr, num_blocks=self.pool.num_blocks,
                      aux_addr=0, aux_bytes=0, layout=asdict(self.layout), prefill=prefill, groups=tuple(parts))
            slot = _Slot(g, None)
            self._slots[request_id] = slot
            self._by_ticket[ticket] = slot
        return g

    def pull(self, request_id: str, source: Union[Grant, Dict[str, Any]], *,
             timeout_ms: Optional[int] = None) -> int:
        """Fill the slot by READing the prefill's blocks (pull mode) instead of waiting for a push:
        ``source`` describes them like a grant (its ``decode`` field is the engine to read from,
        its ``blocks`` are the prefill's, from request block 0). Non-blocking: the slot completes in
        :meth:`poll` once the read completed; a failed read shows in :meth:`take_failed`. Returns
        the bytes requested."""
        src = source if isinstance(source, Grant) else Grant.from_dict(source)
        with self._cv:
            slot = self._slots.get(request_id)
            if slot is None:
                raise KVError(f"request {request_id!r} has no slot")
            if slot.complete or slot.pull:
                raise KVError(f"request {request_id!r} is already complete or being pulled")
        g = slot.grant
        descs = self._pull_descs(request_id, g, src)
        if self.engine.get_transport(src.decode)[0] != SUCCESS:
            rc = self.engine.connect(src.decode, 10000 if timeout_ms is None else max(1, int(timeout_ms)))
            if rc not in (SUCCESS, ALREADY_CONNECTED):
                raise TransferFailed(f"kv: connect to prefill {src.decode} failed: {self.engine.last_error()}", rc)
        rc, req = self.engine.transfer_async(src.decode, READ, descs, timeout_in_millis=timeout_ms)
        if rc != SUCCESS:
            raise TransferFailed(f"kv: pull of {request_id!r} from {src.decode} failed: {self.engine.last_error()}", rc)
        with self._cv:
            slot.pull, slot.peer = req, src.decode
            slot.pull_bytes = int(descs[:, 2].sum())
            self._pulls[request_id] = slot
        return slot.pull_bytes

    def _pull_descs(self, request_id: str, g: Grant, src: Grant) -> np.ndarray:
        """The READ descriptors of a pull, per KV cache group: whole blocks, or (the source's group has
        ``heads``: its HeadSlice and the heads wanted from it) only those heads, into their place in
        our blocks."""
        try:
            ours, theirs = g.group_grants(self.layout), src.group_grants(self.layout)
        except (TypeError, ValueError) as e:
            raise KVError(f"kv: pull of {request_id!r}: {e}") from None
        if len(ours) != len(theirs) or src.n_tokens != g.n_tokens:
            raise KVError(f"kv: pull of {request_id!r}: the source holds {src.n_tokens} tokens in "
                          f"{len(theirs)} KV cache group(s), the slot wants {g.n_tokens} in {len(ours)}")
        out = []
        for k, (o, t) in enumerate(zip(ours, theirs)):
            if not layouts_match(t.layout, o.layout, t.heads is not None):
                raise KVError(f"kv: pull of {request_id!r}: the source holds {src.n_tokens} tokens in layout "
                              f"{t.layout}, the slot wants {g.n_tokens} in {o.layout}")
            js = o.wanted(self.groups.layouts[k].blocks_for(g.n_tokens))
            if any(j >= len(t.blocks) or t.blocks[j] is None for j in js):
                raise KVError(f"kv: pull of {request_id!r}: the source lacks blocks {js}"
                              + (f" of KV cache group {k}" if len(ours) > 1 else ""))
            span = self.groups.layers(k)
            layers = [x - span.start for x in range(max(span.start, g.layers[0]), min(span.stop, g.layers[1]))]
            if js and layers:
                out.append(self._group_pull_descs(request_id, k, o, t, layers, js, g.n_tokens))
        return np.concatenate(out) if out else np.zeros((0, 3), np.uint64)

    def _group_pull_descs(self, request_id: str, k: int, ours: GroupGrant, theirs: GroupGrant, layers: List[int],
                          js: List[int], n_tokens: int) -> np.ndarray:
        layout, mem = self.groups.layouts[k], self.groups.memories[k]
        if theirs.heads is None:
            return block_desc_array(layout, mem, ours.blocks, theirs.memory, theirs.blocks, layers, n_tokens, js)
        heads = self.group_heads[k]
        try:
            if heads is None:
                raise ValueError("the source is head-sliced, this receiver has no HeadSlice of its own")
            check_sliced(theirs.memory, theirs.heads, layout.n_layers, "the source's memory")
            descs = sliced_desc_array(mem, heads, ours.blocks, theirs.memory, theirs.heads, theirs.blocks, layers, js,
                                      want=theirs.want)
        except (TypeError, ValueError) as e:
            raise KVError(f"kv: pull of {request_id!r}: {e}") from e
        if not len(descs):
            raise KVError(f"kv: pull of {request_id!r}: the source holds none of heads {theirs.want} "
                          f"({theirs.heads}, ours {heads})")
        return descs

    def fail(self, request_id: str, why: str) -> None:
        """Ends a slot that will not complete (its prefill died, its time ran out): it is dropped
        (its ticket retired: a late flag is ignored) and ``why`` shows in :meth:`take_failed`. For
        a pool of our own the blocks stay quarantined as by :meth:`free`."""
        with self._cv:
            slot = self._slots.get(request_id)
            if slot is None or slot.complete:
                return
            self._pulls.pop(request_id, None)
            self._failed[request_id] = why
        self.free(request_id)

    def take_failed(self) -> Dict[str, str]:
        """Slots that failed since the last call (request id -> why); they have no slot any more.
        Besides failed pulls: pushes whose prefill failed them, or whose prefill's link closed."""
        self._reap_pulls()
        with self._cv:
            self._take_failures_locked()
            out, self._failed = self._failed, {}
        return out

    def _reap_pulls(self) -> None:
        """Ends the pulls whose read ended (non-blocking)."""
        with self._cv:
            pulls = list(self._pulls.items())
        failed = []
        for rid, slot in pulls:
            rc, st = self.engine.get_transfer_status(slot.pull)
            if rc == SUCCESS and st == TransferStatus.WAITING:
                continue
            with self._cv:
                if self._pulls.get(rid) is not slot:
                    continue  # freed or failed meanwhile
                del self._pulls[rid]
                if rc == SUCCESS and st == TransferStatus.COMPLETED:
                    slot.complete, slot.t_done = True, time.monotonic()
                    self._completed.append(rid)
                    self._cv.notify_all()
                    continue
                why = (f"pull from {slot.peer} ended {TransferStatus(st).name if rc == SUCCESS else 'unknown'}: "
                       f"{self.engine.last_error()}")
                self._failed[rid] = why
            _log.warning("kv: %s (request %r)", why, rid)
            failed.append(rid)
        for rid in failed:
            self.free(rid)

    def _layers_of(self, request_id: str, layers: Optional[Tuple[int, int]]) -> Tuple[int, int]:
        """``layers`` checked (default all), and ``request_id`` not taken yet."""
        lo, hi = layers or (0, self.groups.n_layers)
        if not 0 <= lo < hi <= self.groups.n_layers:
            raise ValueError(f"layers {layers!r} outside [0, {self.groups.n_layers})")
        with self._cv:
            if request_id in self._slots:
                raise KVError(f"request {request_id!r} already has a slot")
        return lo, hi

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
            if not slot.complete and slot.aux_slot is None:  # the caller's blocks: nothing to hold back
                del self._by_ticket[slot.grant.ticket]  # a late flag is stale now
                self._pulls.pop(request_id, None)
                return
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
        if slot.aux_slot is None:  # expect(): the blocks are the caller's
            return
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

    def _take_failures_locked(self) -> None:
        """Flags that will not come (the engine's flag failures): the prefill told us its push
        failed (fail_flag), or the link to it closed. Each slot waiting on one ends failed at once,
        with the prefill's reason, instead of at its own timeout."""
        rc, failures = self.engine.poll_flag_failures()
        if rc != SUCCESS or not failures:
            return
        for peer, ticket, reason in failures:
            if ticket >= 0:
                slot = self._by_ticket.get(int(ticket))
                if slot is None or slot.complete:
                    continue  # freed (and dropped) or complete meanwhile
                if slot.grant.prefill and peer != slot.grant.prefill:
                    _log.warning("kv: a failure for %r came from %s, not from %s: ignored",
                                 slot.grant.request_id, peer, slot.grant.prefill)
                    continue
                self._fail_slot_locked(slot, reason)
            else:  # the link closed: nothing more comes from that prefill
                # (a pull in flight on it fails by itself: _reap_pulls collects its request)
                for slot in [s for s in self._by_ticket.values()
                             if not s.complete and not s.pull and s.grant.prefill == peer]:
                    self._fail_slot_locked(slot, f"the link to its prefill closed ({reason})")
        self._cv.notify_all()

    def _fail_slot_locked(self, slot: _Slot, why: str) -> None:
        """The slot's flag will not come and its prefill writes no more (it told us after its last
        transfer ended, or its link is gone): the slot ends now, its blocks go back."""
        rid = slot.grant.request_id
        self._by_ticket.pop(slot.grant.ticket, None)
        if slot.freed:  # quarantined: no late write to wait for any more
            self._quarantined -= 1
        else:
            if self._slots.get(rid) is slot:
                del self._slots[rid]
            self._pulls.pop(rid, None)
            self._failed[rid] = why
            _log.warning("kv: KV of request %r will not come: %s", rid, why)
        slot.freed = True
        self._release(slot)

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
        self._take_failures_locked()

    def poll(self) -> List[str]:
        """Request ids whose KV became complete since the last poll()/wait_any(); never blocks.
        Pulls are reaped here too (a failed one shows in :meth:`take_failed`)."""
        if self._pulls:
            self._reap_pulls()
        rc, flags = self.engine.poll_flags()
        with self._cv:
            self._check(rc, "poll_flags")
            self._dispatch_locked(flags)
            self._take_failures_locked()
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
        :class:`KVTimeout` after ``timeout`` seconds (None: no limit), :class:`TransferFailed` as soon
        as the prefill says its push failed (``Hixl.fail_flag``, which :class:`KVSender` sends) or the
        link to the grant's prefill closed, naming the reason. Returns the time the flag arrived
        (``time.monotonic()``). ``warm=True`` then touches every byte of the slot once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                slot = self._slots.get(request_id)
                if slot is None:
                    why = self._failed.pop(request_id, None)
                    if why is not None:  # its prefill failed it (or its link closed): at once, with the reason
                        raise TransferFailed(f"kv: KV of request {request_id!r} will not come: {why}")
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
        blocks = [list(v.blocks) for v in g.group_grants(self.layout)]
        return self.pool.checksum(blocks if self.pool.external else blocks[0], g.n_tokens, g.layers)

    def close(self) -> None:
        if self._own_pool:
            self.pool.close()
