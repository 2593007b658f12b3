"""Reliability: access rights of registered regions, and fork() after registration.

One suite over the three transports: rdma (rxe0 in the CI VM), shm and tcp (host).
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import hixl
from hixl import FAILED, PARAM_INVALID, READ, SUCCESS, WRITE, MemDesc, TransferOpDesc

from .helpers import engine as _engine


SIZE = 1 << 20


@pytest.fixture
def pair(transport):
    a, b = _engine(transport), _engine(transport)
    abuf = np.arange(SIZE, dtype=np.uint32).view(np.uint8)[:SIZE].copy()
    bbuf = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    yield a, b, abuf, bbuf
    b.finalize()
    a.finalize()


def test_a_read_only_region_is_readable_and_never_written(pair):
    a, b, abuf, bbuf = pair
    rc, h = a.register_mem(MemDesc(abuf.ctypes.data, SIZE), access="ro")
    assert rc == SUCCESS, a.last_error()
    assert b.register_mem(MemDesc(bbuf.ctypes.data, SIZE))[0] == SUCCESS
    assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
    before = abuf.copy()
    w = [TransferOpDesc(bbuf.ctypes.data, abuf.ctypes.data + 64, 4096)]
    assert b.transfer_sync(a.local_engine, WRITE, w, 5000) == PARAM_INVALID
    assert "registered for remote write" in b.last_error(), b.last_error()
    rc, _ = b.transfer_async(a.local_engine, WRITE, w)
    assert rc == PARAM_INVALID
    time.sleep(0.2)
    np.testing.assert_array_equal(abuf, before)
    # the link is still fine, and READ works
    r = [TransferOpDesc(bbuf.ctypes.data, abuf.ctypes.data, SIZE)]
    assert b.transfer_sync(a.local_engine, READ, r, 30000) == SUCCESS, b.last_error()
    np.testing.assert_array_equal(bbuf, abuf)
    # same range with other rights: refused; after deregistering, rw is allowed
    assert a.register_mem(MemDesc(abuf.ctypes.data, SIZE), access="rw")[0] == PARAM_INVALID
    assert "already registered with access 1" in a.last_error()
    assert a.register_mem(MemDesc(abuf.ctypes.data, SIZE), access="ro") == (SUCCESS, h)
    assert a.deregister_mem(h) == SUCCESS
    assert a.register_mem(MemDesc(abuf.ctypes.data, SIZE), access="rw")[0] == SUCCESS
    src = np.full(4096, 7, np.uint8)
    assert b.register_mem(MemDesc(src.ctypes.data, 4096))[0] == SUCCESS
    assert b.transfer_sync(a.local_engine, WRITE, [TransferOpDesc(src.ctypes.data, abuf.ctypes.data, 4096)],
                           10000) == SUCCESS, b.last_error()
    assert (abuf[:4096] == 7).all()


def test_write_only_and_local_only_regions(pair):
    a, b, abuf, bbuf = pair
    half = SIZE // 2
    assert a.register_mem(MemDesc(abuf.ctypes.data, half), access="wo")[0] == SUCCESS
    assert a.register_mem(MemDesc(abuf.ctypes.data + half, half), access="none")[0] == SUCCESS
    assert b.register_mem(MemDesc(bbuf.ctypes.data, SIZE))[0] == SUCCESS
    assert b.connect(a.local_engine, 10000) == SUCCESS
    before = abuf.copy()
    assert b.transfer_sync(a.local_engine, READ, [TransferOpDesc(bbuf.ctypes.data, abuf.ctypes.data, 64)],
                           5000) == PARAM_INVALID
    for op in (READ, WRITE):
        assert b.transfer_sync(a.local_engine, op, [TransferOpDesc(bbuf.ctypes.data, abuf.ctypes.data + half, 64)],
                               5000) == PARAM_INVALID
    assert b.transfer_sync(a.local_engine, WRITE, [TransferOpDesc(bbuf.ctypes.data, abuf.ctypes.data, 64)],
                           5000) == SUCCESS
    np.testing.assert_array_equal(abuf[:64], bbuf[:64])
    np.testing.assert_array_equal(abuf[64:], before[64:])
    # a local-only region is still a source of a's own transfers
    assert a.transfer_sync(b.local_engine, WRITE, [TransferOpDesc(abuf.ctypes.data + half, bbuf.ctypes.data, 64)],
                           5000) == SUCCESS, a.last_error()
    for bad in ("RW", "", None, 3, "rwx"):
        assert a.register_mem(MemDesc(bbuf.ctypes.data, 64), access=bad)[0] == PARAM_INVALID


def test_fork_after_registration_child_gets_a_clear_error_parent_keeps_working(pair):
    a, b, abuf, bbuf = pair
    assert a.register_mem(MemDesc(abuf.ctypes.data, SIZE))[0] == SUCCESS
    assert b.register_mem(MemDesc(bbuf.ctypes.data, SIZE))[0] == SUCCESS
    assert b.connect(a.local_engine, 10000) == SUCCESS
    d = [TransferOpDesc(bbuf.ctypes.data, abuf.ctypes.data, SIZE)]
    assert b.transfer_sync(a.local_engine, WRITE, d, 30000) == SUCCESS
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: every call fails with the reason, nothing hangs, exit is clean
        ok = False
        try:
            os.close(r)
            rc = b.transfer_sync(a.local_engine, WRITE, d, 1000)
            why = b.last_error()
            ok = (rc == FAILED and "fork()" in why and str(os.getppid()) in why
                  and b.register_mem(MemDesc(bbuf.ctypes.data, 64)) == (FAILED, 0)
                  and b.get_notifies() == (FAILED, []) and b.local_engine == "")
            # the C per-request calls (engine.py) are gone from the child's engine too
            ok = (ok and "transfer_async" not in vars(b) and b.transfer_async(a.local_engine, WRITE, d) == (FAILED, 0)
                  and "fork()" in b.last_error())
            b.finalize()
            a.finalize()
            fresh = hixl.Hixl()  # a new engine in the child works
            ok = ok and fresh.initialize("127.0.0.1", {"HixlTransport": "tcp"}) == SUCCESS
            fresh.finalize()
            os.write(w, (b"ok" if ok else ("bad: %d %s" % (rc, why)).encode()))
        finally:
            os._exit(0 if ok else 1)
    os.close(w)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        assert time.monotonic() < deadline, "the forked child hung"
        time.sleep(0.05)
    msg = os.read(r, 4096)
    os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, msg
    # the parent's registered memory still reaches the device: new bytes land, both directions
    bbuf[:] = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
    assert b.transfer_sync(a.local_engine, WRITE, d, 30000) == SUCCESS, b.last_error()
    np.testing.assert_array_equal(abuf, bbuf)
    abuf[:] = 9
    assert b.transfer_sync(a.local_engine, READ, d, 30000) == SUCCESS
    assert (bbuf == 9).all()
