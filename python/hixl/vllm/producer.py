"""The prefill part of the worker: push each layer's complete blocks into the decoder's blocks while the
forward pass goes on (:meth:`Producer.layer_done` is called by vLLM's ``save_kv_layer`` hook right after
the attention layer wrote them), with the completion flag on the last write.

A request's decoder *grant* (its block ids, from the decoder over the hixl link) may come before the
prefill starts, during it (the layers already computed are sent at once, then the rest as computed)
or after it (the whole request is sent from the blocks vLLM holds for us: the fallback). With tensor
parallelism a request may get several grants, one per decoder TP rank that needs heads of ours (each
says how many there are: ``fanin``); each becomes a target with its own completion flag, and one
that comes late gets what the others got already. Which thread pushes a grant is decided under one
lock: the forward thread while the request is being computed, the inbox thread once it was (each
pending grant is claimed by exactly one of them). Nothing here ever waits on the
decoder: a push only posts (the engine copies or the NIC writes), bounded by ``max_inflight``.

Several KV cache groups: a layer's blocks are those of its group, as far as the decoder wants them (a
sliding window's blocks behind the window never move). A Mamba group's state is complete only once the
prompt is, and its layers have no ``save_kv_layer`` hook: the states move when the last step's forward
ends (``wait_for_save``), with the flag.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional

from .. import kv
from ..engine import Hixl
from .cache import CacheGroups
from .config import ConnectorConfig
from .links import Links
from .metadata import HixlConnectorMetadata, SendStep
from .stats import Recorder

_log = logging.getLogger("hixl.vllm")
_MAX_REMEMBERED = 4096  # transfer ids remembered as expired/cancelled (late grants get an abort)


class _Send:
    __slots__ = ("rid", "tid", "n_tokens", "blocks", "grants", "decoders", "fanin", "attached", "dead", "phase",
                 "step", "done", "t_start", "t_computed", "t_finished", "released", "cancel", "added", "stale",
                 "aborted_sent", "busy", "lock", "cancelled_by", "first_grant")

    def __init__(self, rid: str, tid: str, n_tokens: int):
        self.rid, self.tid, self.n_tokens = rid, tid, n_tokens
        self.blocks: List[List[Optional[int]]] = []  # per group (None: a block we do not hold)
        self.grants: List[kv.Grant] = []  # grants not claimed yet
        self.decoders: List[str] = []     # the decoders whose grants were claimed
        self.fanin = 1              # how many decoders will grant (TP: one per decoder rank needing our heads)
        self.attached = False       # a target was added
        self.dead: Optional[str] = None  # why nothing more is sent
        self.phase = "computing"    # computing -> computed (prompt done) ; finished is t_finished
        self.step: Optional[SendStep] = None
        self.done: List[int] = []   # per group: request blocks complete before the current step
        self.t_start = time.monotonic()
        self.t_computed = 0.0
        self.t_finished = 0.0       # vLLM finished the request (its blocks are held for us)
        self.released = False       # pull: the decoder read them
        self.cancel: Optional[str] = None  # the decoder cancelled (peer to confirm to)
        self.added = False          # known to the KVSender
        self.stale = False          # vLLM added blocks the KVSender does not know yet
        self.busy = False           # the inbox thread is pushing it (finished() leaves it alone)
        self.lock = threading.Lock()  # held while a push of it is posted (see _push)
        self.aborted_sent = False
        self.cancelled_by: Optional[str] = None  # the decoder that cancelled (the others hear an abort)
        self.first_grant: Optional[kv.Grant] = None

    @property
    def grant(self) -> Optional[kv.Grant]:
        """The first grant that came for it (None: none yet)."""
        return self.first_grant


class Producer:
    """Pushes the KV of the requests vLLM computes here to the decoders that granted blocks for them:
    ``engine`` and ``pool`` (vLLM's KV cache, registered) carry the writes, ``links`` the messages to
    decoders (aborts, cancel confirmations), ``stats`` records each transfer's end; ``groups``
    (:class:`~hixl.vllm.cache.CacheGroups`) are the KV cache groups (their interiors, which a grant's must
    match, and the KV heads our blocks hold: head-sliced grants need them)."""

    def __init__(self, engine: Hixl, pool: kv.KVPool, groups: CacheGroups, config: ConnectorConfig,
                 stats: Recorder, links: Links):
        self.groups, self.config, self.stats, self.links = groups, config, stats, links
        self._wake = threading.Event()  # a decoder's message came, or our writes settled: finished() waits
        self.tx = kv.KVSender(engine, None, pool=pool, max_inflight=config.max_inflight, timeout=config.timeout_s,
                              heads=groups.heads, on_settled=lambda _rid: self._wake.set())
        self._all = range(groups.kv.n_layers)
        hooked = [x for x in groups.order if x in groups.hooked]
        self._last_hooked = hooked[-1] if hooked else -1
        self._unhooked = [x for x in groups.order if x not in groups.hooked]  # Mamba layers: pushed at the end
        self._step_layers: List[int] = []  # the layers computed so far in this step
        self._lock = threading.Lock()
        self._sends: Dict[str, _Send] = {}         # by vLLM request id
        self._by_tid: Dict[str, _Send] = {}
        self._grants: "OrderedDict[str, tuple]" = OrderedDict()  # tid -> ([grants], fanin, arrived) not claimed yet
        self._released: "OrderedDict[str, bool]" = OrderedDict()  # tids released before their request came
        self._gone: "OrderedDict[str, str]" = OrderedDict()  # tid -> why (expired, cancelled, failed)
        self._held: Dict[str, str] = {}            # finished ids vLLM holds blocks of for us
        self._step: List[_Send] = []
        self.step_active = False

    # -- per step (forward thread) ---------------------------------------------------------------
    def begin_step(self, meta: HixlConnectorMetadata) -> None:
        with self._lock:
            self._held.update(meta.held)
            for rid, st in meta.sends.items():
                s = self._sends.get(rid)
                if s is None:
                    s = _Send(rid, st.transfer_id, st.n_tokens)
                    s.done = [0] * len(self.groups)
                    self._sends[rid] = s
                    if st.transfer_id in self._by_tid:
                        s.dead = f"transfer id {st.transfer_id} is already in use by another request"
                    else:
                        self._by_tid[st.transfer_id] = s
                    why = self._gone.get(st.transfer_id)
                    if why:
                        s.dead = why
                    g = self._grants.pop(st.transfer_id, None)
                    if g is not None:
                        s.grants, s.fanin, s.first_grant = list(g[0]), g[1], g[0][0]
                    s.released = self._released.pop(st.transfer_id, False)
                blocks = st.group_blocks()
                if blocks != s.blocks:
                    s.blocks, s.stale = blocks, s.added
                s.step = st
                if s.dead is None:
                    self._step.append(s)
        self._step_layers = []
        self.step_active = bool(self._step)

    def _step_blocks(self, s: _Send) -> Dict[int, range]:
        """Per group, the request blocks that become complete in this step."""
        return {g: range(lo, hi) for g, (lo, hi) in enumerate(s.step.group_spans())}

    def _done_blocks(self, s: _Send) -> Dict[int, range]:
        """Per group, the request blocks complete before this step (or, once computed, all of them)."""
        return {g: range(0, n) for g, n in enumerate(s.done)}

    def layer_done(self, layer: int) -> None:
        """vLLM's ``save_kv_layer``: ``layer`` (our global number) of this step is in the KV cache."""
        g, _ = self.groups.kv.group_of(layer)
        last = layer == self._last_hooked and not self._unhooked  # the flag rides on it
        for s in self._step:
            if s.dead:
                continue
            step = self._step_blocks(s)
            if s.grants:
                with self._lock:
                    new, s.grants = s.grants, []
                # a grant came now: what was computed before goes first (to its decoder only)
                if new and not self._attach(s, new, [(self._all, self._done_blocks(s)), (self._step_layers, step)],
                                            False):
                    continue
            if not s.attached:
                continue
            complete = s.step.final and last
            if len(step[g]) or complete:
                self._push(s, [layer], {g: step[g]}, complete)
        self._step_layers.append(layer)

    def end_step(self) -> None:
        now = time.monotonic()
        whole, states = [], []
        with self._lock:
            for s in self._step:
                s.done = [hi for _, hi in s.step.group_spans()]
                if s.step.final:
                    s.phase, s.t_computed = "computed", now
                    if s.grants and not s.dead:  # grants came after the last layer: everything now
                        whole.append((s, s.grants))
                        s.grants = []
                    elif s.attached and not s.dead and self._unhooked:
                        states.append(s)
                s.step = None
            self._step = []
        self.step_active = False
        for s in states:  # the Mamba states, complete now, and the flag
            self._push(s, self._unhooked, self._done_blocks(s), True)
        for s, new in whole:
            self._attach(s, new, [(self._all, self._done_blocks(s))], True)

    # -- pushes --------------------------------------------------------------------------------
    def _attach(self, s: _Send, grants: List[kv.Grant], pushes: list, complete: bool) -> bool:
        """Adds the grants' decoders as the request's targets and pushes ``(layers, {group: blocks})``
        pairs (the last one flagged when ``complete``; a target has each pair once, so the ones added
        before get only what they lack). False (and the request dead) on failure."""
        with s.lock:  # no push of the request is being posted while its targets change
            for g in grants:
                s.decoders.append(g.decode)  # claimed (it hears an abort if the request fails)
                try:
                    if not self.links.linked(g.decode):
                        raise kv.TransferFailed(f"no link to the decoder {g.decode} (it went away)")
                    if not s.added:
                        self.tx.add_request(s.tid, s.blocks, s.n_tokens, partial=True)
                        s.added, s.stale = True, False
                    self.tx.add_target(s.tid, dataclasses.replace(g, request_id=s.tid))
                    s.attached = True
                except (kv.KVError, ValueError) as e:
                    self._fail(s, f"the grant of the decoder {g.decode} cannot be served: {e}")
                    return False
        todo = [(ls, js) for ls, js in pushes if len(ls) and any(len(j) for j in js.values())]
        for i, (ls, js) in enumerate(todo):
            if not self._push(s, ls, js, complete and i == len(todo) - 1):
                return False
        if complete and not todo:
            return self._push(s, [self._all[-1]], {}, True)
        return True

    def _push(self, s: _Send, layers, blocks: Dict[int, range], complete: bool) -> bool:
        # under the send's own lock, with the check that it is still wanted: a cancel is confirmed under
        # the same lock once nothing is in flight, so no push can be posted after that confirmation
        with s.lock:
            if s.dead:
                return False
            try:
                if s.stale:
                    self.tx.set_blocks(s.tid, s.blocks, partial=True)
                    s.stale = False
                self.tx.push(s.tid, layers, blocks=blocks, complete=True if complete else False)
                return True
            except (kv.KVError, ValueError) as e:
                self._fail(s, f"push failed: {e}")
                return False

    def _fail(self, s: _Send, why: str) -> None:
        _log.warning("hixl.vllm: transfer %s (request %s): %s", s.tid, s.rid, why)
        s.dead = s.dead or why
        self.stats.failed("send")

    # -- messages (inbox thread) -----------------------------------------------------------------
    def on_grant(self, tid: str, d: Dict[str, Any]) -> None:
        try:
            g = kv.Grant.from_dict(d["grant"])
            fanin = int(d.get("fanin", 1))
            sliced = [v.heads is not None for v in g.group_grants(self.tx.layout)]
        except (KeyError, TypeError, ValueError) as e:
            decode = d.get("grant", {}).get("decode") if isinstance(d.get("grant"), dict) else None
            _log.warning("hixl.vllm: malformed grant for %s from %s: %s", tid, decode, e)
            if isinstance(decode, str):
                self.links.post(decode, "abort", tid, f"malformed grant: {e}")
            return
        # each group as the decoder has it (head-sliced: their blocks hold other heads, the rest must match)
        why = self.groups.mismatch(d.get("groups"), sliced)
        if why is not None:
            self.links.post(g.decode, "abort", tid, f"the prefill's KV blocks cannot be copied into the decoder's "
                                                    f"as they are: {why.replace('the peer', 'the decoder')}")
            return
        whole, why = self._take_grant(tid, g, fanin)
        self._wake.set()
        if why is not None:
            self.links.post(g.decode, "abort", tid, why)
        elif whole is not None:
            s, new = whole
            try:
                self._attach(s, new, [(self._all, self._done_blocks(s))], True)
            finally:
                with self._lock:
                    s.busy = False

    def _take_grant(self, tid: str, g: kv.Grant, fanin: int):
        """Files a grant: ``(whole, why)``: the send and the grants the inbox thread pushes now (its
        prompt was computed), or why it is refused (to tell its decoder)."""
        with self._lock:
            why = self._gone.get(tid)
            s = self._by_tid.get(tid)
            if why is None and s is not None and s.dead:
                why = s.dead
            if why is not None:
                return None, why
            if s is None:
                grants, _, t0 = self._grants.get(tid, ([], 0, time.monotonic()))
                if any(x.decode == g.decode for x in grants):
                    _log.warning("hixl.vllm: a second grant for %s from %s: ignored", tid, g.decode)
                    return None, None
                self._grants[tid] = (grants + [g], max(fanin, 1), t0)
                while len(self._grants) > _MAX_REMEMBERED:
                    old_tid, (old, _, _) = self._grants.popitem(last=False)
                    for x in old:
                        self.links.post(x.decode, "abort", old_tid,
                                        "too many grants for requests the prefill never saw")
                return None, None
            if g.decode in s.decoders or any(x.decode == g.decode for x in s.grants):
                _log.warning("hixl.vllm: a second grant for %s from %s: ignored", tid, g.decode)
                return None, None
            s.fanin = max(s.fanin, fanin)
            s.grants.append(g)
            s.first_grant = s.first_grant or g
            if s.phase == "computed" and not s.busy:
                new, s.grants = s.grants, []
                s.busy = True
                return (s, new), None
            return None, None

    def on_cancel(self, tid: str, msg: str) -> None:
        """The decoder gave up on ``tid``: nothing more is sent, and once no write of it is in flight
        the decoder hears ``cancelled`` (at once when we never saw it, or never got its grant)."""
        try:
            d = json.loads(msg)
            decode, why = d["decode"], str(d.get("why", ""))
        except (ValueError, KeyError, TypeError):
            _log.warning("hixl.vllm: malformed cancel for %s: %r", tid, msg[:200])
            return
        with self._lock:
            self._grants.pop(tid, None)
            s = self._by_tid.get(tid)
            reason = f"cancelled by the decoder ({why})"
            if s is None:
                self._remember(tid, reason)
            else:
                s.dead = s.dead or reason
                s.cancel = s.cancelled_by = decode
        _log.info("hixl.vllm: transfer %s cancelled by the decoder: %s", tid, why)
        self._wake.set()
        if s is None:
            self.links.post(decode, "cancelled", tid)

    def on_release(self, tid: str, msg: str) -> None:
        """Pull: the decoder read the blocks; or (TP) no decoder rank needs the heads of ours."""
        with self._lock:
            s = self._by_tid.get(tid)
            if s is not None:
                s.released = True
            else:  # before the request came here (a prefill rank nobody reads)
                self._released[tid] = True
                while len(self._released) > _MAX_REMEMBERED:
                    self._released.popitem(last=False)
        self._wake.set()

    def _remember(self, tid: str, why: str) -> None:
        self._gone[tid] = why
        while len(self._gone) > _MAX_REMEMBERED:
            self._gone.popitem(last=False)

    def needs_ticks(self) -> bool:
        return any(s.cancel for s in self._sends.values()) or bool(self._grants)

    def tick(self) -> None:
        """Inbox thread, each wake-up: confirm cancels whose writes are over; drop unclaimed grants
        past the lease (the decoder hears why)."""
        now = time.monotonic()
        confirm, stale = [], []
        with self._lock:
            for s in self._sends.values():
                if not s.cancel or not s.lock.acquire(blocking=False):  # a push being posted: next tick
                    continue
                try:
                    if not s.added or self.tx.stats(s.tid)["inflight"] == 0:
                        confirm.append((s.cancel, s.tid))
                        s.cancel = None
                finally:
                    s.lock.release()
            while self._grants:
                tid, (grants, _, t) = next(iter(self._grants.items()))
                if now - t <= self.config.lease_s:
                    break
                self._grants.popitem(last=False)
                self._remember(tid, "expired")
                stale.extend((g.decode, tid) for g in grants)
        for peer, tid in confirm:
            self.links.post(peer, "cancelled", tid)
        for peer, tid in stale:
            self.links.post(peer, "abort", tid, f"the prefill saw no request with this transfer id within the lease "
                                                f"({self.config.lease_s:g} s)")

    # -- the end of a request (forward thread, get_finished) --------------------------------------
    def finished(self, finished_req_ids: set, idle: bool = False) -> set:
        """Requests whose held blocks vLLM may free now. ``idle``: nothing is computed in this step.

        Blocks held for a decoder keep vLLM stepping, and between steps its worker spins on its core:
        an idle step that has nothing to give back yet waits up to ``idle_wait_ms`` for a decoder's
        message (blocking, GIL released) instead. On a core it shares with the decoder, the spinning
        prefill starved the very decoder whose grant it waited for."""
        self._wake.clear()
        out = self._finished(finished_req_ids)
        if not out and idle and self._sends and self.config.idle_wait_ms > 0:
            self._wake.wait(self.config.idle_wait_ms / 1000.0)
            out = self._finished(set())  # our writes may have completed meanwhile too
        return out

    def _finished(self, finished_req_ids: set) -> set:
        now = time.monotonic()
        out = set()
        with self._lock:
            for rid in finished_req_ids:
                s = self._sends.get(rid)
                if s is not None and not s.t_finished:
                    s.t_finished = now
                    if s.phase == "computing":
                        s.dead = s.dead or "the prefill request ended before its prompt was computed"
                elif s is None and rid in self._held:  # held, but never computed here
                    del self._held[rid]
                    out.add(rid)
            ends = []
            for rid, s in self._sends.items():
                if not s.t_finished or s.busy:
                    continue
                inflight = self.tx.stats(s.tid)["inflight"] if s.added else 0
                if inflight:
                    continue
                why = self._outcome(s, now)
                if why is not False:
                    ends.append((s, why))
            for s, why in ends:
                del self._sends[s.rid]
                self._by_tid.pop(s.tid, None)
                self._held.pop(s.rid, None)
                out.add(s.rid)
                if why:
                    self._remember(s.tid, why)
        for s, why in ends:
            self._end(s, why, now)
        return out

    def _outcome(self, s: _Send, now: float):
        """False: not over yet; None: delivered; str: why it was not."""
        if s.dead:
            return s.dead if not s.cancel else False  # a cancel is confirmed first (tick)
        if s.attached and s.added:
            st = self.tx.stats(s.tid)
            if st["errors"]:
                return f"transfer failed: {st['errors'][0]}"
            if not st["flagged"]:
                return False
            if len(s.decoders) >= s.fanin:
                return None
            # every decoder so far has its KV; others (TP ranks) are still to grant, within the lease
        if s.released:
            return None
        if now - s.t_finished > self.config.lease_s:
            return f"expired: no grant (push) or read (pull) from a decoder within the lease ({self.config.lease_s:g} s)"
        return False

    def _end(self, s: _Send, why: Optional[str], now: float) -> None:
        st = self.tx.stats(s.tid) if s.added else None
        if st is not None:
            busy = kv.union_seconds(st["intervals"])
            hidden = kv.union_seconds([(a, min(b, s.t_computed)) for a, b in st["intervals"] if a < s.t_computed]) \
                if s.t_computed else 0.0
            kinds: Dict[str, int] = {}
            for grp, n in zip(self.groups.items, st["group_bytes"]):
                kinds[grp.spec.kind] = kinds.get(grp.spec.kind, 0) + n
            self.stats.sent(st["bytes"], st["descriptors"], st["transfers"], busy, busy - hidden,
                            ok=why is None, by_kind=kinds)
        if why is not None:
            if "expired" in why:
                self.stats.expired()
            told = [] if s.aborted_sent else [d for d in s.decoders + [g.decode for g in s.grants]
                                              if d != s.cancelled_by]
            s.aborted_sent = True
            for decode in told:
                self.links.post(decode, "abort", s.tid, why)
            _log.info("hixl.vllm: transfer %s (request %s) ended without delivery: %s", s.tid, s.rid, why)
        if s.added:
            try:
                self.tx.release(s.tid, timeout=0)
            except kv.KVError as e:
                _log.info("hixl.vllm: releasing %s: %s", s.rid, e)

    def close(self) -> None:
        self.tx.close()
