"""What code written for CANN's hixl Python binding relies on (hicann/hixl ``hixl_py.cc``,
``hixl_options.cc``), checked against ``hixl.Hixl``: keyword names, the lifecycle, option validation,
registration edge cases, the async connect pool, argument checks of transfers and notifies.

The first part needs no peer; the second runs two engines once per transport (rdma in the VM, shm,
tcp)."""
from __future__ import annotations

import gc
import inspect
import json
import socket
import threading
import time

import numpy as np
import pytest

import hixl
from hixl import (FAILED, NOT_CONNECTED, PARAM_INVALID, READ, RESOURCE_EXHAUSTED, SUCCESS, WRITE, AsyncConnectStatus,
                  FeatureType, GetTransferStatusArgs, MemDesc, MemType, NotifyDesc, TransferArgs, TransferOpDesc,
                  TransferStatus)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.delenv("HCCL_RDMA_TC", raising=False)
    monkeypatch.delenv("HCCL_RDMA_SL", raising=False)
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"HixlTransport": "tcp"}) == SUCCESS, e.last_error()
    yield e
    e.finalize()


def _until(pred, timeout_s=30.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting for " + what
        time.sleep(0.005)


# ------------------------------------------------------------------------------------ signatures
@pytest.mark.parametrize("method,params", [
    ("initialize", ["local_engine", "options"]),
    ("register_mem", ["mem_desc", "mem_type"]),
    ("deregister_mem", ["mem_handle"]),
    ("connect", ["remote_engine", "timeout_in_millis"]),
    ("disconnect", ["remote_engine", "timeout_in_millis"]),
    ("connect_async", ["remote_engine", "timeout_in_millis"]),
    ("disconnect_async", ["remote_engine", "timeout_in_millis"]),
    ("transfer_sync", ["remote_engine", "op", "op_descs", "timeout_in_millis"]),
    ("transfer_async", ["remote_engine", "op", "op_descs", "args"]),
    ("get_transfer_status", ["req"]),
    ("get_all_transfer_status", ["args"]),
    ("send_notify", ["remote_engine", "notify", "timeout_in_millis"]),
])
def test_keyword_names_are_canns(method, params):
    sig = inspect.signature(getattr(hixl.Hixl, method))
    positional = [p.name for p in sig.parameters.values()
                  if p.kind == p.POSITIONAL_OR_KEYWORD and p.name != "self"]
    assert positional == params  # ours are keyword-only extras
    for name in ("timeout_in_millis",):
        if name in params:
            assert sig.parameters[name].default == 1000


def test_args_classes_and_capability():
    a = GetTransferStatusArgs(5, True)
    assert (a.max_query_count, a.skip_waiting) == (5, True)
    assert TransferArgs(7).user_data == 7
    for f in (FeatureType.AUTO_CONNECT, FeatureType.CLIENT_SERVER_COMM):
        assert hixl.get_capability(f) == (SUCCESS, hixl.FEATURE_SUPPORTED)


# ------------------------------------------------------------------------------------ lifecycle
def test_initialize_after_finalize_is_a_fresh_engine():
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"HixlTransport": "tcp"}) == SUCCESS
    first = e.local_engine
    e.finalize()
    assert e.connect(first, 100) == FAILED
    assert e.initialize("127.0.0.1:0", {"HixlTransport": "tcp"}) == SUCCESS
    buf = np.zeros(4096, np.uint8)
    rc, h = e.register_mem(MemDesc(buf.ctypes.data, buf.size), MemType.MEM_HOST)
    assert rc == SUCCESS and h
    e.finalize()
    assert e.register_mem(MemDesc(buf.ctypes.data, buf.size)) == (FAILED, 0)


def test_an_engine_dropped_without_finalize_releases_its_port_at_once():
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"HixlTransport": "tcp"}) == SUCCESS
    port = int(e.local_engine.rsplit(":", 1)[1])
    del e
    gc.collect()
    e2 = hixl.Hixl()
    assert e2.initialize("127.0.0.1:%d" % port, {"HixlTransport": "tcp"}) == SUCCESS, e2.last_error()
    e2.finalize()


