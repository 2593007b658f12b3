"""Reliability: a linked peer that stops reading its control connection.

The engine's one progress thread answers every link's frames (notify acks, pongs, region lists). Its
replies go to a bounded per-link queue, written when the socket takes them: a peer that asks and
never reads fills only its own queue. The other links' frames go on at once, and the silent reader's
link is closed once none of its queue could be written for 5 s (ControlOut::kStallBound in
control_out.h), naming the cause; the old engine blocked the progress thread up to 1 s per reply, holding up every link.

As in test_half_frame.py, the peer is a real engine behind a relay: once the link is up, the relay
stops reading what the engine sends on that control connection and writes many region-list requests
(each answered with the whole list: ~50 KB here) into it. rdma (rxe0 in the CI VM), shm and tcp.
"""
from __future__ import annotations

import fcntl
import struct
import termios
import threading
import time

import numpy as np
import pytest

from hixl import SUCCESS, TIMEOUT, MemDesc, NotifyDesc
from hixl import _core

from .helpers import HDR, LOGS_WARN, MAGIC, TRANSPORTS, HalfFrameRelay
from .helpers import engine as _engine, linked as _linked, until as _until

REGIONS_REQ = 10     # wire.h
N_REGIONS = 2000     # a's region list: ~48 KB (rdma, tcp) or ~96 KB (shm: memfd extents too)
N_REQUESTS = 300     # ~15-30 MB of replies: more than both sockets' buffers hold
STALL_BOUND_S = 0.5  # another link's notify round trip while the reader is stalled (old: up to 1 s)


def _regions_req(seq: int) -> bytes:
    return HDR.pack(MAGIC, _core.WIRE_VERSION, REGIONS_REQ, 8, 0) + struct.pack("<Q", seq)


