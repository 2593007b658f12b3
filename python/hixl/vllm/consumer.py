"""The decode part of the worker: receive a request's prompt KV into the blocks vLLM allocated for it.

push: a slot over those blocks (:meth:`hixl.kv.KVReceiver.expect`) is granted to the prefill over the
hixl link (the jobs thread connects and sends it); the prefill writes into the blocks and its last
write carries the slot's ticket as the completion flag, which :meth:`Consumer.finished` (vLLM's
``get_finished``, once per step) takes with a non-blocking poll. pull: the prefill's blocks are READ
(:meth:`hixl.kv.KVReceiver.pull`) once vLLM allocated ours.

Failures end the request through vLLM (``failed_recving``: ``kv_load_failure_policy`` decides between
an error and recomputing): the link to the prefill closed (it died), the prefill aborted (its request
failed, was aborted, or expired), or the request's time ran out. On a time-out the prefill is asked to
cancel and must confirm that none of its writes can land any more; if it does not within
``cancel_grace_s`` the link to it is closed, so that no late write reaches blocks vLLM reuses.
"""
from __future__ import annotations

import json
import logging
import select
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from .. import kv
from ..engine import Hixl
from ..kv.heads import head_fanin, head_range, head_sources
from .config import ConnectorConfig
from .links import Links
from .metadata import HixlConnectorMetadata, LoadSpec
from .peers import PeerBook
from .stats import Recorder

_log = logging.getLogger("hixl.vllm")


class _Part:
    """What one prefill TP rank sends a load: heads ``want`` (None: whole blocks) into slot ``slot``."""
    __slots__ = ("q", "peer", "want", "slot", "grant", "done", "ended", "fanin")

    def __init__(self, q: int, peer: str, want: Optional[Tuple[int, int]], slot: str, fanin: int):
        self.q, self.peer, self.want, self.slot, self.fanin = q, peer, want, slot, fanin
        self.grant: Optional[kv.Grant] = None
        self.done = False   # its KV landed
        self.ended = False  # it failed: nothing more of it can land (its read ended, its prefill aborted)


class _Load:
    __slots__ = ("rid", "spec", "parts", "idle", "remote_tp", "t_start", "deadline", "linked", "state", "why",
                 "cancel_deadline", "ended_by_vllm", "job", "confirms", "awaiting")

    def __init__(self, rid: str, spec: LoadSpec, timeout_s: float):
        self.rid, self.spec = rid, spec
        self.parts: List[_Part] = []
        self.idle: List[str] = []    # prefill ranks no decoder rank reads: told to let go at once
        self.remote_tp = 1
        self.confirms = 0            # cancels confirmed by the prefill ranks
        self.awaiting = 0            # confirmations a cancel waits for (0: one per part not done)
        self.t_start = time.monotonic()
        self.deadline = self.t_start + timeout_s
        self.linked = False          # the grant reached the prefill / the read was posted
        self.state = "waiting"       # waiting -> (cancelling | draining) -> over
        self.why: Optional[str] = None
        self.cancel_deadline = 0.0
        self.ended_by_vllm = False   # vLLM finished (aborted) the request while it waited
        self.job = "pending"         # the jobs thread's grant/read: pending -> running -> done | failed

    @property
    def peers(self) -> List[str]:
        return [p.peer for p in self.parts]


