"""The worker side of :class:`hixl.vllm.HixlConnector` (runs in vLLM's worker process, beside the model).

It owns a hixl engine (listening on ``host:port``), registers vLLM's own KV cache tensors with it as
they are (:meth:`hixl.kv.KVPool.wrap_groups`, one group per KV cache group that moves: no staging pool,
no copy; :mod:`hixl.vllm.cache` describes them), and runs two small threads that
block (never spin): the *inbox* waits for notifies from peers (grants, cancels, releases, aborts) and
the *jobs* thread (:class:`~hixl.vllm.engine_links.EngineLinks`, the links to peers) does what may wait
on a peer (connect, send a notify, start a pull) so that the forward pass never waits on the network.
The prefill part is :class:`~hixl.vllm.producer.Producer`, the decode part
:class:`~hixl.vllm.consumer.Consumer`; an instance with ``kv_both`` has both. Each takes what it uses
(engine, pool, groups, config, stats, links) from the worker, and never the worker itself.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

from .. import kv
from ..engine import Hixl
from ..types import SUCCESS
from . import messages
from .cache import CacheGroups, describe_group
from .config import ConnectorConfig
from .consumer import Consumer
from .engine_links import EngineLinks
from .metadata import HixlConnectorMetadata, HixlHandshake
from .peers import PeerBook
from .producer import Producer
from .specs import GroupSpec
from .stats import Recorder

_log = logging.getLogger("hixl.vllm")

class HixlWorker:
    """``specs``: the KV cache groups that move (:func:`hixl.vllm.specs.group_specs`; a single group may
    leave its layer names empty: every layer vLLM registers); ``num_blocks``: the blocks of vLLM's
    cache (one id space for every group); ``rank`` and ``tp_size``: this worker's tensor-parallel rank
    and the TP size (vLLM's KV cache specs are per rank)."""

    def __init__(self, config: ConnectorConfig, role: str, engine_id: str, num_blocks: int,
                 specs: List[GroupSpec], rank: int = 0, tp_size: int = 1):
        self.config, self.role, self.engine_id, self.rank = config, role, engine_id, rank
        self.tp_size, self.specs, self.num_blocks = tp_size, list(specs), num_blocks
        self.groups: Optional[CacheGroups] = None
        self.epoch = uuid.uuid4().hex[:16]  # new with each registration: peers re-ask when it changes
        self.peers: Optional[PeerBook] = None
        self.engine: Optional[Hixl] = None
        self.stats = Recorder()
        self.links: Optional[EngineLinks] = None
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self.producer: Optional[Producer] = None
        self.consumer: Optional[Consumer] = None
        self._meta: Optional[HixlConnectorMetadata] = None

    # -- start-up ------------------------------------------------------------------------------
    def _describe(self, kv_caches: Dict[str, Any]) -> CacheGroups:
        from vllm.model_executor.models.utils import extract_layer_index

        order = {n: i for i, n in enumerate(sorted(kv_caches, key=extract_layer_index))}
        groups = []
        for spec in self.specs:
            names = list(spec.layer_names) or list(order)
            missing = [n for n in names if n not in kv_caches]
            if missing:
                raise RuntimeError(f"HixlConnector: vLLM registered no KV cache for the layers {missing[:4]} of "
                                   f"its {spec.describe()} group")
            names.sort(key=order.__getitem__)
            groups.append(describe_group(spec, kv_caches, names, self.num_blocks, self.rank, self.tp_size))
        return CacheGroups(groups, order)

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        from vllm.utils.network_utils import get_ip

        self.groups = self._describe(kv_caches)
        host = self.config.host or get_ip()
        port = self.config.port + self.rank if self.config.port else 0
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.engine = Hixl()
        opts = {} if self.config.transport == "auto" else {"HixlTransport": self.config.transport}
        rc = self.engine.initialize(addr, opts)
        if rc != SUCCESS:
            raise RuntimeError(f"HixlConnector: hixl engine initialize({addr!r}, {opts}) failed: "
                               f"{self.engine.last_error()}")
        try:
            self.pool = kv.KVPool.wrap_groups(self.engine, self.groups.kv)
        except kv.KVError as e:
            self.engine.finalize()
            raise RuntimeError(f"HixlConnector: registering vLLM's KV cache ({self.groups.kv.ranges()}) failed: "
                               f"{e}") from e
        self.links = EngineLinks(self.engine, self.config.connect_timeout_ms)
        self.peers = PeerBook(self.links, self.engine.local_engine, self.config.connect_timeout_ms / 1000.0)
        shared = dict(engine=self.engine, pool=self.pool, groups=self.groups, config=self.config, stats=self.stats,
                      links=self.links)
        if self.role != "kv_consumer":
            self.producer = Producer(**shared)
        if self.role != "kv_producer":
            self.consumer = Consumer(**shared, tp=(self.rank, self.tp_size), peers=self.peers)
        for name, fn in (("hixl-vllm-inbox", self._inbox_loop), ("hixl-vllm-jobs", self.links.run_jobs)):
            th = threading.Thread(target=fn, name=name, daemon=True)
            th.start()
            self._threads.append(th)
        for k, g in enumerate(self.groups.items):
            _log.info("hixl.vllm: KV cache group %d: %s, %d x %d B per block in place (%s)%s", k, g.spec.describe(),
                      g.memory.parts, g.memory.unit_bytes, g.interior,
                      "" if g.heads is not None or g.spec.kind != "full" or self.tp_size == 1 else
                      "; its KV heads do not divide over the TP ranks: blocks move whole only")
        _log.info("hixl.vllm: %s worker engine %s (transports %s), %d layers x %d blocks registered in place, mode %s",
                  self.role, self.engine.local_engine, self.engine._engine.data_transport, self.groups.kv.n_layers,
                  self.num_blocks, self.config.mode)

    @property
    def heads(self) -> Optional[kv.HeadSlice]:
        """The first group's KV heads of this rank (None: unknown, or not attention)."""
        return self.groups.items[0].heads if self.groups is not None else None

    def handshake(self) -> HixlHandshake:
        assert self.engine is not None
        return HixlHandshake(engine=self.engine.local_engine)

    def description(self) -> Dict[str, Any]:
        """What a peer learns of this worker with ``describe`` (:mod:`hixl.vllm.messages`)."""
        return {"engine": self.engine.local_engine, "groups": self.groups.infos(), "rank": self.rank,
                "tp": self.tp_size, "epoch": self.epoch}

    # -- the peer side: notifies (the jobs thread is the links') -------------------------------------
    def linked(self, peer: str) -> bool:
        return self.links is not None and self.links.linked(peer)

    def _inbox_loop(self) -> None:
        reassembler = messages.Reassembler(ttl_s=max(60.0, self.config.lease_s))
        while not self._stop.is_set():
            busy = (self.producer is not None and self.producer.needs_ticks())
            rc, notes = self.engine.wait_notifies(50 if busy else 1000)
            if rc != SUCCESS:
                if self._stop.is_set():
                    return
                _log.warning("hixl.vllm: wait_notifies failed: %s", self.engine.last_error())
                time.sleep(0.1)
                continue
            for n in notes:
                self._dispatch(reassembler, n.name, n.notify_msg)
            if self.producer is not None:
                self.producer.tick()

    def _dispatch(self, reassembler: messages.Reassembler, name: str, msg: str) -> None:
        what = messages.decode_name(name)
        if what is None:
            _log.info("hixl.vllm: notify %r is not ours: ignored", name[:80])
            return
        kind, tid, i, n = what
        if kind in messages.PARTED:
            try:
                d = reassembler.add(tid if kind == "grant" else f"{kind}/{tid}", i, n, msg)
            except ValueError as e:
                _log.warning("hixl.vllm: %s", e)
                return
            if d is None:
                return
            if kind == "described":
                if self.peers is not None:
                    self.peers.on_described(tid, d)
                return
            if self.producer is None:
                _log.warning("hixl.vllm: grant for %s reached a kv_consumer instance: ignored", tid)
                return
            self.producer.on_grant(tid, d)
        elif kind in ("cancel", "release"):
            if self.producer is not None:
                self.producer.on_cancel(tid, msg) if kind == "cancel" else self.producer.on_release(tid, msg)
        elif kind == "describe":
            self._answer_describe(tid, msg)
        elif kind in ("cancelled", "abort", "relay"):
            if self.consumer is not None:
                self.consumer.on_peer_message(kind, tid, msg)

    def _answer_describe(self, nonce: str, msg: str) -> None:
        try:
            asker = json.loads(msg)["from"]
            if not isinstance(asker, str):
                raise TypeError("from is not a string")
        except (ValueError, KeyError, TypeError) as e:
            _log.warning("hixl.vllm: malformed describe %s: %r (%s)", nonce, msg[:200], e)
            return
        payload = json.dumps(self.description(), separators=(",", ":"))

        def answer() -> None:
            try:
                self.links.send(asker, "described", nonce, payload, connect=False)
            except (ConnectionError, ValueError) as e:
                _log.info("hixl.vllm: the answer to describe %s from %s was not delivered: %s", nonce, asker, e)
        # a thread of its own (describes are rare: once per peer), not the jobs thread, which may itself
        # be waiting for this peer's answer to a describe of ours (two kv_both instances)
        threading.Thread(target=answer, name="hixl-vllm-describe", daemon=True).start()

    # -- per step ------------------------------------------------------------------------------
    # Each hook below is vLLM's forward thread: a bug in it is logged, never raised into the step (the
    # requests involved then fail through their timeouts, the instance keeps serving).
    def bind(self, meta: HixlConnectorMetadata) -> None:
        self._meta = meta
        try:
            if self.consumer is not None and (meta.loads or meta.cancels):
                self.consumer.start(meta)
            if self.producer is not None and (meta.sends or meta.held):
                self.producer.begin_step(meta)
        except Exception:
            _log.exception("hixl.vllm: bind_connector_metadata")

    def save_kv_layer(self, layer_name: str) -> None:
        if self.producer is not None and self.producer.step_active:
            layer = self.groups.index.get(layer_name)
            if layer is not None:
                try:
                    self.producer.layer_done(layer)
                except Exception:
                    _log.exception("hixl.vllm: save_kv_layer(%s)", layer_name)

    def wait_for_save(self) -> None:
        if self.producer is not None and self.producer.step_active:
            try:
                self.producer.end_step()
            except Exception:
                _log.exception("hixl.vllm: wait_for_save")

    def transfer_results(self, finished_req_ids: set) -> Tuple[set, set, set]:
        """(finished sending, finished receiving (failed ones included), failed receiving)."""
        sending: set = set()
        recving: set = set()
        failed: set = set()
        idle = self._meta.idle if self._meta is not None else False
        # never raise into vLLM's step: a bug here is logged, and the requests it holds wait for the
        # next step (or their timeout)
        try:
            if self.producer is not None:
                sending = self.producer.finished(finished_req_ids, idle)
        except Exception:
            _log.exception("hixl.vllm: prefill side of get_finished")
        try:
            if self.consumer is not None:
                recving, failed = self.consumer.finished(finished_req_ids, idle)
        except Exception:
            _log.exception("hixl.vllm: decode side of get_finished")
        return sending, recving, failed

    def shutdown(self) -> None:
        self._stop.set()
        if self.links is not None:
            self.links.stop_jobs()
        if self.producer is not None:
            self.producer.close()
        if self.engine is not None:
            try:
                self.pool.close()
            except Exception as e:  # best effort
                _log.info("hixl.vllm: deregistering the KV cache: %s", e)
            self.engine.finalize()
        for th in self._threads:
            th.join(5)
