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
from .grant import Grant, GroupGrant
from .heads import HeadSlice, check_sliced, head_runs, layouts_match, sliced_desc_array
from .layout import KVLayout, block_desc_array
from .pool import KVPool

_log = logging.getLogger("hixl.kv")


class _Target:
    __slots__ = ("grant", "groups", "js", "layers", "pushed", "flagged", "aux_slot", "failed", "fail_sent", "need")

    def __init__(self, grant: Grant, groups: List[GroupGrant], js: List[List[int]], layers: List[range],
                 aux_slot: Optional[int]):
        self.grant, self.groups = grant, groups  # per KV cache group: the decoder's blocks, memory, heads
        self.js = js            # per group: the request blocks this target wants
        self.layers = layers    # per group: the (global) layers this target wants
        self.need = sum(len(ls) * len(j) for ls, j in zip(layers, js))  # (layer, j) pairs to send in all
        self.pushed: set = set()  # (layer, j) pairs sent
        self.flagged = False
        self.failed: Optional[str] = None  # why a push to this target failed (the decoder is told: fail_flag)
        self.fail_sent = False
        self.aux_slot = aux_slot  # our staging slot for this target's aux bytes (one per target: an
        # earlier target's aux transfer may still be reading its slot when a later one is staged);
        # None: the grant has no aux area (or our pool is wrapped memory without one)


