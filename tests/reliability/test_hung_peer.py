"""Reliability: a peer that hangs (SIGSTOP) instead of dying, and one that is silent but alive (starved).
One suite over rdma (VM), shm and tcp.

A stopped process keeps its sockets open, so nothing ever reports an error: only the heartbeat on the
control connection (HixlHeartbeatMs x HixlHeartbeatMisses) and the async requests' own deadline
(HixlAsyncTimeoutMs, or transfer_async(..., timeout_in_millis=)) end things. A silent peer whose process
runs (same host) is slow, not dead: its link is kept up to SLOW_PEER_FACTOR times the bound. The bounds
below tell the two verdicts apart (a stopped peer closed at 1x, a running one not before 3x); every
other bound is generous (seconds).
"""
from __future__ import annotations

import time

import numpy as np

import hixl
from hixl import FAILED, NOT_CONNECTED, SUCCESS, WRITE, MemDesc, TransferOpDesc, TransferStatus

from .helpers import LOGS_WARN, HalfFrameRelay, MiB, Peer
from .helpers import engine as _engine, linked as _linked, until as _until

SLOW_PEER_FACTOR = 6  # engine/liveness.h


def test_an_idle_link_to_a_stopped_peer_is_closed_by_the_heartbeat_and_can_be_made_again(transport):
    peer = Peer(transport, MiB)
    b = _engine(transport, HixlHeartbeatMs=100, HixlHeartbeatMisses=5)
    try:
        src = np.full(MiB, 7, np.uint8)
        assert b.register_mem(MemDesc(src.ctypes.data, MiB))[0] == SUCCESS
        assert b.connect(peer.name, 20000) == SUCCESS, b.last_error()
        peer.stop()
        t0 = time.monotonic()
        _until(lambda: not _linked(b, peer.name), 30, "the heartbeat to close the link to the stopped peer")
        closed_after = time.monotonic() - t0
        print("link closed %.2fs after SIGSTOP (heartbeat 100 ms x 5)" % closed_after)
        # dead, not slow: closed at the bound (0.5 s), long before the slow-peer bound (3 s)
        assert closed_after < 0.5 * SLOW_PEER_FACTOR - 0.5, closed_after
        assert b.transfer_sync(peer.name, WRITE, [TransferOpDesc(src.ctypes.data, peer.info["addr"], 4096)],
                               1000) == NOT_CONNECTED
        assert b.disconnect(peer.name) == SUCCESS, b.last_error()  # the user's disconnect still succeeds, once
        # The peer resumes: it finds its end of the link closed too, and a new link works.
        peer.cont()
        assert b.connect(peer.name, 20000) == SUCCESS, b.last_error()
        assert b.transfer_sync(peer.name, WRITE, [TransferOpDesc(src.ctypes.data, peer.info["addr"], MiB)],
                               20000) == SUCCESS, b.last_error()
    finally:
        peer.close()
        b.finalize()


def test_a_silent_peer_whose_process_runs_is_slow_not_dead(transport, capfd):
    """b's frames stop reaching a (a relay drops them) while b's process runs: a keeps the link past
    the bound (0.5 s), as slow, and closes it at SLOW_PEER_FACTOR times the bound, with a warning."""
    a = _engine(transport, HixlHeartbeatMs=100, HixlHeartbeatMisses=5)
    b = _engine(transport)
    relay = HalfFrameRelay(int(a.local_engine.rsplit(":", 1)[1]))
    try:
        via = "127.0.0.1:%d" % relay.port
        assert b.connect(via, 20000) == SUCCESS, b.last_error()
        _until(lambda: _linked(a, b.local_engine), 10, "a's end of the link to b")
        relay.mute()
        t0 = time.monotonic()
        time.sleep(1.5)  # three times the bound
        assert _linked(a, b.local_engine), "a closed the link to a running peer %.2f s after it went silent" % (
            time.monotonic() - t0)
        _until(lambda: not _linked(a, b.local_engine), 30, "a to close the link at the slow-peer bound")
        closed_after = time.monotonic() - t0
        print("%s: a silent running peer's link closed %.2f s after it went silent (bound 0.5 s, slow bound %.1f s)"
              % (transport, closed_after, 0.5 * SLOW_PEER_FACTOR))
        assert closed_after >= 0.5 * SLOW_PEER_FACTOR - 0.2, closed_after
        if LOGS_WARN:
            err = capfd.readouterr().err
            assert "link to %s: no frame from the peer for" % b.local_engine in err, err
            assert "on this host is running" in err and "keeping the link" in err, err
    finally:
        relay.close()
        b.finalize()
        a.finalize()


def test_a_healthy_idle_link_survives_a_short_heartbeat():
    a = _engine("tcp", HixlHeartbeatMs=50, HixlHeartbeatMisses=40)
    b = _engine("tcp", HixlHeartbeatMs=50, HixlHeartbeatMisses=40)
    try:
        assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
        time.sleep(3.0)  # 60 pings each way; the links must still be there
        assert _linked(b, a.local_engine) and _linked(a, b.local_engine)
    finally:
        b.finalize()
        a.finalize()


