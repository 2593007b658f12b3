"""Reliability: peers that die, long runs, many threads. One suite over rdma (VM), shm and tcp.

Nothing here asserts on speed. The soak tests check that resources stay flat (RSS, open fds,
threads) over 10^5 operations, and every byte that moved is verified.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time

import numpy as np

import hixl
from hixl import (FAILED, NOT_CONNECTED, NOTIFY_FAILED, SUCCESS, TIMEOUT, WRITE, MemDesc, NotifyDesc, TransferOpDesc,
                  TransferStatus)

from .helpers import Peer
from .helpers import engine as _engine, free_port as _free_port


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _settled(before_threads, seconds=1.0):
    """No thread of ours keeps a CPU busy, and the thread count went back (polled for up to 10 s)."""
    deadline = time.monotonic() + 10
    while _threads() > before_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    c0, t0 = _cpu_seconds(), time.monotonic()
    time.sleep(seconds)
    busy = (_cpu_seconds() - c0) / (time.monotonic() - t0)
    return busy, _threads()


def test_peer_killed_during_notifies_then_restarted_on_the_same_address(transport):
    size = 1 << 20
    port = _free_port()
    b = _engine(transport)
    baseline_threads = _threads()
    peer = Peer(transport, size, port)
    try:
        name = peer.info["name"]
        src = np.arange(size, dtype=np.uint64).view(np.uint8)[:size].copy()
        assert b.register_mem(MemDesc(src.ctypes.data, size))[0] == SUCCESS
        assert b.connect(name, 20000) == SUCCESS, b.last_error()
        results, slow = [], []

        def notifier():
            for i in range(100000):
                t0 = time.monotonic()
                rc = b.send_notify(name, NotifyDesc("n", str(i)), 2000)
                if time.monotonic() - t0 > 2.0 + 3.0:
                    slow.append((rc, time.monotonic() - t0))
                if rc != SUCCESS:
                    results.append((rc, b.last_error()))
                    if rc == NOT_CONNECTED or len(results) > 3:
                        return
                time.sleep(0.001)  # well below the 4096 unread notifies the peer accepts

        t = threading.Thread(target=notifier)
        t.start()
        time.sleep(0.3)
        peer.kill()
        t.join(60)
        assert not t.is_alive(), "send_notify hung after the peer was killed"
        assert not slow, "a send_notify outlived its timeout: %r" % slow
        assert results and results[0][0] in (FAILED, NOTIFY_FAILED, TIMEOUT, NOT_CONNECTED), results
        deadline = time.monotonic() + 30
        while b.get_transport(name)[0] == SUCCESS:
            assert time.monotonic() < deadline, "the link to the killed peer stays up"
            time.sleep(0.02)
        busy, threads = _settled(baseline_threads)
        assert busy < 0.25, "something keeps spinning after the peer died (%.0f%% of a CPU)" % (busy * 100)
        assert threads <= baseline_threads, (threads, baseline_threads)

        # The peer comes back on the same address: connect again, and bytes flow.
        peer = Peer(transport, size, port)
        assert peer.info["name"] == name
        assert b.connect(name, 20000) == SUCCESS, b.last_error()
        d = [TransferOpDesc(src.ctypes.data, peer.info["addr"], size)]
        assert b.transfer_sync(name, WRITE, d, 30000) == SUCCESS, b.last_error()
        back = np.zeros(size, np.uint8)
        assert b.register_mem(MemDesc(back.ctypes.data, size))[0] == SUCCESS
        assert b.transfer_sync(name, hixl.READ, [TransferOpDesc(back.ctypes.data, peer.info["addr"], size)],
                               30000) == SUCCESS
        np.testing.assert_array_equal(back, src)
        assert b.send_notify(name, NotifyDesc("back", "again"), 5000) == SUCCESS
    finally:
        peer.kill()
        b.finalize()


def test_an_abandoned_async_request_ends_when_its_peer_dies(transport):
    """Nobody polls the request while the target dies: a later status is FAILED, never WAITING."""
    size = 64 << 20
    peer = Peer(transport, size, 0)
    b = _engine(transport)
    try:
        src = np.ones(size, np.uint8)
        assert b.register_mem(MemDesc(src.ctypes.data, size))[0] == SUCCESS
        assert b.connect(peer.info["name"], 20000) == SUCCESS
        descs = [TransferOpDesc(src.ctypes.data + i * (4 << 20), peer.info["addr"] + i * (4 << 20), 4 << 20)
                 for i in range(16)]
        reqs = []
        for _ in range(8):
            rc, req = b.transfer_async(peer.info["name"], WRITE, descs)
            assert rc == SUCCESS
            reqs.append(req)
        peer.kill()
        for req in reqs:
            rc, st = b.transfer_wait(req, 30000)
            assert st in (TransferStatus.COMPLETED, TransferStatus.FAILED), (rc, st, b.last_error())
    finally:
        peer.kill()
        b.finalize()


# rdma runs in the CI's TCG guest, where a registration (ibv_reg_mr in an emulated kernel) and a
# transfer cost about 40x what they do on the host: a quarter of the cycles there still shows a leak of
# ~700 B per cycle against the 16 MiB bound, and any fd.
SOAK = {"rdma": 25000}


def test_soak_register_deregister_100k_cycles_flat_rss_and_fds(transport):
    total = SOAK.get(transport, 100000)
    a, b = _engine(transport), _engine(transport)
    try:
        bufs = [np.zeros(4096 * (1 + i % 4), np.uint8) for i in range(8)]
        assert b.connect(a.local_engine, 10000) == SUCCESS  # every (de)registration is pushed to b
        def cycles(n):
            for i in range(n):
                buf = bufs[i % 8]
                rc, h = a.register_mem(MemDesc(buf.ctypes.data, buf.size))
                assert rc == SUCCESS, a.last_error()
                assert a.deregister_mem(h) == SUCCESS, a.last_error()
        cycles(5000)  # warm up: allocator arenas, maps, first registrations
        rss0, fds0 = _rss(), _fds()
        cycles(total - 5000)
        grew = _rss() - rss0
        assert _fds() == fds0, (fds0, _fds())
        assert grew < 16 << 20, "RSS grew by %.1f MiB over %d register/deregister cycles" % (grew / 2 ** 20,
                                                                                          total - 5000)
        # the link still works and sees the final (empty + one) region list
        dst = np.zeros(4096, np.uint8)
        src = np.full(4096, 3, np.uint8)
        assert a.register_mem(MemDesc(dst.ctypes.data, 4096))[0] == SUCCESS
        assert b.register_mem(MemDesc(src.ctypes.data, 4096))[0] == SUCCESS
        assert b.transfer_sync(a.local_engine, WRITE, [TransferOpDesc(src.ctypes.data, dst.ctypes.data, 4096)],
                               10000) == SUCCESS, b.last_error()
        assert (dst == 3).all()
    finally:
        b.finalize()
        a.finalize()


@contextlib.contextmanager
def _linked(transport, nbytes):
    """Target engine a with `dst` registered, initiator b with `src`, b connected to a; both finalized after."""
    a, b = _engine(transport), _engine(transport)
    try:
        dst = np.zeros(nbytes, np.uint8)
        src = np.zeros(nbytes, np.uint8)
        assert a.register_mem(MemDesc(dst.ctypes.data, dst.size))[0] == SUCCESS
        assert b.register_mem(MemDesc(src.ctypes.data, src.size))[0] == SUCCESS
        assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
        yield a, b, dst, src
    finally:
        b.finalize()
        a.finalize()


def test_soak_100k_transfers_flat_rss_and_fds_every_byte_checked(transport):
    n, slot = SOAK.get(transport, 100000), 64
    with _linked(transport, 1024 * slot) as (a, b, dst, src):
        name = a.local_engine

        def run(lo, hi):
            for i in range(lo, hi):
                j = i % 1024
                src[j * slot:(j + 1) * slot] = i % 251
                d = [TransferOpDesc(src.ctypes.data + j * slot, dst.ctypes.data + j * slot, slot)]
                assert b.transfer_sync(name, WRITE, d, 10000) == SUCCESS, (i, b.last_error())
                if j == 1023:  # a full sweep landed: check all of it
                    np.testing.assert_array_equal(dst, src)
        run(0, 5000)
        rss0, fds0 = _rss(), _fds()
        run(5000, n)
        grew = _rss() - rss0
        np.testing.assert_array_equal(dst, src)
        assert _fds() == fds0, (fds0, _fds())
        assert grew < 16 << 20, "RSS grew by %.1f MiB over %d transfers" % (grew / 2 ** 20, n - 5000)


def test_eight_threads_share_one_engine(transport):
    per, chunk = 400, 8192
    with _linked(transport, 8 * chunk) as (a, b, dst, src):
        name, errors = a.local_engine, []

        def worker(t):
            try:
                mine = slice(t * chunk, (t + 1) * chunk)
                for i in range(per):
                    src[mine] = (t * 31 + i) % 256
                    d = [TransferOpDesc(src.ctypes.data + t * chunk, dst.ctypes.data + t * chunk, chunk)]
                    if i % 2:
                        rc, req = b.transfer_async(name, WRITE, d)
                        assert rc == SUCCESS, b.last_error()
                        assert b.transfer_wait(req, 30000) == (SUCCESS, TransferStatus.COMPLETED), b.last_error()
                    else:
                        assert b.transfer_sync(name, WRITE, d, 30000) == SUCCESS, b.last_error()
                    assert (dst[mine] == (t * 31 + i) % 256).all(), (t, i)
                    if i % 50 == 0:
                        assert b.send_notify(name, NotifyDesc("t%d" % t, str(i)), 10000) == SUCCESS, b.last_error()
            except BaseException as e:
                errors.append((t, e))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        rc, notes = a.get_notifies()
        assert rc == SUCCESS
        got = sorted((n.name, int(n.notify_msg)) for n in notes)
        assert got == sorted(("t%d" % t, i) for t in range(8) for i in range(0, per, 50))
