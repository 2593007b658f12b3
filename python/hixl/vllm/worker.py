"""The worker side of :class:`hixl.vllm.HixlConnector` (runs in vLLM's worker process, beside the model).

It owns a hixl engine (listening on ``host:port``), registers vLLM's own KV cache tensors with it as
they are (:meth:`hixl.kv.KVPool.wrap`: no staging pool, no copy), and runs two small threads that
block (never spin): the *inbox* waits for notifies from peers (grants, cancels, releases, aborts) and
the *jobs* thread (:class:`~hixl.vllm.engine_links.EngineLinks`, the links to peers) does what may wait
on a peer (connect, send a notify, start a pull) so that the forward pass never waits on the network.
The prefill part is :class:`~hixl.vllm.producer.Producer`, the decode part
:class:`~hixl.vllm.consumer.Consumer`; an instance with ``kv_both`` has both. Each takes what it uses
(engine, pool, layout, config, stats, links) from the worker, and never the worker itself.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from .. import kv
from ..engine import Hixl
from ..types import SUCCESS
from . import messages
from .config import ConnectorConfig
from .consumer import Consumer
from .engine_links import EngineLinks
from .metadata import HixlConnectorMetadata, HixlHandshake
from .peers import PeerBook
from .producer import Producer
from .stats import Recorder

_log = logging.getLogger("hixl.vllm")

_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
           "torch.float8_e4m3fn": "float8", "torch.float8_e5m2": "float8", "torch.uint8": "uint8",
           "torch.int8": "int8"}


def describe_kv_caches(kv_caches: Dict[str, Any], names: List[str], num_blocks: int, block_size: int,
                       num_kv_heads: int, head_size: int) -> Tuple[kv.KVLayout, kv.BlockMemory, str]:
    """vLLM's per-layer KV cache tensors as a :class:`hixl.kv.KVLayout`, a :class:`hixl.kv.BlockMemory`
    (where each layer's blocks are) and a string naming the block interior (both ends must agree).

    Known shapes (each block's bytes contiguous): ``[blocks, heads, tokens, 2 * head]`` (the CPU
    backend: K and V packed in one block, one unit per (layer, block)); ``[2, blocks, ...]`` and
    ``[blocks, 2, ...]`` (K and V in blocks of their own). Blocks always move whole."""
    t = kv_caches[names[0]]
    dtype = _DTYPES.get(str(t.dtype))
    if dtype is None:
        raise NotImplementedError(f"HixlConnector: KV cache dtype {t.dtype} is not supported")
    layout = kv.KVLayout(n_layers=len(names), n_kv_heads=num_kv_heads, head_dim=head_size, dtype=dtype,
                         block_tokens=block_size)
    isz = t.element_size()
    shape, stride = tuple(t.shape), tuple(t.stride())
    for n in names:
        o = kv_caches[n]
        if tuple(o.shape) != shape or tuple(o.stride()) != stride or o.dtype != t.dtype:
            raise NotImplementedError(f"HixlConnector: layer {n} has a KV cache of shape {tuple(o.shape)}, stride "
                                      f"{tuple(o.stride())}, {o.dtype}; layer {names[0]} has {shape}, {stride}, "
                                      f"{t.dtype}")
    block = layout.block_bytes  # one of K or V
    if len(shape) >= 2 and shape[0] == num_blocks and t[0].is_contiguous() and t[0].nbytes == 2 * block:
        parts, part_stride, block_stride, unit = 1, 0, stride[0] * isz, 2 * block
        interior = f"packed{shape[1:]}"
    elif len(shape) >= 3 and shape[0] == 2 and shape[1] == num_blocks and t[0, 0].is_contiguous() \
            and t[0, 0].nbytes == block:
        parts, part_stride, block_stride, unit = 2, stride[0] * isz, stride[1] * isz, block
        interior = f"kv-outer{shape[2:]}"
    elif len(shape) >= 3 and shape[0] == num_blocks and shape[1] == 2 and t[0, 0].is_contiguous() \
            and t[0, 0].nbytes == block:
        parts, part_stride, block_stride, unit = 2, stride[1] * isz, stride[0] * isz, block
        interior = f"kv-inner{shape[2:]}"
    else:
        raise NotImplementedError(f"HixlConnector: a KV cache of shape {shape} and stride {stride} "
                                  f"({num_blocks} blocks of {block_size} tokens, {num_kv_heads} heads of "
                                  f"{head_size}) is not a layout it knows")
    memory = kv.BlockMemory(layer_addrs=tuple(kv_caches[n].data_ptr() for n in names), num_blocks=num_blocks,
                            block_stride=block_stride, unit_bytes=unit, parts=parts, part_stride=part_stride,
                            token_major=False)
    return layout, memory, f"{dtype}:{interior}"


def head_slice_of(interior: str, num_kv_heads: int, block_size: int, lo: int, hi: int) -> Optional[kv.HeadSlice]:
    """The :class:`hixl.kv.HeadSlice` of blocks of ``interior`` (:func:`describe_kv_caches`) holding the
    KV heads ``[lo, hi)``; None when the interior does not say where its heads are (a block of as many
    tokens as heads, heads and tokens not told apart: such blocks move whole only)."""
    try:
        dtype, rest = interior.split(":", 1)
        kind, dims_s = rest.split("(", 1)
        dims = tuple(int(x) for x in dims_s.rstrip(")").split(",") if x.strip())
        isz = kv.KVLayout(n_layers=1, n_kv_heads=1, head_dim=1, dtype=dtype).itemsize
    except ValueError:
        return None
    if len(dims) != 3 or hi - lo != num_kv_heads:
        return None
    if dims[:2] == (num_kv_heads, block_size) and (num_kv_heads != block_size or kind == "packed"):
        order = "head"
    elif dims[:2] == (block_size, num_kv_heads) and num_kv_heads != block_size:
        order = "token"
    else:
        return None
    return kv.HeadSlice(lo=lo, hi=hi, order=order, tokens=block_size, row=dims[2] * isz)


class HixlWorker:
    """``rank`` and ``tp_size``: this worker's tensor-parallel rank and the TP size; ``total_kv_heads``:
    the model's KV heads (0: ``num_kv_heads * tp_size``); ``num_kv_heads`` is this rank's (vLLM's
    KV cache spec is per rank)."""

    def __init__(self, config: ConnectorConfig, role: str, engine_id: str, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_size: int, rank: int = 0, tp_size: int = 1, total_kv_heads: int = 0):
        self.config, self.role, self.engine_id, self.rank = config, role, engine_id, rank
        self.tp_size, self.total_kv_heads = tp_size, total_kv_heads or num_kv_heads * tp_size
        self.heads: Optional[kv.HeadSlice] = None
        self.epoch = uuid.uuid4().hex[:16]  # new with each registration: peers re-ask when it changes
        self.peers: Optional[PeerBook] = None
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        self.engine: Optional[Hixl] = None
        self.layer_index: Dict[str, int] = {}
        self.stats = Recorder()
        self.links: Optional[EngineLinks] = None
        self._interior = ""
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self.producer: Optional[Producer] = None
        self.consumer: Optional[Consumer] = None
        self._meta: Optional[HixlConnectorMetadata] = None

    # -- start-up ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.utils.network_utils import get_ip

        names = sorted(kv_caches, key=extract_layer_index)
        self.layer_index = {n: i for i, n in enumerate(names)}
        self.layout, memory, self.interior = describe_kv_caches(
            kv_caches, names, self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
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
            self.pool = kv.KVPool.wrap(self.engine, self.layout, memory)
        except kv.KVError as e:
            self.engine.finalize()
            raise RuntimeError(f"HixlConnector: registering vLLM's KV cache ({memory.ranges()}) failed: {e}") from e
        self.links = EngineLinks(self.engine, self.config.connect_timeout_ms)
        self.peers = PeerBook(self.links, self.engine.local_engine, self.config.connect_timeout_ms / 1000.0)
        try:
            lo, hi = kv.head_range(self.rank, self.tp_size, self.total_kv_heads)
            self.heads = head_slice_of(self.interior, self.num_kv_heads, self.block_size, lo, hi)
        except ValueError as e:
            _log.warning("hixl.vllm: KV heads of rank %d of TP %d: %s; blocks move whole only", self.rank,
                         self.tp_size, e)
        shared = dict(engine=self.engine, pool=self.pool, layout=self.layout, config=self.config, stats=self.stats,
                      links=self.links, interior=self.interior, heads=self.heads)
        if self.role != "kv_consumer":
            self.producer = Producer(**shared)
        if self.role != "kv_producer":
            self.consumer = Consumer(**shared, tp=(self.rank, self.tp_size, self.total_kv_heads), peers=self.peers)
        for name, fn in (("hixl-vllm-inbox", self._inbox_loop), ("hixl-vllm-jobs", self.links.run_jobs)):
            th = threading.Thread(target=fn, name=name, daemon=True)
            th.start()
            self._threads.append(th)
        _log.info("hixl.vllm: %s worker engine %s (transports %s), %d layers x %d blocks of %d B registered in "
                  "place (%s), mode %s", self.role, self.engine.local_engine, self.engine._engine.data_transport,
                  len(names), self.num_blocks, memory.unit_bytes, self.interior, self.config.mode)

    def handshake(self) -> HixlHandshake:
        assert self.engine is not None
        return HixlHandshake(engine=self.engine.local_engine, memory=self.pool.memory.to_dict(),
                             layout=dict(vars(self.layout)))

    def description(self) -> Dict[str, Any]:
        """What a peer learns of this worker with ``describe`` (:mod:`hixl.vllm.messages`)."""
        return {"engine": self.engine.local_engine, "memory": self.pool.memory.to_dict(),
                "layout": dict(vars(self.layout)), "interior": self.interior,
                "heads": self.heads.to_dict() if self.heads is not None else None, "rank": self.rank,
                "tp": self.tp_size, "total_heads": self.total_kv_heads, "epoch": self.epoch}

    @property
    def interior(self) -> str:
        """The KV blocks' interior (:func:`describe_kv_caches`), which a peer's must match; setting it
        sets the producer's and the consumer's."""
        return self._interior

    @interior.setter
    def interior(self, value: str) -> None:
        self._interior = value
        for part in (self.producer, self.consumer):
            if part is not None:
                part.interior = value

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
        elif kind in ("cancelled", "abort"):
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
            layer = self.layer_index.get(layer_name)
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