# ------------------------------------------------------------------------------------ options
@pytest.mark.parametrize("options,bad_key", [
    ({"NoSuchOption": "1"}, "NoSuchOption"),
    ({"adxl.HixlTransport": "tcp"}, "adxl.HixlTransport"),
    ({"RdmaTrafficClass": "6"}, "RdmaTrafficClass"),
    ({"adxl.RdmaServiceLevel": "8"}, "adxl.RdmaServiceLevel"),
    ({"AutoConnect": "yes"}, "AutoConnect"),
    ({"EnableUseFabricMem": "2"}, "EnableUseFabricMem"),
    ({"BufferPool": "4:0"}, "BufferPool"),
    ({"GlobalResourceConfig": "[1]"}, "GlobalResourceConfig"),
    ({"GlobalResourceConfig": '{"connect_pool.thread_num": 65}'}, "connect_pool.thread_num"),
    # CANN's own checks (hixl_options.cc, engine_factory.cc, endpoint_generator.cc)
    ({"AutoConnect": ""}, "AutoConnect"),
    ({"GlobalResourceConfig": '{"comm_resource_config.protocol_desc": "roce"}'}, "protocol_desc"),
    ({"GlobalResourceConfig": '{"comm_resource_config.protocol_desc": ["roce:host", "uboe:host"]}'}, "protocol_desc"),
    ({"GlobalResourceConfig": '{"fabric_memory.task_stream_num": 2}'}, "task_stream_num"),
    ({"GlobalResourceConfig": '{"local_comm_res_path": "/nonexistent/hixl-lcr.json"}'}, "local_comm_res_path"),
    ({"LocalCommRes": "not json"}, "LocalCommRes"),
])
def test_initialize_refuses_bad_options_naming_them(monkeypatch, options, bad_key):
    monkeypatch.delenv("HCCL_RDMA_TC", raising=False)
    monkeypatch.delenv("HCCL_RDMA_SL", raising=False)
    e = hixl.Hixl()
    try:
        assert e.initialize("127.0.0.1:0", dict(options, HixlTransport="tcp")) == PARAM_INVALID
        assert bad_key in e.last_error()
    finally:
        e.finalize()


def test_initialize_takes_canns_keys_and_their_adxl_aliases(monkeypatch):
    monkeypatch.setenv("HCCL_RDMA_TC", "96")
    monkeypatch.delenv("HCCL_RDMA_SL", raising=False)
    e = hixl.Hixl()
    try:
        assert e.initialize("127.0.0.1:0", {"HixlTransport": "tcp", "adxl.BufferPool": "4:8", "AutoConnect": "0",
                                            "adxl.RdmaServiceLevel": "3", "EnableUseFabricMem": "0",
                                            "GlobalResourceConfig": '{"connect_pool.thread_num": "3"}',
                                            "LocalCommRes": ""}) == SUCCESS, e.last_error()
        assert e._pool._n_threads == 3
    finally:
        e.finalize()


def test_initialize_takes_what_canns_own_checks_accept(monkeypatch, tmp_path):
    monkeypatch.delenv("HCCL_RDMA_TC", raising=False)
    monkeypatch.delenv("HCCL_RDMA_SL", raising=False)
    lcr = tmp_path / "local_comm_res.json"
    lcr.write_text('{"version": "1.3"}')
    grc = {"comm_resource_config.max_active_channels": 2 ** 32 - 1,
           "comm_resource_config.protocol_desc": ["roce:host", "ub_rtp:device"],
           "fabric_memory.task_stream_num": 8, "fabric_memory.enable_aicpu_unfold": False,
           "local_comm_res_path": str(lcr)}
    e = hixl.Hixl()
    try:
        assert e.initialize("127.0.0.1:0", {"HixlTransport": "tcp", "AutoConnect": "1",
                                            "GlobalResourceConfig": json.dumps(grc)}) == SUCCESS, e.last_error()
    finally:
        e.finalize()