class _Request:
    __slots__ = ("blocks", "n_tokens", "aux", "targets", "inflight", "errors", "bytes", "descs",
                 "intervals", "t_first_submit", "external", "group_bytes")

    def __init__(self, blocks: List[List[Optional[int]]], n_tokens: int, external: bool = False):
        self.blocks, self.n_tokens = blocks, n_tokens  # per KV cache group: our block of each request block
        self.external = external  # blocks of the caller's (add_request), not of our pool
        self.aux: Optional[bytes] = None
        self.targets: List[_Target] = []
        self.inflight = 0
        self.errors: List[str] = []
        self.bytes = 0
        self.group_bytes = [0] * len(blocks)  # of the KV cache groups' units (aux bytes apart)
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
    blocks of memory the caller owns (:meth:`add_request` names them, e.g. vLLM's block ids). A pool
    of several KV cache groups (:meth:`KVPool.wrap_groups`) takes block ids per group and layers
    numbered across the groups (:class:`~hixl.kv.groups.KVGroups`); ``layout`` is then None or the
    first group's.

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
        ``heads``: the KV heads our blocks hold (tensor parallelism), which head-sliced grants need
        (several groups: one HeadSlice or None per group).
        ``on_settled(request_id)``: called (on the reaper thread) when a request has no write in flight
        any more, so a caller can wait for that instead of polling :meth:`stats`."""
        self.engine = engine
        self._own_pool = pool is None  # a pool passed in is the caller's: close() leaves it open
        if pool is None:
            if num_blocks is None:
                raise ValueError("KVSender needs num_blocks (a pool of its own) or pool=")
            pool = KVPool(engine, layout, num_blocks, max_requests=(max_requests or num_blocks) * max_targets,
                          aux_bytes=aux_bytes, memory=memory)
        elif layout is not None and pool.layout != layout:
            raise ValueError(f"KVSender: the pool's layout {pool.layout} is not {layout}")
        self.pool, self.groups, self.layout = pool, pool.groups, pool.layout
        self.group_heads = self.groups.heads(heads)
        self.heads = self.group_heads[0]
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
            self._reqs[request_id] = _Request([blocks], n_tokens)
        return blocks

    def add_request(self, request_id: str, blocks: Sequence, n_tokens: int, *, partial: bool = False) -> None:
        """A request whose KV the caller already holds in ``blocks`` of the pool (request block j
        is ``blocks[j]``; several KV cache groups: one such list per group, ``None`` for a block the
        request does not hold); the sender never gives them back, :meth:`release` only forgets them.
        ``partial``: fewer blocks than ``n_tokens`` need so far (a chunked prefill allocates them
        as it goes: :meth:`set_blocks` names more; a push of a block not named yet is refused)."""
        if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens <= 0:
            raise ValueError(f"n_tokens must be a positive int, not {n_tokens!r}")
        blocks = self._check_blocks(blocks, n_tokens, partial)
        with self._cv:
            if request_id in self._reqs:
                raise KVError(f"request {request_id!r} is already on this sender")
            self._reqs[request_id] = _Request(blocks, n_tokens, external=True)

    def set_blocks(self, request_id: str, blocks: Sequence, *, partial: bool = False) -> None:
        """The request's blocks as known now (an :meth:`add_request` request): blocks named before
        stay, or become ``None`` (their owner freed them, as a sliding window does: a push of them
        is refused from now on)."""
        r = self._req(request_id)
        blocks = self._check_blocks(blocks, r.n_tokens, partial)
        with self._cv:
            if not r.external or any(b is not None and b != a for old, new in zip(r.blocks, blocks)
                                     for a, b in zip(old, new)):
                raise KVError(f"request {request_id!r}: its blocks cannot change ({r.blocks} -> {blocks})")
            r.blocks = blocks

    def _check_blocks(self, blocks: Sequence, n_tokens: int, partial: bool) -> List[List[Optional[int]]]:
        try:
            lists = self.groups.per_group(blocks)
        except ValueError as e:
            raise ValueError(f"blocks {str(list(blocks))[:200]}: {e}") from None
        for g, (lst, need) in enumerate(zip(lists, self.groups.blocks_for(n_tokens))):
            if len(lst) > need or (len(lst) < need and not partial):
                what = f"group {g}: " if len(lists) > 1 else ""
                raise ValueError(f"{what}{n_tokens} tokens need {need} blocks, {len(lst)} given")
        return lists

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
        self.pool.scatter(layer, 0, r.blocks[0], k, start)
        self.pool.scatter(layer, 1, r.blocks[0], v, start)

    def checksum(self, request_id: str, layers: Optional[Tuple[int, int]] = None) -> str:
        r = self._req(request_id)
        return self.pool.checksum(r.blocks[0] if not r.external else r.blocks, r.n_tokens,
                                  layers or (0, self.groups.n_layers))

    # -- targets and pushes ----------------------------------------------------------------------
    def add_target(self, request_id: str, grant: Union[Grant, Dict[str, Any]]) -> None:
        """Send this request's KV (the grant's layers and blocks) to the grant's decoder (connecting
        to it first when this engine has no link to it yet)."""
        g = grant if isinstance(grant, Grant) else Grant.from_dict(grant)
        r = self._req(request_id)
        if g.request_id != request_id:
            raise KVError(f"grant is for request {g.request_id!r}, not {request_id!r}")
        if g.n_tokens != r.n_tokens:
            raise KVError(f"grant for {request_id!r} is for {g.n_tokens} tokens, the request has {r.n_tokens}")
        if not 0 <= g.layers[0] < g.layers[1] <= self.groups.n_layers:
            raise KVError(f"grant for {request_id!r} is malformed: layers {g.layers} of {self.groups.n_layers}")
        try:
            views = g.group_grants(self.layout)
        except (TypeError, ValueError) as e:
            raise KVError(f"grant for {request_id!r} is malformed or has a bad memory description: {e}") from e
        if len(views) != len(self.groups):
            raise KVError(f"grant for {request_id!r} has {len(views)} KV cache group(s), this sender "
                          f"{len(self.groups)}")
        js, layers = [], []
        for k, view in enumerate(views):
            self._check_group(request_id, k, view)
            nb = self.groups.layouts[k].blocks_for(g.n_tokens)
            wanted = view.wanted(nb)
            if wanted and len(view.blocks) < nb:
                raise KVError(f"grant for {request_id!r} is malformed: {len(view.blocks)} blocks of group {k} for "
                              f"{g.n_tokens} tokens ({nb} blocks)")
            span = self.groups.layers(k)
            js.append(set(wanted))
            layers.append(range(max(span.start, g.layers[0]), min(span.stop, g.layers[1])))
        if not any(len(ls) and j for ls, j in zip(layers, js)):
            raise KVError(f"grant for {request_id!r} is malformed: it wants no block (from block {g.first_block!r}, "
                          f"layers {g.layers})")
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
            r.targets.append(_Target(g, views, js, layers, aux_slot))

    def _check_group(self, request_id: str, k: int, view: GroupGrant) -> None:
        """A grant's group ``k`` against ours: its layout, the decoder's memory (whole blocks, or
        head-sliced) and its block ids."""
        layout, ours = self.groups.layouts[k], self.groups.memories[k]
        what = f"grant for {request_id!r}" + (f" (KV cache group {k})" if len(self.groups) > 1 else "")
        heads = self.group_heads[k]
        if not layouts_match(view.layout, asdict(layout), view.heads is not None):
            raise KVError(f"{what} has layout {view.layout}, this sender has {asdict(layout)}")
        mem = view.memory
        try:
            if view.heads is None:
                mem.check(layout)
            else:
                if heads is None:
                    raise ValueError("the grant is head-sliced, this sender has no HeadSlice of its own")
                check_sliced(mem, view.heads, layout.n_layers, "the decoder's memory")
                if not len(head_runs(heads, view.heads, view.want)):
                    raise ValueError(f"it wants heads {view.want} of {view.heads}, we hold {heads}: none in common")
        except (TypeError, ValueError) as e:
            raise KVError(f"{what} has a bad memory description: {e}") from e
        if mem.parts != ours.parts or (view.heads is None and mem.unit_bytes != ours.unit_bytes):
            raise KVError(f"{what}: the decoder packs its blocks differently ({mem.parts} parts of "
                          f"{mem.unit_bytes} B, ours {ours.parts} of {ours.unit_bytes} B)")
        if any(b is not None and not 0 <= b < mem.num_blocks for b in view.blocks):
            raise KVError(f"{what} names blocks outside the decoder's pool of {mem.num_blocks}")

    def targets(self, request_id: str) -> List[str]:
        """The decoders this request goes to."""
        with self._cv:
            return [t.grant.decode for t in self._req(request_id).targets]

    def _descs(self, r: _Request, t: _Target, pairs: Iterable[Tuple[int, int]]) -> Tuple[np.ndarray, Dict[int, int]]:
        """The descriptors of ``(layer, j)`` pairs: one per (layer, K|V, block), adjacent ones merged, as a
        descriptor array (no Python object per descriptor), and their bytes per group; head-sliced
        targets get only the heads they want. Runs of layers of one group with the same blocks are
        built at once."""
        per_layer: Dict[int, List[int]] = {}
        for x, j in pairs:
            per_layer.setdefault(x, []).append(j)
        chunks: List[Tuple[int, List[int], List[int]]] = []  # (group, its layers, js)
        for x in sorted(per_layer):
            g, i = self.groups.group_of(x)
            js = sorted(per_layer[x])
            if chunks and chunks[-1][0] == g and chunks[-1][2] == js:
                chunks[-1][1].append(i)
            else:
                chunks.append((g, [i], js))
        out = [(g, self._group_descs(r, t, g, ls, js)) for g, ls, js in chunks]
        by_group: Dict[int, int] = {}
        for g, a in out:
            by_group[g] = by_group.get(g, 0) + int(a[:, 2].sum())
        arrays = [a for _, a in out]
        descs = arrays[0] if len(arrays) == 1 else np.concatenate(arrays) if arrays else np.zeros((0, 3), np.uint64)
        return descs, by_group

    def _group_descs(self, r: _Request, t: _Target, g: int, layers: List[int], js: List[int]) -> np.ndarray:
        view, mem = t.groups[g], self.groups.memories[g]
        if view.heads is not None:
            return sliced_desc_array(mem, self.group_heads[g], r.blocks[g], view.memory, view.heads, view.blocks,
                                     layers, js, want=view.want)
        return block_desc_array(self.groups.layouts[g], mem, r.blocks[g], view.memory, view.blocks, layers,
                                r.n_tokens, js)

    def _set_aux(self, r: _Request, aux: Optional[bytes]) -> None:
        if aux is not None:
            aux = bytes(aux)
            if len(aux) > self.pool.aux_bytes:
                raise ValueError(f"aux is {len(aux)} bytes, at most {self.pool.aux_bytes}")
            r.aux = aux

    def push(self, request_id: str, layers: Union[int, Iterable[int]], *,
             blocks: Union[None, Iterable[int], Dict[int, Iterable[int]]] = None, aux: Optional[bytes] = None,
             complete: Optional[bool] = None) -> int:
        """Start moving ``layers`` (already stored) to every target; returns the bytes submitted.

        ``blocks``: the request blocks (indices ``j`` into its block list) to move, default all: a
        chunked prefill pushes each block once it is full (several KV cache groups: ``{group: js}``,
        a group not named moving none; a plain list applies to every group). Each
        (layer, block) goes to a target once; a target gets those of its grant only. A block the
        target wants that this side does not hold (``None``) fails the push (:class:`KVError`): the
        decoder would be flagged without it.

        Non-blocking unless ``max_inflight`` transfers are outstanding (then it waits for credit).
        With ``complete=None`` the push that completes a target's layers and blocks also writes the
        aux bytes (``aux``, or those given to an earlier push) and carries the completion flag; with
        ``complete=False`` no flag goes yet: :meth:`complete` sends it later (so the last layers can
        travel while the first token is still being computed); ``complete=True`` flags this push
        (the caller knows it is the last one: a target that still lacks some pairs raises
        :class:`KVError` instead of being flagged)."""
        r = self._req(request_id)
        want = sorted({layers} if isinstance(layers, int) else set(layers))
        if any(not 0 <= x < self.groups.n_layers for x in want):
            raise ValueError(f"layers {want} outside [0, {self.groups.n_layers})")
        js_of = self._push_blocks(r, blocks)
        self._set_aux(r, aux)
        if not r.targets:
            raise KVError(f"request {request_id!r} has no target: add_target() first")
        total = 0
        for t in r.targets:
            if t.flagged:
                continue
            new = []
            for x in want:
                g, _ = self.groups.group_of(x)
                if x in t.layers[g]:
                    new.extend((x, j) for j in js_of[g] if j in t.js[g] and (x, j) not in t.pushed)
            flag = None
            if not new:
                if complete:
                    total += self._complete_target(request_id, r, t)
                continue
            self._check_held(request_id, r, t, new)
            t.pushed.update(new)
            descs, by_group = self._descs(r, t, new)
            if complete or (complete is None and len(t.pushed) == t.need):
                self._check_all_pushed(request_id, t)
                descs, flag = self._stage_flag(r, t, descs)
            what = f"layers {sorted({x for x, _ in new})} blocks {sorted({j for _, j in new})}"
            total += self._submit(request_id, r, t, descs, flag, what, by_group)
        return total

    def _push_blocks(self, r: _Request, blocks: Union[None, Iterable[int], Dict[int, Iterable[int]]]) -> List[List[int]]:
        """A push's request blocks per group, checked against the blocks the request has there."""
        if isinstance(blocks, dict):
            out = [sorted(set(blocks.get(g, ()))) for g in range(len(self.groups))]
        else:
            js = None if blocks is None else sorted(set(blocks))
            out = [list(range(len(b))) if js is None else js for b in r.blocks]
        for g, js in enumerate(out):
            nb = len(r.blocks[g])
            if any(not 0 <= j < nb for j in js):
                what = f" of group {g}" if len(out) > 1 else ""
                raise ValueError(f"blocks {list(js)} outside the request's {nb} known blocks{what}")
        return out

    def _check_held(self, request_id: str, r: _Request, t: _Target, pairs: List[Tuple[int, int]]) -> None:
        for x, j in pairs:
            g, _ = self.groups.group_of(x)
            if r.blocks[g][j] is None:
                raise KVError(f"kv: request {request_id!r}: the decoder {t.grant.decode} wants request block {j} of "
                              f"KV cache group {g}, which this side does not hold (its owner freed it)")

    @staticmethod
    def _check_all_pushed(request_id: str, t: _Target) -> None:
        if len(t.pushed) < t.need:
            raise KVError(f"kv: request {request_id!r}: the completion flag for {t.grant.decode} would go with "
                          f"{t.need - len(t.pushed)} of its {t.need} (layer, block) pairs not pushed")

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
        self._check_all_pushed(request_id, t)
        descs, by_group = np.zeros((0, 3), np.uint64), {}
        if t.aux_slot is None:  # no aux area: the flag rides on the last unit, sent again
            descs, by_group = self._descs(r, t, [max(t.pushed)])
        descs, flag = self._stage_flag(r, t, descs)
        return self._submit(request_id, r, t, descs, flag, "completion flag", by_group)

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
                flag: Optional[int], what: str, by_group: Optional[Dict[int, int]] = None) -> int:
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
            for g, n in (by_group or {}).items():
                r.group_bytes[g] += n
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
        """bytes (and those of each KV cache group's units: ``group_bytes``), transfers, busy seconds
        (union of submit..completion intervals), first submit and last completion (monotonic seconds),
        whether every target got its flag."""
        with self._cv:
            r = self._req(request_id)
            iv = list(r.intervals)
            return {"bytes": r.bytes, "group_bytes": list(r.group_bytes), "descriptors": r.descs,
                    "transfers": len(iv), "inflight": r.inflight,
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
                        self.pool.blocks.give(r.blocks[0])
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