class StallRelay(HalfFrameRelay):
    """A HalfFrameRelay that, once stalled, reads nothing more the target sends on the control
    connection (the client's engine never sees it, as if its process stopped reading)."""

    def __init__(self, target_port):
        self.stalled = threading.Event()
        super().__init__(target_port)

    def pump(self, src, dst, sink=None):  # noqa: D102 (Relay.pump, made stallable)
        """Forwards src to dst; a stream of frames (the control connection) is forwarded frame by
        frame, so that a stall leaves the client with whole frames only (a half frame would have
        its own engine close the link after 2 s, which is not what this test is about)."""
        buf, framed = b"", None
        try:
            while True:
                d = src.recv(65536)
                if not d:
                    break
                if framed is None:
                    framed = len(d) >= 4 and struct.unpack_from("<I", d)[0] == MAGIC
                if not framed:
                    dst.sendall(d)
                    continue
                buf += d
                while len(buf) >= HDR.size and len(buf) >= HDR.size + HDR.unpack_from(buf)[3]:
                    n = HDR.size + HDR.unpack_from(buf)[3]
                    while self.stalled.is_set() and src is self.control and not self.stop.is_set():
                        time.sleep(0.01)  # a whole frame is where the client's engine stops reading
                    dst.sendall(buf[:n])
                    buf = buf[n:]
                    if self.stalled.is_set() and src is self.control:
                        break
                while self.stalled.is_set() and src is self.control and not self.stop.is_set():
                    time.sleep(0.01)  # and nothing more is read from the target meanwhile
        except OSError:
            pass
        self.end_input(dst)

    def wait_backed_up(self, timeout_s=20.0):
        """Once stalled: returns when what the target sent and nobody read stopped growing (its socket
        and ours are full, so the target queues the rest), at least 0.5 s after the call."""
        t0, last, same = time.monotonic(), -1, 0
        while time.monotonic() - t0 < timeout_s:
            time.sleep(0.1)
            unread = struct.unpack("i", fcntl.ioctl(self.control, termios.FIONREAD, b"\0" * 4))[0]
            same = same + 1 if unread == last and unread > 0 else 0
            last = unread
            if same >= 3 and time.monotonic() - t0 >= 0.5:
                return
        raise AssertionError("the target's replies did not back up within %.0f s" % timeout_s)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_peer_that_stops_reading_holds_up_no_other_link_and_its_link_is_closed(transport, capfd):
    a, b, c = _engine(transport), _engine(transport), _engine(transport)
    relay = StallRelay(int(a.local_engine.rsplit(":", 1)[1]))
    buf = np.zeros(N_REGIONS * 4096, np.uint8)
    try:
        for i in range(N_REGIONS):  # a's region list, sent whole with every reply below
            assert a.register_mem(MemDesc(buf.ctypes.data + 4096 * i, 4096))[0] == SUCCESS, a.last_error()
        assert c.connect(a.local_engine, 20000) == SUCCESS, c.last_error()
        via = "127.0.0.1:%d" % relay.port
        assert b.connect(via, 20000) == SUCCESS, b.last_error()
        _until(lambda: _linked(a, b.local_engine), 10, "a's end of the link to b")
        assert b.send_notify(via, NotifyDesc("before", "x"), 10000) == SUCCESS, b.last_error()

        relay.stalled.set()
        relay.inject(b"".join(_regions_req(1000 + i) for i in range(N_REQUESTS)))
        stalled = time.monotonic()
        relay.wait_backed_up()  # a has read the requests; its replies fill the sockets, then its queue
        backed, worst, rounds = time.monotonic(), 0.0, 0
        while time.monotonic() - backed < 3.0:  # well inside the 5 s bound: b's link is still up
            t0 = time.monotonic()
            assert c.send_notify(a.local_engine, NotifyDesc("n%d" % rounds, "m"), 10000) == SUCCESS, c.last_error()
            assert a.send_notify(c.local_engine, NotifyDesc("back", "m"), 10000) == SUCCESS, a.last_error()
            worst = max(worst, time.monotonic() - t0)
            rounds += 1
            a.get_notifies(), c.get_notifies()
            time.sleep(0.02)
        assert _linked(a, b.local_engine), "b's link closed before the bound"
        assert rounds >= 3, rounds
        assert worst < STALL_BOUND_S, "another link's notifies waited %.2f s behind the silent reader" % worst

        # The silent reader's link goes, with the reason and its own cause; c's stays.
        _until(lambda: not _linked(a, b.local_engine), 20, "a to close the link to the peer that stopped reading")
        closed_after = time.monotonic() - stalled
        assert 4.5 < closed_after < 20, closed_after
        m = a.metrics()
        stalled_count = [s["value"] for s in m["hixl_link_closed_total"] if s["labels"]["cause"] == "stalled"]
        assert stalled_count == [1.0], m["hixl_link_closed_total"]
        assert _linked(a, c.local_engine)
        assert c.send_notify(a.local_engine, NotifyDesc("after", "m"), 10000) == SUCCESS, c.last_error()
        if LOGS_WARN:
            err = capfd.readouterr().err
            assert "the peer stopped reading its control connection" in err, err[-2000:]
    finally:
        relay.stalled.clear()
        relay.close()
        for e in (b, c, a):
            e.finalize()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_notify_to_a_peer_that_stops_reading_ends_at_its_own_deadline(transport):
    """Frames to a peer are queued, never written under a lock: a notify stuck behind the replies the
    silent reader did not read, and a second notify behind it, each end at their own deadline (the
    old engine held the connection for the first sender's frame: the second waited for its 3 s)."""
    a, b = _engine(transport), _engine(transport)
    relay = StallRelay(int(a.local_engine.rsplit(":", 1)[1]))
    buf = np.zeros(N_REGIONS * 4096, np.uint8)
    try:
        for i in range(N_REGIONS):
            assert a.register_mem(MemDesc(buf.ctypes.data + 4096 * i, 4096))[0] == SUCCESS, a.last_error()
        via = "127.0.0.1:%d" % relay.port
        assert b.connect(via, 20000) == SUCCESS, b.last_error()
        _until(lambda: _linked(a, b.local_engine), 10, "a's end of the link to b")
        assert a.send_notify(b.local_engine, NotifyDesc("before", "x"), 10000) == SUCCESS, a.last_error()

        relay.stalled.set()
        relay.inject(b"".join(_regions_req(1000 + i) for i in range(N_REQUESTS)))
        relay.wait_backed_up()  # a's replies fill the sockets, then its queue: the notifies below wait
        first = {}

        def slow_notify():
            t0 = time.monotonic()
            first["rc"] = a.send_notify(b.local_engine, NotifyDesc("first", "m" * 1000), 3000)
            first["took"] = time.monotonic() - t0

        t = threading.Thread(target=slow_notify)
        t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        rc = a.send_notify(b.local_engine, NotifyDesc("second", "m"), 300)
        took = time.monotonic() - t0
        t.join()
        assert rc == TIMEOUT, a.last_error()
        # Behind the first sender's frame it would take the rest of that one's 3 s (about 2.8 s).
        assert took < 2.0, "a 300 ms notify took %.2f s behind another sender's frame" % took
        assert first["rc"] == TIMEOUT and 2.9 < first["took"] < 6.0, first
        assert _linked(a, b.local_engine)  # nothing of either was sent: the stream is whole
    finally:
        relay.stalled.clear()
        relay.close()
        for e in (b, a):
            e.finalize()