# ------------------------------------------------------------------------------------ registration
def test_registration_edge_cases(engine):
    assert engine.register_mem(MemDesc(0, 4096), MemType.MEM_HOST) == (PARAM_INVALID, 0)
    assert engine.deregister_mem(0) == PARAM_INVALID
    assert engine.deregister_mem(987654) == SUCCESS  # unknown: nothing to do
    buf = np.zeros(4096, np.uint8)
    rc, h = engine.register_mem(MemDesc(buf.ctypes.data, buf.size), MemType.MEM_HOST)
    assert rc == SUCCESS
    assert engine.deregister_mem(h) == SUCCESS
    assert engine.deregister_mem(h) == SUCCESS  # already deregistered


# ------------------------------------------------------------------------------------ async connects
class Silent:
    """A listener that never answers a handshake: a connect to it waits out its timeout."""

    def __init__(self):
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        self.s.listen(64)
        self.addr = "127.0.0.1:%d" % self.s.getsockname()[1]

    def close(self):
        self.s.close()


def test_the_connect_pool_queues_and_refuses_when_full(monkeypatch):
    monkeypatch.delenv("HCCL_RDMA_TC", raising=False)
    monkeypatch.delenv("HCCL_RDMA_SL", raising=False)
    e = hixl.Hixl()
    silent = [Silent() for _ in range(3)]
    try:
        assert e.initialize("127.0.0.1:0", {"HixlTransport": "tcp", "GlobalResourceConfig":
                                            '{"connect_pool.thread_num": 1, "connect_pool.task_queue_capacity": 1}'}
                            ) == SUCCESS
        assert e.connect_async(silent[0].addr, 3000) == SUCCESS  # runs on the one thread
        _until(lambda: e.get_async_connect_status(silent[0].addr)[1] == AsyncConnectStatus.CONNECTING,
               what="the first task runs")
        assert e.connect_async(silent[1].addr, 3000) == SUCCESS  # waits in the queue of one
        assert e.get_async_connect_status(silent[1].addr) == (SUCCESS, AsyncConnectStatus.CONNECT_PENDING)
        assert e.connect_async(silent[2].addr, 3000) == RESOURCE_EXHAUSTED
        assert "connect_pool.task_queue_capacity" in e.last_error()
        assert set(e.get_all_async_connect_status()[1]) == {silent[0].addr, silent[1].addr}  # async tasks only
        _until(lambda: e.get_async_connect_status(silent[0].addr)[1] == AsyncConnectStatus.CONNECT_FAILED,
               timeout_s=20, what="the first connect times out")
        for bad in (0, -5):
            assert e.connect_async(silent[2].addr, bad) == PARAM_INVALID
            assert e.disconnect_async(silent[2].addr, bad) == PARAM_INVALID
    finally:
        e.finalize()  # with a task still queued or running: no hang
        for s in silent:
            s.close()
    assert e.connect_async(silent[2].addr, 100) == FAILED


def test_status_of_a_peer_never_seen_and_of_an_async_disconnect_of_nobody(engine):
    peer = "127.0.0.1:%d" % _free_port()
    assert engine.get_async_connect_status(peer) == (SUCCESS, AsyncConnectStatus.NOT_CONNECT)
    assert engine.disconnect_async(peer, 1000) == SUCCESS
    _until(lambda: engine.get_all_async_connect_status() == (SUCCESS, {}), what="the task ends NOT_CONNECT")
    assert engine.get_async_connect_status(peer) == (SUCCESS, AsyncConnectStatus.NOT_CONNECT)


# ------------------------------------------------------------------------------------ transfers, notifies
def test_transfer_and_notify_argument_checks(engine):
    peer = "127.0.0.1:%d" % _free_port()
    assert engine.transfer_sync(peer, WRITE, [], 1000) == PARAM_INVALID
    assert engine.transfer_async(peer, WRITE, [], TransferArgs()) == (PARAM_INVALID, 0)
    for d in (TransferOpDesc(0, 0x2000, 8), TransferOpDesc(0x1000, 0, 8), TransferOpDesc(0x1000, 0x2000, 0)):
        assert engine.transfer_sync(peer, READ, [d], 1000) == PARAM_INVALID
        assert engine.transfer_async(peer, READ, [d]) == (PARAM_INVALID, 0)
    for t in (0, -1):
        assert engine.transfer_sync(peer, WRITE, [TransferOpDesc(1, 2, 3)], t) == PARAM_INVALID
        assert engine.send_notify(peer, NotifyDesc("a", "b"), t) == PARAM_INVALID
        assert engine.connect(peer, t) == PARAM_INVALID
    assert engine.get_transfer_status(0) == (FAILED, TransferStatus.FAILED)
    assert engine.get_transfer_status(424242) == (PARAM_INVALID, TransferStatus.FAILED)
    assert engine.send_notify(peer, NotifyDesc("n", "字" * 400), 1000) == PARAM_INVALID  # 1200 bytes
    assert engine.send_notify(peer, NotifyDesc("é" * 513, "m"), 1000) == PARAM_INVALID  # 1026 bytes


