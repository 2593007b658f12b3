"""hixl.Hixl without a device: lifecycle, argument refusal, not-connected and after-finalize paths.

These run everywhere (host tier). Behaviour that depends on whether an RDMA device exists is
split: with none, the engine initializes without a data transport and connect() says UNSUPPORTED.
"""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

import hixl
from hixl import (ALREADY_CONNECTED, FAILED, NOT_CONNECTED, PARAM_INVALID, READ, SUCCESS, TIMEOUT, UNSUPPORTED,
                  WRITE, AsyncConnectStatus, GetTransferStatusArgs, MemDesc, MemType, NotifyDesc, TransferArgs,
                  TransferOpDesc, TransferStatus)

no_device = pytest.mark.skipif(hixl.has_active_device(), reason="checks the behaviour without an RDMA device")


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.delenv("HIXL_TRANSPORT", raising=False)
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0") == SUCCESS, e.last_error()
    yield e
    e.finalize()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_initialize_forms_and_idempotence(monkeypatch):
    monkeypatch.delenv("HIXL_TRANSPORT", raising=False)
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0") == SUCCESS
    host, port = e.local_engine.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0  # port 0 picked a free port
    with socket.create_connection(("127.0.0.1", int(port)), timeout=2):
        pass  # it listens
    assert e.initialize("127.0.0.1:0") == SUCCESS  # again: SUCCESS, same engine
    assert e.local_engine == "%s:%s" % (host, port)
    e.finalize()
    c = hixl.Hixl()
    assert c.initialize("127.0.0.1") == SUCCESS  # client only
    assert c.local_engine == "127.0.0.1"
    c.finalize()
    v6 = hixl.Hixl()
    assert v6.initialize("[::1]:0") in (SUCCESS, FAILED)  # FAILED only where the host has no IPv6 loopback
    if v6.local_engine:
        assert v6.local_engine.startswith("[::1]:")
    v6.finalize()


@pytest.mark.parametrize("addr", ["", "nonsense", "1.2.3.4:99999", "[1.2.3.4]:5", "fe80::1:zz", "localhost:5", None, 5,
                                  b"127.0.0.1:0", " 127.0.0.1:0"])
def test_initialize_bad_address(addr):
    e = hixl.Hixl()
    assert e.initialize(addr) == PARAM_INVALID
    assert e.last_error().startswith("PARAM_INVALID")
    e.finalize()


@pytest.mark.parametrize("options", [{"RdmaTrafficClass": "256"}, {"RdmaServiceLevel": "-1"}, {"AutoConnect": "yes"},
                                     {"HixlTransport": "carrier-pigeon"}, {1: "x"}, "AutoConnect=1"])
def test_initialize_bad_options(options):
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", options) == PARAM_INVALID
    e.finalize()


def test_initialize_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        e = hixl.Hixl()
        assert e.initialize("127.0.0.1:%d" % s.getsockname()[1]) == FAILED
        assert "Address already in use" in e.last_error()
        e.finalize()


@pytest.mark.parametrize("transport,offers", [("shm", "shm"), ("tcp", "tcp"), ("SHM", "shm")])
def test_transport_option_and_env_restrict_what_an_engine_offers(monkeypatch, transport, offers):
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"HixlTransport": transport}) == SUCCESS
    assert e._engine.data_transport == offers
    e.finalize()
    monkeypatch.setenv("HIXL_TRANSPORT", transport)
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0") == SUCCESS
    assert e._engine.data_transport == offers
    e.finalize()


@no_device
def test_rdma_transport_without_device_fails_clearly(monkeypatch):
    monkeypatch.delenv("HIXL_TRANSPORT", raising=False)
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"HixlTransport": "rdma"}) == FAILED
    assert "RDMA transport requested but unusable" in e.last_error()
    e.finalize()