class Consumer:
    """Receives the KV of the requests vLLM loads here into the blocks it allocated for them: ``engine``
    and ``pool`` (vLLM's KV cache, registered) take the prefill's writes or do the reads, ``links``
    carry grants and cancels to the prefill (on its jobs thread) and say whether it is still linked,
    ``stats`` records each load's end; ``interior`` (the KV blocks' interior) goes with each grant.

    Tensor parallelism: ``tp`` is ``(rank, size, total KV heads)`` and ``heads`` the KV heads our blocks
    hold. A load from a prefill with the same TP comes whole from the prefill rank of our rank; from
    one with another TP, each prefill rank holding some of our heads sends (push) or gives (pull)
    those heads into their place in our blocks, into a slot of its own (its own completion flag), and
    the load completes when every part did. ``peers`` learns a prefill's memory map for a pull."""

    def __init__(self, engine: Hixl, pool: kv.KVPool, layout: kv.KVLayout, config: ConnectorConfig,
                 stats: Recorder, links: Links, interior: str, heads: Optional[kv.HeadSlice] = None,
                 tp: Tuple[int, int, int] = (0, 1, 0), peers: Optional[PeerBook] = None):
        self.engine, self.pool, self.layout, self.config = engine, pool, layout, config
        self.stats, self.links, self.interior = stats, links, interior
        self.rank, self.tp, self.total_heads = tp[0], tp[1], tp[2] or layout.n_kv_heads * tp[1]
        self.peers = peers if peers is not None else PeerBook(links, engine.local_engine,
                                                              config.connect_timeout_ms / 1000.0)
        self.rx = kv.KVReceiver(engine, layout, pool=pool, heads=heads)
        self._lock = threading.Lock()
        self._loads: Dict[str, _Load] = {}
        self._by_tid: Dict[str, _Load] = {}
        self._by_slot: Dict[str, Tuple[_Load, _Part]] = {}
        self._events: Dict[str, Tuple[str, str]] = {}  # tid -> (cancelled | abort, message), from the inbox
        self._job_failures: Dict[str, str] = {}        # rid -> why, from the jobs thread

    # -- new loads (forward thread, before the forward pass) -----------------------------------
    def start(self, meta: HixlConnectorMetadata) -> None:
        for tid, peers in meta.cancels.items():  # a prefill engine, or (TP) a list of them
            for peer in [peers] if isinstance(peers, str) else peers:
                self.links.post(peer, "cancel", tid, json.dumps({"decode": self.engine.local_engine,
                                                                 "why": "the decoder holds the whole prompt already"}))
        for rid, spec in meta.loads.items():
            load = _Load(rid, spec, self.config.timeout_s)
            with self._lock:
                self._loads[rid] = load
                if spec.transfer_id in self._by_tid:
                    self._job_failures[rid] = f"transfer id {spec.transfer_id} is already in use"
                    continue
                self._by_tid[spec.transfer_id] = load
            if spec.transfer_id == "invalid" or not spec.peer:
                self._job_failures[rid] = "kv_transfer_params lack a valid transfer_id or remote_engine"
                continue
            try:
                self._expect(load)
            except (kv.KVError, ValueError) as e:
                self._drop_slots(load)
                with self._lock:
                    self._job_failures[rid] = f"cannot receive into blocks {spec.blocks}: {e}"
                continue
            self.links.submit(lambda load=load: self._grant_or_pull(load))

    def _plan(self, load: _Load) -> List[Tuple[int, str, Optional[Tuple[int, int]]]]:
        """``(prefill rank, its engine, heads wanted or None for whole blocks)`` per part of the load."""
        spec = load.spec
        peers = list(getattr(spec, "peers", None) or [spec.peer])
        load.remote_tp = remote_tp = int(getattr(spec, "remote_tp", None) or len(peers))
        if len(peers) != remote_tp:
            raise ValueError(f"the prefill has TP {remote_tp} but {len(peers)} engines are named ({peers})")
        if remote_tp == self.tp:  # the same sharding: whole blocks from the rank of ours
            return [(self.rank, peers[self.rank], None)]
        if self.rx.heads is None:
            raise ValueError(f"the prefill has TP {remote_tp}, this decoder TP {self.tp}, and its KV heads are "
                             f"unknown: no head-sliced transfer")
        lo, hi = head_range(self.rank, self.tp, self.total_heads)
        if self.rank == 0:  # prefill ranks holding only replicas nobody reads: the lowest rank frees them
            load.idle = [peers[q] for q in range(remote_tp) if not head_fanin(q, remote_tp, self.tp, self.total_heads)]
        return [(q, peers[q], (a, b))
                for q, a, b in head_sources(lo, hi, remote_tp, self.total_heads, prefer=self.rank)]

    def _expect(self, load: _Load) -> None:
        spec = load.spec
        plan = self._plan(load)
        for q, peer, want in plan:
            slot = spec.transfer_id if want is None else f"{spec.transfer_id}.p{q}"
            fanin = 1 if want is None else head_fanin(q, load.remote_tp, self.tp, self.total_heads)
            part = _Part(q, peer, want, slot, fanin)
            part.grant = self.rx.expect(slot, spec.blocks, spec.n_tokens, first_block=spec.first_block,
                                        prefill=peer, want=want)
            load.parts.append(part)
            with self._lock:
                self._by_slot[slot] = (load, part)

    def _drop_slots(self, load: _Load) -> None:
        for part in load.parts:
            with self._lock:
                self._by_slot.pop(part.slot, None)
            try:
                self.rx.free(part.slot)  # its ticket is retired: a late flag is ignored
            except kv.KVError:
                pass  # a failed read freed it already

    def _grant_or_pull(self, load: _Load) -> None:
        """Jobs thread: connect to each prefill rank of the load, then send the grant (push) or post
        the read (pull)."""
        spec = load.spec
        with self._lock:
            if load.job != "pending":  # the load ended before its turn came
                return
            load.job = "running"
        part = None
        try:
            for part in load.parts:
                if spec.mode == "push":
                    payload = json.dumps({"grant": part.grant.to_dict(), "interior": self.interior,
                                          "fanin": part.fanin}, separators=(",", ":"))
                    self.links.send(part.peer, "grant", spec.transfer_id, payload)
                else:
                    self._pull(load, part)
            for peer in load.idle:
                self.links.send(peer, "release", spec.transfer_id, "none of its heads is needed")
            with self._lock:
                load.linked, load.job = True, "done"
        except (ConnectionError, kv.KVError, ValueError, KeyError, TypeError) as e:
            if spec.mode == "pull" and part is not None:
                self.peers.forget(part.peer)  # what we knew of it may be stale: ask again next time
            with self._lock:
                load.linked = load.linked or part is not load.parts[0]  # an earlier part went out
                load.job = "failed"
                self._job_failures[load.rid] = f"{'grant to' if spec.mode == 'push' else 'read from'} the prefill " \
                                               f"{part.peer if part else spec.peer} failed: {e}"

    def _pull(self, load: _Load, part: _Part) -> None:
        """Jobs thread: READ the part's heads (or whole blocks) from its prefill rank, whose memory map
        comes with the request (older prefills) or from its description (learned once per peer)."""
        spec = load.spec
        src = spec.source or {}
        heads: Optional[Dict[str, Any]] = None
        if "remote_memory" in src and load.remote_tp == 1:  # a prefill that sends its memory map along
            layout, memory = src.get("remote_layout"), src["remote_memory"]
        else:
            d = self.peers.get(part.peer)
            layout, memory = d["layout"], d["memory"]
            if (d["rank"], d["tp"]) != (part.q, load.remote_tp):
                self.peers.forget(part.peer)
                raise kv.KVError(f"the prefill engine {part.peer} is rank {d['rank']} of TP {d['tp']}, the request "
                                 f"names it rank {part.q} of TP {load.remote_tp}")
            if d["interior"].split("(")[0] != self.interior.split("(")[0]:
                raise kv.KVError(f"the prefill's KV blocks are {d['interior']}, ours {self.interior}")
            if part.want is not None:
                heads = {"slice": d["heads"], "want": list(part.want)}
        if heads is None and layout != dict(vars(self.layout)):
            raise kv.KVError(f"the prefill's KV layout {layout} is not ours {dict(vars(self.layout))}")
        offer = kv.Grant(request_id=part.slot, decode=part.peer, ticket=0, blocks=tuple(src["remote_blocks"]),
                         n_tokens=spec.n_tokens, layers=(0, self.layout.n_layers), pool_addr=0,
                         num_blocks=int(memory["num_blocks"]), aux_addr=0, aux_bytes=0, layout=layout, memory=memory,
                         heads=heads)
        self.links.ensure_link(part.peer)
        self.rx.pull(part.slot, offer, timeout_ms=int(self.config.timeout_s * 1000))

    # -- messages from the prefill (inbox thread) ------------------------------------------------
    def on_peer_message(self, kind: str, tid: str, msg: str) -> None:
        with self._lock:
            load = self._by_tid.get(tid)
            if load is None:
                return
            if kind == "cancelled":
                load.confirms += 1
                if load.confirms < (load.awaiting or len([p for p in load.parts if not p.done])):
                    return  # other prefill ranks are still to confirm
            self._events[tid] = (kind, msg)

    # -- once per step (forward thread, get_finished) ----------------------------------------------
    def finished(self, finished_req_ids: set, idle: bool) -> Tuple[Set[str], Set[str]]:
        """(requests whose load ended, those of them that failed)."""
        if not self._loads:
            return set(), set()
        now = time.monotonic()
        with self._lock:
            loads = list(self._loads.values())
            for rid in finished_req_ids:
                load = self._loads.get(rid)
                if load is not None:
                    load.ended_by_vllm = True
        # which prefills are gone: checked before taking the flags, so a flag that came before its link
        # closed is not missed
        peers = {p for load in loads if load.linked and load.state != "over" for p in load.peers}
        down = {p for p in peers if not self.links.linked(p)}
        done = self.rx.poll()
        if not done and idle and self.config.idle_wait_ms > 0 and any(load.state != "over" for load in loads):
            # nothing to compute this step: wait for a flag (blocking, GIL released) instead of
            # letting vLLM step again 1 ms from now
            select.select([self.rx.fileno()], [], [], self.config.idle_wait_ms / 1000.0)
            done = self.rx.poll()
        ok, bad = self._outcomes(done, self.rx.take_failed())
        grace = self.config.cancel_grace_s
        for load in loads:
            if load.state == "over" or load.rid in ok or load.rid in bad:
                continue
            gone = [p for p in load.peers if p in down]
            if load.linked and gone:
                bad[load.rid] = f"the link to the prefill {gone[0]} closed"
            elif load.state == "waiting":
                if load.job == "running":
                    continue  # its grant or read is being posted: decide next step
                if load.spec.mode == "pull" and load.linked:
                    # the read is ours: the engine ends it at its own deadline (timeout_s), the link is
                    # closed only when that did not happen
                    if now > load.deadline + grace:
                        self._close_link(load, loads, ok, bad, f"read not complete within {self.config.timeout_s:g} s")
                    continue
                if now > load.deadline or load.ended_by_vllm:
                    load.why = ("aborted while waiting for its KV" if load.ended_by_vllm else
                                f"KV not complete within {self.config.timeout_s:g} s")
                    with self._lock:
                        posted = load.job == "done"
                        if load.job == "pending":
                            load.job = "failed"  # the jobs thread will not send it
                    if posted:
                        self._cancel(load, now)
                    else:
                        bad[load.rid] = load.why  # no grant went out: nothing can land
            elif load.state == "cancelling" and now > load.cancel_deadline:
                self._close_link(load, loads, ok, bad, load.why or "cancelled")
            elif load.state == "draining" and now > load.deadline + grace:
                self._close_link(load, loads, ok, bad, load.why or "a part failed")
        self._hold_back_failed_parts(bad, down, now)
        return self._end(ok, bad, now)

    def _hold_back_failed_parts(self, bad: Dict[str, str], down: Set[str], now: float) -> None:
        """A load of several parts (prefill TP ranks) that failed in one part ends only once none of the
        others can still land: push: each live part is cancelled and confirmed (else its link is closed
        after ``cancel_grace_s``); pull: our own reads of the others end (at their deadline at most)."""
        for rid, why in list(bad.items()):
            load = self._loads.get(rid)
            if load is None or len(load.parts) < 2 or load.state == "cancelling" or load.ended_by_vllm:
                continue
            live = [p for p in load.parts if not p.done and not p.ended and p.peer not in down
                    and self.links.linked(p.peer)]
            if not live or not load.linked:
                continue
            del bad[rid]
            load.why = load.why or why
            if load.spec.mode == "push":
                self._cancel(load, now, live)
            elif load.state != "draining":
                load.state = "draining"
                _log.warning("hixl.vllm: request %s (transfer %s): %s; waiting for its reads from %s to end",
                             rid, load.spec.transfer_id, why, ", ".join(p.peer for p in live))

    def _outcomes(self, done: List[str], failed_slots: Dict[str, str]) -> Tuple[Set[str], Dict[str, str]]:
        """The loads every part of which landed, and those that failed (a part's read, the jobs
        thread, or the prefill's abort or cancel confirmation)."""
        ok: Set[str] = set()
        bad: Dict[str, str] = {}
        with self._lock:
            events, self._events = self._events, {}
            job_failures, self._job_failures = self._job_failures, {}
            for slot in done:
                hit = self._by_slot.get(slot)
                if hit is not None and hit[0].state != "over":
                    hit[1].done = True
                    if all(p.done for p in hit[0].parts):
                        ok.add(hit[0].rid)
                    elif hit[0].state == "draining":
                        bad[hit[0].rid] = hit[0].why or "a part failed"  # ends once no read is live
            for slot, why in failed_slots.items():
                hit = self._by_slot.get(slot)
                if hit is not None:
                    hit[1].ended = True
                    bad[hit[0].rid] = hit[0].why or why
                    if hit[0].spec.mode == "pull":
                        self.peers.forget(hit[1].peer)  # its memory map may be stale: ask again next time
        bad.update(job_failures)
        for tid, (kind, msg) in events.items():
            load = self._by_tid.get(tid)
            if load is None or load.rid in ok:
                continue
            if kind == "abort":
                bad[load.rid] = f"the prefill {load.spec.peer} aborted the transfer: {msg}"
            elif load.state == "cancelling":
                bad[load.rid] = load.why or "cancelled"
        return ok, bad

    def _close_link(self, load: _Load, loads: list, ok: Set[str], bad: Dict[str, str], why: str) -> None:
        """The prefill did not confirm in time that it stopped: close the links to its ranks, so that
        none of their writes can land in blocks vLLM is about to reuse; every load from them fails."""
        for peer in load.peers:
            _log.warning("hixl.vllm: the prefill %s did not confirm the end of transfer %s (%s) within %g s: "
                         "closing the link to it (every transfer in flight from it fails)", peer,
                         load.spec.transfer_id, why, self.config.cancel_grace_s)
            self.links.disconnect(peer)
            for other in loads:
                if peer in other.peers and other.state != "over" and other.rid not in ok:
                    bad[other.rid] = other.why or f"the link to the prefill {peer} was closed ({why})"

    def _cancel(self, load: _Load, now: float, parts: Optional[List[_Part]] = None) -> None:
        """Tells the parts not landed (or ``parts``) to stop; the load ends once each confirmed, or
        its links are closed after ``cancel_grace_s``."""
        parts = [p for p in load.parts if not p.done] if parts is None else parts
        load.state, load.cancel_deadline = "cancelling", now + self.config.cancel_grace_s
        load.awaiting, load.confirms = len(parts), 0
        _log.warning("hixl.vllm: request %s (transfer %s from %s): %s; cancelling", load.rid,
                     load.spec.transfer_id, ", ".join(p.peer for p in parts), load.why)
        for part in parts:
            self.links.post(part.peer, "cancel", load.spec.transfer_id,
                            json.dumps({"decode": self.engine.local_engine, "why": load.why}))

    def _end(self, ok: Set[str], bad: Dict[str, str], now: float) -> Tuple[Set[str], Set[str]]:
        failed: Set[str] = set()
        for rid in ok | set(bad):
            load = self._loads.pop(rid, None)
            if load is None:
                continue
            if self._by_tid.get(load.spec.transfer_id) is load:
                del self._by_tid[load.spec.transfer_id]
            cancelled, load.state = load.state == "cancelling", "over"
            self._drop_slots(load)
            n_blocks = len(load.spec.blocks)
            if rid in ok:
                tokens = load.spec.n_tokens - load.spec.first_block * self.layout.block_tokens
                self.stats.received(tokens, n_blocks * self.layout.n_layers * self.pool.memory.unit_bytes *
                                    self.pool.memory.parts, now - load.t_start, load.spec.mode)
                if load.spec.mode == "pull":
                    for peer in load.peers:
                        self.links.post(peer, "release", load.spec.transfer_id, "ok")
                continue
            why = bad[rid]
            if len(load.parts) > 1 and not cancelled:  # the other ranks' parts stop too
                for part in load.parts:
                    if not part.done:
                        self.links.post(part.peer, "cancel", load.spec.transfer_id,
                                        json.dumps({"decode": self.engine.local_engine, "why": why}))
            if load.ended_by_vllm:  # vLLM finished it already: it only waited for its blocks
                _log.info("hixl.vllm: request %s (transfer %s from %s) was aborted while waiting for its KV; its "
                          "blocks are free (%s)", rid, load.spec.transfer_id, load.spec.peer, why)
                continue
            failed.add(rid)
            self.stats.failed("recv", timeout="within" in why)
            _log.warning("hixl.vllm: request %s (transfer %s from %s) failed to load its KV: %s", rid,
                         load.spec.transfer_id, ", ".join(load.peers) or load.spec.peer, why)
        return ok | set(bad), failed
