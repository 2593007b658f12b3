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
from typing import Dict, Optional, Set, Tuple

from .. import kv
from ..engine import Hixl
from .config import ConnectorConfig
from .links import Links
from .metadata import HixlConnectorMetadata, LoadSpec
from .stats import Recorder

_log = logging.getLogger("hixl.vllm")


class _Load:
    __slots__ = ("rid", "spec", "grant", "t_start", "deadline", "linked", "state", "why", "cancel_deadline",
                 "ended_by_vllm", "job")

    def __init__(self, rid: str, spec: LoadSpec, timeout_s: float):
        self.rid, self.spec = rid, spec
        self.grant: Optional[kv.Grant] = None
        self.t_start = time.monotonic()
        self.deadline = self.t_start + timeout_s
        self.linked = False          # the grant reached the prefill / the read was posted
        self.state = "waiting"       # waiting -> cancelling -> over
        self.why: Optional[str] = None
        self.cancel_deadline = 0.0
        self.ended_by_vllm = False   # vLLM finished (aborted) the request while it waited
        self.job = "pending"         # the jobs thread's grant/read: pending -> running -> done | failed


class Consumer:
    """Receives the KV of the requests vLLM loads here into the blocks it allocated for them: ``engine``
    and ``pool`` (vLLM's KV cache, registered) take the prefill's writes or do the reads, ``links``
    carry grants and cancels to the prefill (on its jobs thread) and say whether it is still linked,
    ``stats`` records each load's end; ``interior`` (the KV blocks' interior) goes with each grant."""

    def __init__(self, engine: Hixl, pool: kv.KVPool, layout: kv.KVLayout, config: ConnectorConfig,
                 stats: Recorder, links: Links, interior: str):
        self.engine, self.pool, self.layout, self.config = engine, pool, layout, config
        self.stats, self.links, self.interior = stats, links, interior
        self.rx = kv.KVReceiver(engine, layout, pool=pool)
        self._lock = threading.Lock()
        self._loads: Dict[str, _Load] = {}
        self._by_tid: Dict[str, _Load] = {}
        self._events: Dict[str, Tuple[str, str]] = {}  # tid -> (cancelled | abort, message), from the inbox
        self._job_failures: Dict[str, str] = {}        # rid -> why, from the jobs thread

    # -- new loads (forward thread, before the forward pass) -----------------------------------
    def start(self, meta: HixlConnectorMetadata) -> None:
        for tid, peer in meta.cancels.items():
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
                load.grant = self.rx.expect(spec.transfer_id, spec.blocks, spec.n_tokens, first_block=spec.first_block,
                                            prefill=spec.peer)
            except (kv.KVError, ValueError) as e:
                with self._lock:
                    self._job_failures[rid] = f"cannot receive into blocks {spec.blocks}: {e}"
                continue
            self.links.submit(lambda load=load: self._grant_or_pull(load))

    def _grant_or_pull(self, load: _Load) -> None:
        """Jobs thread: connect to the prefill, then send the grant (push) or post the read (pull)."""
        spec = load.spec
        with self._lock:
            if load.job != "pending":  # the load ended before its turn came
                return
            load.job = "running"
        try:
            if spec.mode == "push":
                payload = json.dumps({"grant": load.grant.to_dict(), "interior": self.interior},
                                     separators=(",", ":"))
                self.links.send(spec.peer, "grant", spec.transfer_id, payload)
            else:
                src = spec.source or {}
                layout = src.get("remote_layout")
                if layout != dict(vars(self.layout)):
                    raise kv.KVError(f"the prefill's KV layout {layout} is not ours {dict(vars(self.layout))}")
                offer = kv.Grant(request_id=load.rid, decode=spec.peer, ticket=0, blocks=tuple(src["remote_blocks"]),
                                 n_tokens=spec.n_tokens, layers=(0, self.layout.n_layers), pool_addr=0,
                                 num_blocks=int(src["remote_memory"]["num_blocks"]), aux_addr=0, aux_bytes=0,
                                 layout=layout, memory=src["remote_memory"])
                self.links.ensure_link(spec.peer)
                self.rx.pull(spec.transfer_id, offer, timeout_ms=int(self.config.timeout_s * 1000))
            with self._lock:
                load.linked, load.job = True, "done"
        except (ConnectionError, kv.KVError, ValueError, KeyError, TypeError) as e:
            with self._lock:
                load.job = "failed"
                self._job_failures[load.rid] = f"{'grant to' if spec.mode == 'push' else 'read from'} the prefill " \
                                               f"{spec.peer} failed: {e}"

    # -- messages from the prefill (inbox thread) ------------------------------------------------
    def on_peer_message(self, kind: str, tid: str, msg: str) -> None:
        with self._lock:
            if tid in self._by_tid:
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
        peers = {load.spec.peer for load in loads if load.linked and load.state != "over"}
        down = {p for p in peers if not self.links.linked(p)}
        done = self.rx.poll()
        if not done and idle and self.config.idle_wait_ms > 0 and any(load.state != "over" for load in loads):
            # nothing to compute this step: wait for a flag (blocking, GIL released) instead of
            # letting vLLM step again 1 ms from now
            select.select([self.rx.fileno()], [], [], self.config.idle_wait_ms / 1000.0)
            done = self.rx.poll()
        failed_pulls = self.rx.take_failed()
        ok: Set[str] = set()
        bad: Dict[str, str] = {}
        with self._lock:
            events, self._events = self._events, {}
            job_failures, self._job_failures = self._job_failures, {}
        for tid in done:
            load = self._by_tid.get(tid)
            if load is not None and load.state != "over":
                ok.add(load.rid)
        for tid, why in failed_pulls.items():
            load = self._by_tid.get(tid)
            if load is not None:
                bad[load.rid] = why
        bad.update(job_failures)
        for tid, (kind, msg) in events.items():
            load = self._by_tid.get(tid)
            if load is None or load.rid in ok:
                continue
            if kind == "abort":
                bad[load.rid] = f"the prefill {load.spec.peer} aborted the transfer: {msg}"
            elif load.state == "cancelling":
                bad[load.rid] = load.why or "cancelled"
        grace = self.config.cancel_grace_s
        for load in loads:
            if load.state == "over" or load.rid in ok or load.rid in bad:
                continue
            if load.linked and load.spec.peer in down:
                bad[load.rid] = f"the link to the prefill {load.spec.peer} closed"
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
        return self._end(ok, bad, now)

    def _close_link(self, load: _Load, loads: list, ok: Set[str], bad: Dict[str, str], why: str) -> None:
        """The prefill did not confirm in time that it stopped: close the link to it, so that none of its
        writes can land in blocks vLLM is about to reuse; every load from it fails."""
        peer = load.spec.peer
        _log.warning("hixl.vllm: the prefill %s did not confirm the end of transfer %s (%s) within %g s: closing "
                     "the link to it (every transfer in flight from it fails)", peer, load.spec.transfer_id, why,
                     self.config.cancel_grace_s)
        self.links.disconnect(peer)
        for other in loads:
            if other.spec.peer == peer and other.state != "over" and other.rid not in ok:
                bad[other.rid] = other.why or f"the link to the prefill {peer} was closed ({why})"

    def _cancel(self, load: _Load, now: float) -> None:
        load.state, load.cancel_deadline = "cancelling", now + self.config.cancel_grace_s
        _log.warning("hixl.vllm: request %s (transfer %s from %s): %s; cancelling", load.rid,
                     load.spec.transfer_id, load.spec.peer, load.why)
        self.links.post(load.spec.peer, "cancel", load.spec.transfer_id,
                        json.dumps({"decode": self.engine.local_engine, "why": load.why}))

    def _end(self, ok: Set[str], bad: Dict[str, str], now: float) -> Tuple[Set[str], Set[str]]:
        failed: Set[str] = set()
        for rid in ok | set(bad):
            load = self._loads.pop(rid, None)
            if load is None:
                continue
            if self._by_tid.get(load.spec.transfer_id) is load:
                del self._by_tid[load.spec.transfer_id]
            load.state = "over"
            n_blocks = len(load.spec.blocks)
            if rid in ok:
                tokens = load.spec.n_tokens - load.spec.first_block * self.layout.block_tokens
                self.stats.received(tokens, n_blocks * self.layout.n_layers * self.pool.memory.unit_bytes *
                                    self.pool.memory.parts, now - load.t_start, load.spec.mode)
                try:
                    self.rx.free(load.spec.transfer_id)
                except kv.KVError:
                    pass
                if load.spec.mode == "pull":
                    self.links.post(load.spec.peer, "release", load.spec.transfer_id, "ok")
                continue
            why = bad[rid]
            try:
                self.rx.free(load.spec.transfer_id)  # its ticket is retired: a late flag is ignored
            except kv.KVError:
                pass  # a failed read freed it already
            if load.ended_by_vllm:  # vLLM finished it already: it only waited for its blocks
                _log.info("hixl.vllm: request %s (transfer %s from %s) was aborted while waiting for its KV; its "
                          "blocks are free (%s)", rid, load.spec.transfer_id, load.spec.peer, why)
                continue
            failed.add(rid)
            self.stats.failed("recv", timeout="within" in why)
            _log.warning("hixl.vllm: request %s (transfer %s from %s) failed to load its KV: %s", rid,
                         load.spec.transfer_id, load.spec.peer, why)
        return ok | set(bad), failed