def test_finalize_is_idempotent_and_everything_fails_after(engine):
    peer = "127.0.0.1:%d" % _free_port()
    engine.finalize()
    assert engine.finalize() is None
    d = [TransferOpDesc(1, 2, 3)]
    assert engine.register_mem(MemDesc(0x1000, 10), MemType.MEM_HOST) == (FAILED, 0)
    assert engine.deregister_mem(1) == FAILED
    assert engine.connect(peer) == FAILED
    assert engine.disconnect(peer) == FAILED
    assert engine.connect_async(peer) == FAILED
    assert engine.disconnect_async(peer) == FAILED
    assert engine.get_async_connect_status(peer) == (FAILED, AsyncConnectStatus.NOT_CONNECT)
    assert engine.get_all_async_connect_status() == (FAILED, {})
    assert engine.transfer_sync(peer, WRITE, d) == FAILED
    assert engine.transfer_async(peer, READ, d, TransferArgs()) == (FAILED, 0)
    assert engine.get_transfer_status(1) == (FAILED, TransferStatus.FAILED)
    assert engine.get_all_transfer_status(GetTransferStatusArgs()) == (FAILED, [])
    assert engine.send_notify(peer, NotifyDesc("a", "b")) == FAILED
    assert engine.get_notifies() == (FAILED, [])
    assert engine.get_link_info(peer) == (FAILED, {})
    assert engine.local_engine == ""
    # as CANN: initialize after finalize builds a fresh engine
    assert engine.initialize("127.0.0.1:0") == SUCCESS
    assert engine.local_engine and engine.get_notifies() == (SUCCESS, [])
    engine.finalize()
    assert engine.get_notifies() == (FAILED, [])


def test_finalize_before_initialize():
    e = hixl.Hixl()
    e.finalize()
    assert e.initialize("127.0.0.1:0") == SUCCESS  # a fresh engine, as in CANN
    assert e.get_notifies() == (SUCCESS, [])
    e.finalize()
    with hixl.Hixl() as e2:
        assert e2.initialize("127.0.0.1") == SUCCESS
    assert e2.get_notifies() == (FAILED, [])


def test_calls_before_initialize_fail():
    e = hixl.Hixl()
    assert e.register_mem(MemDesc(0x1000, 10)) == (FAILED, 0)
    assert e.get_notifies() == (FAILED, [])
    assert e.connect("127.0.0.1:1") == FAILED
    e.finalize()


def test_register_same_range_same_handle_and_deregister_idempotent(engine):
    buf = np.zeros(8192, np.uint8)
    rc, h = engine.register_mem(MemDesc(buf.ctypes.data, buf.size), MemType.MEM_HOST)
    assert rc == SUCCESS and h != 0
    assert engine.register_mem(MemDesc(buf.ctypes.data, buf.size), MemType.MEM_HOST) == (SUCCESS, h)
    rc, h2 = engine.register_mem(MemDesc(buf.ctypes.data, 4096), MemType.MEM_DEVICE)
    assert rc == SUCCESS and h2 not in (0, h)
    assert engine.deregister_mem(h) == SUCCESS
    assert engine.deregister_mem(h) == SUCCESS
    assert engine.deregister_mem(h2) == SUCCESS
    assert engine.deregister_mem(0) == PARAM_INVALID
    assert engine.deregister_mem(10 ** 6) == SUCCESS  # never issued: nothing to do (as CANN)
    assert engine.deregister_mem(-1) == PARAM_INVALID
    assert engine.deregister_mem("1") == PARAM_INVALID


@pytest.mark.parametrize("desc,mem_type", [
    (MemDesc(0, 10), MemType.MEM_HOST), (MemDesc(0x1000, 0), MemType.MEM_HOST), (MemDesc(-1, 10), MemType.MEM_HOST),
    (MemDesc(2 ** 64 - 5, 10), MemType.MEM_HOST), (MemDesc(0x1000, 10), 7), (MemDesc(0x1000, 10), True),
    (None, MemType.MEM_HOST), ((0x1000, 10), MemType.MEM_HOST), (MemDesc("1", 10), MemType.MEM_HOST)])
def test_register_bad_input(engine, desc, mem_type):
    assert engine.register_mem(desc, mem_type) == (PARAM_INVALID, 0)


def test_connect_to_nobody(engine):
    port = _free_port()
    assert engine.connect("127.0.0.1:%d" % port, 500) in (FAILED, TIMEOUT)
    assert "Connection refused" in engine.last_error()
    assert engine.get_async_connect_status("127.0.0.1:%d" % port) == (SUCCESS, AsyncConnectStatus.NOT_CONNECT)


