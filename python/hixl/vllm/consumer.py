"""The decode part of the worker: receive a request's prompt KV into the blocks vLLM allocated for it.

push: a slot over those blocks (:meth:`hixl.kv.KVReceiver.expect`) is granted to the prefill over the
hixl link (the jobs thread connects and sends it); the prefill writes into the blocks and its last
write carries the slot's ticket as the completion flag, which :meth:`Consumer.finished` (vLLM's
``get_finished``, once per step) takes with a non-blocking poll. pull: the prefill's blocks are READ
(:meth:`hixl.kv.KVReceiver.pull`) once vLLM allocated ours.

Several KV cache groups (vLLM's hybrid cache) move in one slot per part, with one flag: each group's
blocks that the load wants (a sliding window's, a Mamba group's state block; ``None`` for the rest).

Tensor parallelism and the MLA latent: :mod:`hixl.vllm.plan` says which peer sends what. A latent that is
all the model moves crosses the network once: decoder rank 0 takes it from the prefill, and the other ranks
(*relays*) read it from rank 0 once rank 0 says it landed (a ``relay`` message), on the host.

Failures end the request through vLLM (``failed_recving``: ``kv_load_failure_policy`` decides between
an error and recomputing): the link to the prefill closed (it died), the prefill aborted (its request
failed, was aborted, or expired), or the request's time ran out. On a time-out the prefill is asked to
cancel and must confirm that none of its writes can land any more; if it does not within
``cancel_grace_s`` the link to it is closed, so that no late write reaches blocks vLLM reuses. Our own
reads (pull, relays) end at their deadline.
"""
from __future__ import annotations

import json
import logging
import select
import threading
import time
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Set, Tuple

from .. import kv
from ..engine import Hixl
from . import plan
from .cache import CacheGroups
from .config import ConnectorConfig
from .links import Links
from .metadata import HixlConnectorMetadata, LoadSpec, per_group
from .peers import PeerBook
from .stats import Recorder

_MAX_EARLY = 4096  # relay messages kept for loads that did not start here yet

_log = logging.getLogger("hixl.vllm")


class _Part:
    """What one peer sends a load: rank ``q`` of the prefill (or, ``sibling``, of this decoder: a relay),
    per group ``wants`` (None: whole blocks, ``(a, b)``: those KV heads, False: nothing), into slot ``slot``."""
    __slots__ = ("q", "peer", "wants", "slot", "grant", "done", "ended", "fanin", "sibling")

    def __init__(self, q: int, peer: str, wants: Tuple, slot: str, fanin: int, sibling: bool = False):
        self.q, self.peer, self.wants, self.slot, self.fanin, self.sibling = q, peer, wants, slot, fanin, sibling
        self.grant: Optional[kv.Grant] = None
        self.done = False   # its KV landed
        self.ended = False  # it failed: nothing more of it can land (its read ended, its prefill aborted)


class _Load:
    __slots__ = ("rid", "spec", "parts", "idle", "remote_tp", "t_start", "deadline", "linked", "state", "why",
                 "cancel_deadline", "ended_by_vllm", "job", "confirms", "awaiting", "blocks", "relay_to", "relay")

    def __init__(self, rid: str, spec: LoadSpec, timeout_s: float):
        self.rid, self.spec = rid, spec
        self.blocks = spec.group_blocks()  # ours, per group
        self.parts: List[_Part] = []
        self.idle: List[str] = []    # prefill ranks no decoder rank reads: told to let go at once
        self.relay_to: List[str] = []  # decoder ranks that copy this load from us once it landed
        self.relay = False           # a relay: every part is read from a rank of this decoder
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
        # (a relay: pending -> linked (waiting for the relay message) -> running -> done | failed)

    @property
    def peers(self) -> List[str]:
        return [p.peer for p in self.parts]

    @property
    def reads(self) -> bool:
        """Its KV comes by our own reads (pull, a relay), which end at their deadline."""
        return self.spec.mode == "pull" or self.relay


