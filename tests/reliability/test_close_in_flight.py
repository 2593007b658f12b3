"""Reliability: a link closed while its tcp data path is busy with a read stops that read at once.

A shut-down TCP socket still yields whatever the peer keeps sending. A read in flight used to run to
its end (or its deadline) inside the link's close, and when the engine's heartbeat thread was the one
closing the link, nothing else of the engine's links got a ping meanwhile. Here the peer's control
frames stop reaching us (a relay drops them) while the peer keeps serving a large read.
"""
from __future__ import annotations

import time

import numpy as np

from hixl import READ, SUCCESS, MemDesc, TransferOpDesc, TransferStatus

from .helpers import HalfFrameRelay, MiB
from .helpers import engine as _engine, linked as _linked, until as _until

SIZE = 512 * MiB
BOUND_S, SLOW_PEER_FACTOR = 0.03, 6  # HixlHeartbeatMs=10 x HixlHeartbeatMisses=3; engine/liveness.h


def _read(a, name, dst, src_addr):
    rc, req = a.transfer_async(name, READ, [TransferOpDesc(dst.ctypes.data, src_addr, SIZE)],
                               timeout_in_millis=120000)
    assert rc == SUCCESS, a.last_error()
    return req


def _end(a, req):
    deadline = time.monotonic() + 120
    while True:
        rc, st = a.get_transfer_status(req)
        if rc != SUCCESS or st != TransferStatus.WAITING:
            return time.monotonic(), st
        assert time.monotonic() < deadline, "the read never ended"
        time.sleep(0.002)


def test_a_read_in_flight_ends_when_the_heartbeat_closes_its_link():
    a = _engine("tcp", HixlHeartbeatMs=10, HixlHeartbeatMisses=3)
    b = _engine("tcp")
    relay = HalfFrameRelay(int(a.local_engine.rsplit(":", 1)[1]))
    try:
        src, dst = np.ones(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
        assert b.register_mem(MemDesc(src.ctypes.data, SIZE))[0] == SUCCESS
        assert a.register_mem(MemDesc(dst.ctypes.data, SIZE))[0] == SUCCESS
        assert b.connect("127.0.0.1:%d" % relay.port, 20000) == SUCCESS, b.last_error()
        _until(lambda: _linked(a, b.local_engine), 10, "a's end of the link to b")
        t0 = time.monotonic()
        ended, st = _end(a, _read(a, b.local_engine, dst, src.ctypes.data))
        assert st == TransferStatus.COMPLETED, a.last_error()
        whole = ended - t0
        slow_bound = BOUND_S * SLOW_PEER_FACTOR
        assert whole > 3 * slow_bound, "a %d MiB read took only %.2f s: too short to tell" % (SIZE // MiB, whole)
        req = _read(a, b.local_engine, dst, src.ctypes.data)
        relay.mute()
        t0 = time.monotonic()
        ended, st = _end(a, req)
        took = ended - t0
        print("a %d MiB tcp read takes %.2f s; with the link closed at the slow-peer bound (%.1f s) it ended "
              "after %.2f s, %s" % (SIZE // MiB, whole, slow_bound, took, st))
        assert st == TransferStatus.FAILED
        assert took < slow_bound + 0.5 * (whole - slow_bound), (
            "the read ran on %.2f s after its link was muted (the whole read: %.2f s)" % (took, whole))
    finally:
        relay.close()
        b.finalize()
        a.finalize()