def test_connect_timeout_when_the_peer_never_answers(engine):
    # A listener that accepts TCP but never speaks hixl: the handshake runs into the timeout.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        rc = engine.connect("127.0.0.1:%d" % s.getsockname()[1], 300)
    assert rc == TIMEOUT, engine.last_error()


def test_connect_to_something_that_is_not_hixl(engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]

        def garbage():
            c, _ = s.accept()
            c.recv(4096)
            c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 64)
            c.close()
        t = threading.Thread(target=garbage)
        t.start()
        rc = engine.connect("127.0.0.1:%d" % port, 2000)
        t.join()
    assert rc == FAILED and "bad magic" in engine.last_error()


def test_garbage_sent_to_the_listener_does_not_hurt_it(engine):
    host, port = engine.local_engine.rsplit(":", 1)
    for payload in (b"", b"\x00" * 16, b"GET / HTTP/1.0\r\n\r\n", b"HIXL" + b"\xff" * 60):
        with socket.create_connection((host, int(port)), timeout=2) as c:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)
            c.settimeout(5)
            try:
                c.recv(4096)  # a Refuse frame or EOF
            except OSError:
                pass
    # Still serving: another engine's connect gets a proper answer.
    other = hixl.Hixl()
    assert other.initialize("127.0.0.1") == SUCCESS
    rc = other.connect(engine.local_engine, 2000)
    assert rc in (SUCCESS, UNSUPPORTED), other.last_error()
    other.finalize()


@no_device
def test_without_a_device_auto_picks_shm_on_the_same_host(engine):
    assert engine._engine.data_transport == "shm,tcp"
    other = hixl.Hixl()
    assert other.initialize("127.0.0.1:0") == SUCCESS
    assert other.connect(engine.local_engine, 2000) == SUCCESS, other.last_error()
    assert other.get_transport(engine.local_engine) == (SUCCESS, "shm")
    assert engine.get_transport(other.local_engine) == (SUCCESS, "shm")
    other.finalize()


def test_no_common_transport_is_unsupported_and_says_why():
    a, b = hixl.Hixl(), hixl.Hixl()
    assert a.initialize("127.0.0.1:0", {"HixlTransport": "shm"}) == SUCCESS
    assert b.initialize("127.0.0.1:0", {"HixlTransport": "tcp"}) == SUCCESS
    assert b.connect(a.local_engine, 2000) == UNSUPPORTED
    assert "no common transport: peer offers tcp" in b.last_error() and "offers shm" in b.last_error()
    b.finalize()
    a.finalize()


@pytest.mark.parametrize("remote", ["", "127.0.0.1", "x:1", None, 3, "127.0.0.1:70000"])
def test_connect_bad_remote(engine, remote):
    assert engine.connect(remote, 100) == PARAM_INVALID
    assert engine.connect_async(remote, 100) == PARAM_INVALID


@pytest.mark.parametrize("timeout", [0, -1, 2 ** 31, 1.5, "10", None, True])
def test_bad_timeouts(engine, timeout):
    peer = "127.0.0.1:%d" % _free_port()
    assert engine.connect(peer, timeout) == PARAM_INVALID
    assert engine.transfer_sync(peer, WRITE, [TransferOpDesc(1, 2, 3)], timeout) == PARAM_INVALID
    assert engine.send_notify(peer, NotifyDesc("a", "b"), timeout) == PARAM_INVALID


def test_connect_self_refused(engine):
    assert engine.connect(engine.local_engine, 500) == PARAM_INVALID