class Consumer:
    """Receives the KV of the requests vLLM loads here into the blocks it allocated for them: ``engine``
    and ``pool`` (vLLM's KV cache, registered) take the prefill's writes or do the reads, ``links``
    carry grants and cancels to the prefill (on its jobs thread) and say whether it is still linked,
    ``stats`` records each load's end; ``groups`` (:class:`~hixl.vllm.cache.CacheGroups`) are the KV
    cache groups, whose description goes with each grant.

    Tensor parallelism: ``tp`` is ``(rank, size)``. A load from a prefill with the same TP comes whole
    from the prefill rank of our rank; from one with another TP, each prefill rank holding some of our
    heads sends (push) or gives (pull) those heads into their place in our blocks, into a slot of its own
    (its own completion flag), and the load completes when every part did. ``peers`` learns a prefill's
    (or a sibling rank's) memory map for a read."""

    def __init__(self, engine: Hixl, pool: kv.KVPool, groups: CacheGroups, config: ConnectorConfig,
                 stats: Recorder, links: Links, tp: Tuple[int, int] = (0, 1), peers: Optional[PeerBook] = None):
        self.engine, self.pool, self.groups, self.config = engine, pool, groups, config
        self.stats, self.links = stats, links
        self.rank, self.tp = tp[0], tp[1]
        self.peers = peers if peers is not None else PeerBook(links, engine.local_engine,
                                                              config.connect_timeout_ms / 1000.0)
        self.rx = kv.KVReceiver(engine, None, pool=pool, heads=groups.heads)
        self._lock = threading.Lock()
        self._loads: Dict[str, _Load] = {}
        self._by_tid: Dict[str, _Load] = {}
        self._by_slot: Dict[str, Tuple[_Load, _Part]] = {}
        self._events: Dict[str, Tuple[str, str]] = {}  # tid -> (cancelled | abort, message), from the inbox
        self._job_failures: Dict[str, str] = {}        # rid -> why, from the jobs thread
        self._early: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()  # tid -> a relay message before its load

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
                    self._job_failures[rid] = f"cannot receive into blocks {load.blocks}: {e}"
                continue
            self.links.submit(lambda load=load: self._grant_or_pull(load))

    def _plan(self, load: _Load) -> List[plan.Source]:
        """The parts of the load (:func:`hixl.vllm.plan.sources`)."""
        spec = load.spec
        peers = list(getattr(spec, "peers", None) or [spec.peer])
        load.remote_tp = remote_tp = int(getattr(spec, "remote_tp", None) or len(peers))
        if len(peers) != remote_tp:
            raise ValueError(f"the prefill has TP {remote_tp} but {len(peers)} engines are named ({peers})")
        g = self.groups
        parts = plan.sources(self.rank, self.tp, remote_tp, g.plans, g.relay)
        if self.rank == 0:  # prefill ranks holding only replicas nobody reads: the lowest rank frees them
            load.idle = [peers[q] for q in plan.idle_prefill_ranks(remote_tp, self.tp, g.plans, g.relay)]
        siblings = list(getattr(spec, "siblings", None) or [])
        mine = plan.relayed_to(self.rank, self.tp, remote_tp, g.plans, g.relay)
        if any(s.sibling for s in parts) or mine:
            if len(siblings) != self.tp:
                raise ValueError(f"a relay between the ranks of this decoder needs their {self.tp} engines, the "
                                 f"request names {siblings}")
            load.relay_to = [siblings[r] for r in mine]
        return parts

    def _expect(self, load: _Load) -> None:
        spec, blocks = load.spec, load.blocks
        if len(blocks) != len(self.groups):
            raise ValueError(f"{len(blocks)} block lists for {len(self.groups)} KV cache groups")
        srcs = self._plan(load)
        load.relay = all(src.sibling for src in srcs)
        peers = list(getattr(spec, "peers", None) or [spec.peer])
        for src in srcs:
            whole = len(srcs) == 1 and not src.sibling and all(w is None for w in src.wants)
            slot = spec.transfer_id if whole else f"{spec.transfer_id}.{'r' if src.sibling else 'p'}{src.rank}"
            peer = spec.siblings[src.rank] if src.sibling else peers[src.rank]
            fanin = 1 if whole or src.sibling else plan.fanin(src.rank, load.remote_tp, self.tp, self.groups.plans,
                                                              self.groups.relay)
            part = _Part(src.rank, peer, src.wants, slot, fanin, src.sibling)
            mine = [list(b) if w is not False else [None] * len(b) for b, w in zip(blocks, src.wants)]
            part.grant = self.rx.expect(slot, mine, spec.n_tokens, prefill=peer,
                                        want=[w if isinstance(w, tuple) else None for w in src.wants])
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
        the read (pull); a relay links to the rank it copies from (which tells it when to read)."""
        spec = load.spec
        with self._lock:
            if load.job != "pending":  # the load ended before its turn came
                return
            load.job = "running"
        part = None
        try:
            for part in load.parts:
                if part.sibling:
                    self.peers.get(part.peer)  # linked (the sibling's message comes over it) and described
                elif spec.mode == "push":
                    payload = json.dumps({"grant": part.grant.to_dict(), "groups": self._infos(),
                                          "fanin": part.fanin}, separators=(",", ":"))
                    self.links.send(part.peer, "grant", spec.transfer_id, payload)
                else:
                    self._pull(load, part)
            for peer in load.idle:
                self.links.send(peer, "release", spec.transfer_id, "none of its heads is needed")
            early = None
            with self._lock:
                if load.relay:
                    load.job = "linked"
                    early = self._early.pop(spec.transfer_id, None)
                else:
                    load.linked, load.job = True, "done"
            if early is not None:
                self._on_relay(load, early)
        except (ConnectionError, kv.KVError, ValueError, KeyError, TypeError) as e:
            if spec.mode == "pull" and part is not None:
                self.peers.forget(part.peer)  # what we knew of it may be stale: ask again next time
            with self._lock:
                load.linked = load.linked or (part is not load.parts[0] and not load.relay)  # an earlier part went out
                load.job = "failed"
                if part is not None and part.sibling:
                    why = f"the link to the decoder rank {part.peer} it copies from failed: {e}"
                else:
                    why = (f"{'grant to' if spec.mode == 'push' else 'read from'} the prefill "
                           f"{part.peer if part else spec.peer} failed: {e}")
                self._job_failures[load.rid] = why

    def _infos(self) -> List[Dict[str, Any]]:
        """What a grant says of our groups (the prefill checks it against its own)."""
        return [{k: d[k] for k in ("kind", "block_size", "window", "cache_dtype", "interior")}
                for d in self.groups.infos()]

    def _offer(self, load: _Load, part: _Part, d: Dict[str, Any], remote: List[List[Optional[int]]]) -> kv.Grant:
        """The peer's blocks as a pull source: per group ``remote`` (its block ids), its memory map and
        (head-sliced) its heads, from its description ``d``; nothing of the groups the part does not want."""
        if (d["rank"], d["tp"]) != (part.q, self.tp if part.sibling else load.remote_tp):
            self.peers.forget(part.peer)
            raise kv.KVError(f"the engine {part.peer} is rank {d['rank']} of TP {d['tp']}, the request names it rank "
                             f"{part.q} of TP {self.tp if part.sibling else load.remote_tp}")
        sliced = [isinstance(w, tuple) for w in part.wants]
        why = self.groups.mismatch(d["groups"], sliced)
        if why is not None:
            raise kv.KVError(f"the blocks of {part.peer} cannot be read into ours: {why}")
        if len(remote) != len(self.groups):
            raise kv.KVError(f"{len(remote)} block lists of {part.peer} for {len(self.groups)} KV cache groups")
        groups = []
        for k, (w, theirs) in enumerate(zip(part.wants, d["groups"])):
            heads = kv.HeadSlice.from_dict(theirs["heads"]) if isinstance(w, tuple) else None
            blocks = tuple(remote[k]) if w is not False else (None,) * len(remote[k])
            groups.append(kv.GroupGrant(blocks, theirs["layout"], kv.BlockMemory.from_dict(theirs["memory"]), heads,
                                        w if heads is not None else None).to_dict())
        return kv.Grant(request_id=part.slot, decode=part.peer, ticket=0, blocks=(), n_tokens=load.spec.n_tokens,
                        layers=(0, self.groups.kv.n_layers), pool_addr=0, num_blocks=0, aux_addr=0, aux_bytes=0,
                        groups=tuple(groups))

    def _pull(self, load: _Load, part: _Part) -> None:
        """Jobs thread: READ the part's groups and heads (or whole blocks) from its prefill rank, whose
        memory map comes from its description (learned once per peer)."""
        src = load.spec.source or {}
        offer = self._offer(load, part, self.peers.get(part.peer), per_group(src.get("remote_blocks") or []))
        self.links.ensure_link(part.peer)
        self.rx.pull(part.slot, offer, timeout_ms=int(self.config.timeout_s * 1000))

    # -- relays: a decoder rank's copy of what crossed the network once -------------------------
    def _on_relay(self, load: _Load, d: Dict[str, Any]) -> None:
        """The rank a relay copies from says its KV landed (read it now) or will not (the load fails)."""
        if not d.get("ok"):
            with self._lock:
                if load.job == "linked":
                    load.job = "failed"
                self._job_failures[load.rid] = f"the decoder rank it copies from failed: {d.get('why')}"
            return
        with self._lock:
            if load.job != "linked" or load.state != "waiting":
                return
            load.job = "running"
        self.links.submit(lambda: self._relay_read(load))

    def _relay_read(self, load: _Load) -> None:
        """Jobs thread: READ our blocks' twins (the same block ids: one scheduler) from the rank the
        relay copies from."""
        part = load.parts[0]
        try:
            offer = self._offer(load, part, self.peers.get(part.peer), load.blocks)
            self.links.ensure_link(part.peer)
            self.rx.pull(part.slot, offer, timeout_ms=int(self.config.timeout_s * 1000))
            with self._lock:
                load.linked, load.job = True, "done"
        except (ConnectionError, kv.KVError, ValueError, KeyError, TypeError) as e:
            self.peers.forget(part.peer)
            with self._lock:
                load.job = "failed"
                self._job_failures[load.rid] = f"the copy from the decoder rank {part.peer} failed: {e}"

    def _tell_relays(self, load: _Load, why: Optional[str]) -> None:
        """This load ended: the ranks that copy it from us hear whether to read (connecting if need be)."""
        msg = json.dumps({"ok": why is None, "why": why})
        for peer in load.relay_to:
            def job(peer: str = peer) -> None:
                try:
                    self.links.send(peer, "relay", load.spec.transfer_id, msg)
                except (ConnectionError, ValueError) as e:
                    _log.warning("hixl.vllm: the relay of %s to %s was not delivered (it fails at its time-out): %s",
                                 load.spec.transfer_id, peer, e)
            self.links.submit(job)

    # -- messages from the prefill (inbox thread) ------------------------------------------------
    def on_peer_message(self, kind: str, tid: str, msg: str) -> None:
        if kind == "relay":
            self._relay_message(tid, msg)
            return
        with self._lock:
            load = self._by_tid.get(tid)
            if load is None:
                return
            if kind == "cancelled":
                load.confirms += 1
                if load.confirms < (load.awaiting or len([p for p in load.parts if not p.done])):
                    return  # other prefill ranks are still to confirm
            self._events[tid] = (kind, msg)

    def _relay_message(self, tid: str, msg: str) -> None:
        try:
            d = json.loads(msg)
            if not isinstance(d, dict):
                raise ValueError("not an object")
        except ValueError as e:
            _log.warning("hixl.vllm: malformed relay message for %s: %r (%s)", tid, msg[:200], e)
            return
        with self._lock:
            load = self._by_tid.get(tid)
            if load is None or load.job in ("pending", "running"):  # its link is not up yet: kept for it
                self._early[tid] = d
                while len(self._early) > _MAX_EARLY:
                    self._early.popitem(last=False)
                return
        self._on_relay(load, d)

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
                bad[load.rid] = f"the link to the {'decoder rank' if load.relay else 'prefill'} {gone[0]} closed"
            elif load.state == "waiting":
                if load.job == "running":
                    continue  # its grant or read is being posted: decide next step
                if load.reads and load.linked:
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
                        if load.job in ("pending", "linked"):
                            load.job = "failed"  # the jobs thread will not send it (a relay: not read it)
                    if posted:
                        self._cancel(load, now)
                    else:
                        bad[load.rid] = load.why  # no grant or read went out: nothing can land
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
                    if hit[0].reads:
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
        """The peer did not confirm in time that it stopped (or our read of it did not end): close the
        links to it, so that none of its writes can land in blocks vLLM is about to reuse; every load
        from it fails."""
        for peer in load.peers:
            _log.warning("hixl.vllm: the peer %s did not confirm the end of transfer %s (%s) within %g s: "
                         "closing the link to it (every transfer in flight from it fails)", peer,
                         load.spec.transfer_id, why, self.config.cancel_grace_s)
            self.links.disconnect(peer)
            for other in loads:
                if peer in other.peers and other.state != "over" and other.rid not in ok:
                    bad[other.rid] = other.why or f"the link to {peer} was closed ({why})"

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
            if rid in ok:
                self._tell_relays(load, None)
                self.stats.received(load.spec.n_tokens - self._local_tokens(load), self.groups.unit_bytes(load.blocks, load.spec.n_tokens),
                                    now - load.t_start, "relay" if load.relay else load.spec.mode)
                if load.spec.mode == "pull" and not load.relay:
                    for peer in load.peers:
                        self.links.post(peer, "release", load.spec.transfer_id, "ok")
                continue
            why = bad[rid]
            self._tell_relays(load, why)
            if len(load.parts) > 1 and not cancelled:  # the other ranks' parts stop too
                for part in load.parts:
                    if not part.done and not part.sibling:
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

    def _local_tokens(self, load: _Load) -> int:
        """Prompt tokens the decoder held already (a prefix it computed)."""
        spec = load.spec
        if getattr(spec, "local_tokens", -1) >= 0:
            return spec.local_tokens
        return spec.first_block * self.groups.items[0].layout.block_tokens