def test_an_async_request_to_a_stopped_peer_ends_through_the_heartbeat(transport):
    """No deadline of its own (HixlAsyncTimeoutMs=0): the heartbeat alone ends it, never WAITING."""
    size = 64 * MiB
    peer = Peer(transport, size)
    # A 2 s bound: posting 64 MiB in the TCG guest took longer than 0.5 s, and the link went mid-post.
    b = _engine(transport, HixlHeartbeatMs=100, HixlHeartbeatMisses=20, HixlAsyncTimeoutMs=0)
    try:
        src = np.ones(size, np.uint8)
        assert b.register_mem(MemDesc(src.ctypes.data, size))[0] == SUCCESS
        assert b.connect(peer.name, 20000) == SUCCESS, b.last_error()
        peer.stop()
        descs = [TransferOpDesc(src.ctypes.data + i * 4 * MiB, peer.info["addr"] + i * 4 * MiB, 4 * MiB)
                 for i in range(16)]
        reqs = []
        for i in range(4):
            rc, req = b.transfer_async(peer.name, WRITE, descs)
            if rc in (NOT_CONNECTED, FAILED) and i > 0 and not _linked(b, peer.name):
                break  # the heartbeat closed the link before or while this one posted (slow under TCG)
            assert rc == SUCCESS, b.last_error()
            reqs.append(req)
        for req in reqs:  # nobody polls meanwhile: the first wait comes after the link is gone
            rc, st = b.transfer_wait(req, 30000)
            assert rc == SUCCESS and st != TransferStatus.WAITING, (rc, st, b.last_error())
            # shm and rdma (rxe lives in the kernel) can finish a write into a stopped process; tcp cannot
            if transport == "tcp":
                assert st == TransferStatus.FAILED, st
        _until(lambda: not _linked(b, peer.name), 30, "the heartbeat to close the link to the stopped peer")
    finally:
        peer.close()
        b.finalize()


def test_an_async_request_past_its_deadline_to_a_stopped_peer_ends_failed(transport):
    """Heartbeat off: the request's own deadline aborts the link; the stopped peer cannot confirm its end
    stopped, so the request ends FAILED (not TIMEOUT), within the deadline plus the abort's 5 s."""
    size = 64 * MiB
    peer = Peer(transport, size)
    b = _engine(transport, HixlHeartbeatMs=0)
    try:
        src = np.ones(size, np.uint8)
        assert b.register_mem(MemDesc(src.ctypes.data, size))[0] == SUCCESS
        assert b.connect(peer.name, 20000) == SUCCESS, b.last_error()
        peer.stop()
        descs = [TransferOpDesc(src.ctypes.data + i * 4 * MiB, peer.info["addr"] + i * 4 * MiB, 4 * MiB)
                 for i in range(16)]
        reqs = []
        for i in range(4):
            rc, req = b.transfer_async(peer.name, WRITE, descs, timeout_in_millis=300)
            if rc in (NOT_CONNECTED, FAILED) and i > 0:
                # An earlier request's deadline already aborted the link: posting 64 MiB on a single rxe
                # device with several queue pairs can take longer than 300 ms (README options, Soft-RoCE).
                _until(lambda: not _linked(b, peer.name), 10, "the aborted link to be gone")
                break
            assert rc == SUCCESS, b.last_error()
            reqs.append(req)
        t0 = time.monotonic()
        ended = []
        for req in reqs:
            while True:  # polled, not waited on: get_transfer_status sees the same ending
                rc, st = b.get_transfer_status(req)
                assert rc == SUCCESS, b.last_error()
                if st != TransferStatus.WAITING:
                    ended.append(st)
                    break
                assert time.monotonic() - t0 < 30, "request %d still WAITING 30 s after its 300 ms deadline" % req
                time.sleep(0.01)
        if transport == "tcp":
            assert TransferStatus.FAILED in ended, ended
        assert set(ended) <= {TransferStatus.COMPLETED, TransferStatus.FAILED}, ended  # never TIMEOUT: unconfirmed
        if ended != [TransferStatus.COMPLETED] * len(ended):
            assert not _linked(b, peer.name)
    finally:
        peer.close()
        b.finalize()


def test_async_options_are_checked():
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"HixlHeartbeatMisses": "0"}) != SUCCESS
    assert "heartbeat_misses" in e.last_error()
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"HixlAsyncTimeoutMs": "-5"}) != SUCCESS
    assert "HixlAsyncTimeoutMs" in e.last_error()
    e = _engine("tcp", HixlAsyncTimeoutMs=0, HixlHeartbeatMs=0)
    try:
        for bad in (0, -1, 2 ** 31, "5", 1.5):
            rc, req = e.transfer_async("127.0.0.1:1", WRITE, [TransferOpDesc(1, 2, 3)], timeout_in_millis=bad)
            assert (rc, req) == (hixl.PARAM_INVALID, 0), (bad, rc, e.last_error())
    finally:
        e.finalize()