def test_not_connected_paths(engine):
    peer = "127.0.0.1:%d" % _free_port()
    d = [TransferOpDesc(0x1000, 0x2000, 16)]
    assert engine.disconnect(peer) == NOT_CONNECTED
    assert engine.get_async_connect_status(peer) == (SUCCESS, AsyncConnectStatus.NOT_CONNECT)  # never seen
    assert engine.disconnect_async(peer) == SUCCESS  # queued: it ends NOT_CONNECT
    deadline = time.monotonic() + 5
    while engine.get_all_async_connect_status()[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.get_async_connect_status(peer) == (SUCCESS, AsyncConnectStatus.NOT_CONNECT)
    assert engine.transfer_sync(peer, WRITE, d, 100) == NOT_CONNECTED
    assert engine.transfer_async(peer, READ, d) == (NOT_CONNECTED, 0)
    assert engine.send_notify(peer, NotifyDesc("a", "b"), 100) == NOT_CONNECTED
    assert engine.get_link_info(peer) == (NOT_CONNECTED, {})
    assert engine.get_transport(peer) == (NOT_CONNECTED, "")
    assert engine.get_all_async_connect_status() == (SUCCESS, {})
    assert engine.get_all_transfer_status() == (SUCCESS, [])
    assert engine.get_notifies() == (SUCCESS, [])
    assert engine.get_transfer_status(12345) == (PARAM_INVALID, TransferStatus.FAILED)


@pytest.mark.parametrize("op,descs", [
    (2, [TransferOpDesc(1, 2, 3)]), (None, [TransferOpDesc(1, 2, 3)]), (WRITE, []), (WRITE, None),
    (WRITE, [TransferOpDesc(1, 2, 0)]), (WRITE, [TransferOpDesc(-1, 2, 3)]), (WRITE, [TransferOpDesc(1, 2 ** 64 - 1, 3)]),
    (WRITE, [(1, 2, 3)]), (WRITE, TransferOpDesc(1, 2, 3)), (READ, [TransferOpDesc(1, 2, 3), None])])
def test_transfer_bad_descriptors(engine, op, descs):
    peer = "127.0.0.1:%d" % _free_port()
    assert engine.transfer_sync(peer, op, descs, 100) == PARAM_INVALID
    assert engine.transfer_async(peer, op, descs, TransferArgs()) == (PARAM_INVALID, 0)


def test_transfer_async_bad_args(engine):
    peer = "127.0.0.1:%d" % _free_port()
    d = [TransferOpDesc(1, 2, 3)]
    assert engine.transfer_async(peer, WRITE, d, TransferArgs(user_data=-1)) == (PARAM_INVALID, 0)
    assert engine.transfer_async(peer, WRITE, d, object()) == (PARAM_INVALID, 0)
    assert engine.get_all_transfer_status(GetTransferStatusArgs(max_query_count=-1)) == (PARAM_INVALID, [])
    assert engine.get_all_transfer_status(GetTransferStatusArgs(skip_waiting=1)) == (PARAM_INVALID, [])
    assert engine.get_transfer_status("x") == (PARAM_INVALID, TransferStatus.FAILED)


@pytest.mark.parametrize("notify", [NotifyDesc("a" * 1025, ""), NotifyDesc("", "m" * 1025), NotifyDesc(1, "x"),
                                    None, ("a", "b")])
def test_send_notify_bad(engine, notify):
    assert engine.send_notify("127.0.0.1:%d" % _free_port(), notify, 100) == PARAM_INVALID


def test_never_raises_on_hostile_objects(engine):
    class Evil:
        @property
        def addr(self):
            raise RuntimeError("boom")
        len = 5
        local_addr = remote_addr = property(lambda self: 1 / 0)

    peer = "127.0.0.1:%d" % _free_port()
    assert engine.register_mem(Evil(), MemType.MEM_HOST)[0] in (PARAM_INVALID, FAILED)
    assert engine.transfer_sync(peer, WRITE, [Evil()], 100) in (PARAM_INVALID, FAILED)
    assert engine.transfer_async(peer, WRITE, [Evil()])[0] in (PARAM_INVALID, FAILED)


def test_blocking_calls_release_the_gil(engine):
    # connect() to a listener that never answers blocks ~1 s inside C++. Were the GIL held, this
    # thread would stall for that whole second; released, it keeps ticking.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        result = []
        t = threading.Thread(target=lambda: result.append(engine.connect("127.0.0.1:%d" % s.getsockname()[1], 1000)))
        t.start()
        last, worst = time.monotonic(), 0.0
        while t.is_alive():
            now = time.monotonic()
            worst, last = max(worst, now - last), now
        t.join()
    assert result == [TIMEOUT]
    assert worst < 0.5, "this thread stalled %.2fs while connect() blocked: GIL held?" % worst