# ------------------------------------------------------------------------------------ two engines
TRANSPORTS = [pytest.param("rdma", marks=pytest.mark.rdma), "shm", "tcp"]


@pytest.fixture(params=TRANSPORTS)
def pair(request, monkeypatch):
    monkeypatch.delenv("HCCL_RDMA_TC", raising=False)
    monkeypatch.delenv("HCCL_RDMA_SL", raising=False)
    a, b = hixl.Hixl(), hixl.Hixl()
    for e in (a, b):
        assert e.initialize("127.0.0.1:0", {"HixlTransport": request.param}) == SUCCESS, e.last_error()
    src, dst = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)[: 1 << 20].copy(), np.zeros(1 << 20, np.uint8)
    assert a.register_mem(MemDesc(dst.ctypes.data, dst.size))[0] == SUCCESS
    assert b.register_mem(MemDesc(src.ctypes.data, src.size))[0] == SUCCESS
    yield a, b, src, dst
    for e in (b, a):
        e.finalize()


def test_a_listening_peer_not_connected_is_not_connected(pair):
    a, b, src, dst = pair
    d = [TransferOpDesc(src.ctypes.data, dst.ctypes.data, 64)]
    assert b.transfer_sync(a.local_engine, WRITE, d, 1000) == NOT_CONNECTED
    assert b.transfer_async(a.local_engine, WRITE, d) == (NOT_CONNECTED, 0)
    assert b.send_notify(a.local_engine, NotifyDesc("a", "b"), 1000) == NOT_CONNECTED


def test_transfer_async_takes_args_and_notifies_take_1024_bytes(pair):
    a, b, src, dst = pair
    assert b.connect(a.local_engine, timeout_in_millis=10000) == SUCCESS, b.last_error()
    rc, req = b.transfer_async(a.local_engine, WRITE, [TransferOpDesc(src.ctypes.data, dst.ctypes.data, 4096)],
                               args=TransferArgs(user_data=77))
    assert rc == SUCCESS and req
    rows = []

    def done():
        rc, got = b.get_all_transfer_status(args=GetTransferStatusArgs(10, True))  # finished ones only
        assert rc == SUCCESS
        rows.extend(got)
        return rows
    _until(done, what="the write")
    assert [(r.req, r.user_data, r.status) for r in rows] == [(req, 77, TransferStatus.COMPLETED)]
    assert (dst[:4096] == src[:4096]).all()
    msg = "字" * 341 + "a"  # 1024 bytes
    assert b.send_notify(a.local_engine, NotifyDesc("é" * 512, msg), 5000) == SUCCESS
    assert a.get_notifies() == (SUCCESS, [NotifyDesc("é" * 512, msg)])


def test_finalize_while_another_thread_is_inside_transfer_sync(pair):
    a, b, src, dst = pair
    assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
    d = [TransferOpDesc(src.ctypes.data, dst.ctypes.data, src.size)]
    results, stop = [], threading.Event()

    def writer():
        while not stop.is_set():
            rc = b.transfer_sync(a.local_engine, WRITE, d, 5000)
            results.append(rc)
            if rc == FAILED:
                return
    th = threading.Thread(target=writer)
    th.start()
    _until(lambda: len(results) >= 2, what="writes in flight")
    b.finalize()
    th.join(30)
    stop.set()
    assert not th.is_alive()
    assert results[-1] != SUCCESS or len(results) > 2  # it got a status back, no crash
    assert b.transfer_sync(a.local_engine, WRITE, d, 1000) == FAILED
    assert b.get_transfer_status(1) == (FAILED, TransferStatus.FAILED)
