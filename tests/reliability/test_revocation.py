"""Reliability: deregistration is a fence, and a stalled peer holds nothing of anyone else's.

- A peer process WRITEs into our region in a loop while we call deregister_mem: once it returned, we
  zero the region and watch it; no byte of the peer's may land afterwards, on any transport and for
  memory a same-host peer maps (hixl.acl's memfds) or reaches by cross-memory attach (any other). The
  WRITE in flight fails with FAILED on every transport (rdma: the remote access error; tcp: the request
  is cut; shm: the peer's copy is refused at the fence).
- A tcp peer stopped (SIGSTOP) in the middle of a WRITE's payload: a deregister_mem of another region
  returns at once (no lock is held while the payload is awaited), and a deregister_mem of the region it
  writes cuts the request and returns at once too; nothing of it lands after, even once it resumes.
"""
from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from hixl import FAILED, PARAM_INVALID, SUCCESS, MemDesc, MemType, acl

from .helpers import TRANSPORTS, Peer
from .helpers import engine as _engine

QUICK_S = 1.0  # what "at once" means here: the old engine waited for the peer for ever


def _timed(fn, bound_s):
    """fn() on a thread: (its result, seconds) if it returned within bound_s, else (None, None)."""
    out = {}

    def run():
        t0 = time.monotonic()
        out["v"] = fn()
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound_s)
    return (out["v"], out["s"]) if "s" in out else (None, None)


def _target_memory(kind, size):
    """numpy memory (same-host peers reach it by cross-memory attach) or hixl.acl memory (a memfd they
    map): (a numpy view, a function that frees it)."""
    if kind == "numpy":
        buf = np.zeros(size, np.uint8)
        return buf, lambda: None
    ret, addr = acl.aclrtMalloc(size, 0)
    assert ret == 0, ret
    buf = np.ctypeslib.as_array(ctypes.cast(addr, ctypes.POINTER(ctypes.c_uint8)), shape=(size,))
    buf[:] = 0
    return buf, lambda: acl.aclrtFree(addr)


@pytest.mark.parametrize("memory", ["numpy", "acl"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_nothing_lands_after_deregister_mem_returns(transport, memory):
    size, rounds = 1 << 20, 3
    e = _engine(transport)
    buf, free = _target_memory(memory, size)
    try:
        for _ in range(rounds):
            rc, handle = e.register_mem(MemDesc(buf.ctypes.data, size), MemType.MEM_HOST)
            assert rc == SUCCESS, e.last_error()
            p = Peer(transport, size, mode=["--write-loop", e.local_engine, str(buf.ctypes.data)])
            try:
                assert p.line() == {"writing": True}
                time.sleep(0.05)  # well inside the loop: a write is in flight at any moment
                rc, took = _timed(lambda: e.deregister_mem(handle), 10)
                assert rc == SUCCESS and took < QUICK_S, (rc, took, e.last_error())
                buf[:] = 0
                landed = []
                t_end = time.monotonic() + 0.3
                while time.monotonic() < t_end:
                    nz = np.flatnonzero(buf)
                    if nz.size:
                        landed.append(int(nz.size))
                        buf[:] = 0
                    time.sleep(0.001)
                assert not landed, "bytes landed %d times after deregister_mem returned (first: %d bytes)" % (
                    len(landed), landed[0])
                # The WRITE in flight when deregister_mem was called fails (FAILED); one the peer starts
                # after it learned of the deregistration is refused before it leaves (PARAM_INVALID).
                end = p.line()
                assert end["writes"] >= 1 and end["rc"] in (FAILED, PARAM_INVALID), end
            finally:
                p.close()
    finally:
        e.finalize()
        free()


def test_a_tcp_peer_stalled_mid_payload_holds_no_other_call():
    size = 256 << 20
    e = _engine("tcp")
    a = np.zeros(size, np.uint8)
    b = np.zeros(4096, np.uint8)
    rc, ha = e.register_mem(MemDesc(a.ctypes.data, size), MemType.MEM_HOST)
    assert rc == SUCCESS, e.last_error()
    rc, hb = e.register_mem(MemDesc(b.ctypes.data, b.size), MemType.MEM_HOST)
    assert rc == SUCCESS, e.last_error()
    p = Peer("tcp", size, mode=["--write-to", e.local_engine, str(a.ctypes.data)])
    try:
        deadline = time.monotonic() + 30
        while not a[1]:  # the first payload bytes landed: the peer is inside the WRITE
            assert time.monotonic() < deadline and p.p.poll() is None, "the peer's WRITE never started"
            time.sleep(0.0005)
        p.stop()  # alive, linked, sending nothing more of this frame
        time.sleep(0.2)  # the socket's queued bytes are drained; our serving thread now waits
        assert not a[-1], "the WRITE finished before the peer stopped: make it bigger"
        rc, took = _timed(lambda: e.deregister_mem(hb), 10)
        assert rc == SUCCESS and took < QUICK_S, "deregister_mem of another region waited %s s for the " \
            "stalled peer (rc %s)" % (took, rc)
        rc, took = _timed(lambda: e.deregister_mem(ha), 10)
        assert rc == SUCCESS and took < QUICK_S, "deregister_mem of the region being written took %s s " \
            "(rc %s)" % (took, rc)
        a[:] = 0
        p.cont()
        end = p.line()
        assert end["rc"] != SUCCESS, end
        time.sleep(0.2)
        assert not np.any(a), "%d bytes landed after deregister_mem returned" % np.count_nonzero(a)
    finally:
        p.close()  # SIGCONT first if still stopped
        e.finalize()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_peer_that_stops_reading_costs_registration_nothing(transport):
    """Each (de)registration sends every linked peer the new region list. A peer stopped (SIGSTOP) reads
    none of them: once its socket is full, the old engine waited up to 1 s in that call (holding the
    lock every other registration needs). Now the update is queued, each call returns at once, and the
    progress thread closes the stalled link after its bound."""
    e = _engine(transport)
    peer = Peer(transport, 4096)
    bufs = [np.zeros(4096, np.uint8) for _ in range(200)]  # a region list of ~6 KiB per update
    try:
        assert e.connect(peer.name, 5000) == SUCCESS, e.last_error()
        for b in bufs:
            assert e.register_mem(MemDesc(b.ctypes.data, b.size), MemType.MEM_HOST)[0] == SUCCESS
        peer.stop()
        spare = np.zeros(4096, np.uint8)
        slowest = 0.0
        for _ in range(400):  # ~5 MiB of updates: well past the socket's buffers
            t0 = time.monotonic()
            rc, h = e.register_mem(MemDesc(spare.ctypes.data, spare.size), MemType.MEM_HOST)
            assert rc == SUCCESS and e.deregister_mem(h) == SUCCESS, e.last_error()
            slowest = max(slowest, time.monotonic() - t0)
        assert slowest < 0.5, "a (de)registration waited %.2f s for a peer that stopped reading" % slowest
    finally:
        peer.close()
        e.finalize()
