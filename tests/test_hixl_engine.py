"""Two hixl.Hixl engines moving real bytes: one suite, three transports, identical expectations.

Every test runs once per transport: `rdma` (marked `rdma`: rxe0 inside the CI VM), `shm` and
`tcp` (on the host, no device needed). The engines live in this process unless a test needs a
peer process; their control channels use loopback TCP. Every transfer is checked byte for byte,
including the bytes around it.

The same tests run across a real link in the two-host tier (tests/twohost/test_engine_suite.py sets
tests/engine_pair.HOSTS.remote): there each Pair's engine `a` and its buffers live on the other host
(tests/twohost/remote.py), engine `b` here on this host's address; shm, which cannot cross hosts, and the tests marked `onehost`
(they make engines of their own on one host) are left out there.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import hixl
from hixl import (ALREADY_CONNECTED, FAILED, NOT_CONNECTED, PARAM_INVALID, READ, RESOURCE_EXHAUSTED, SUCCESS,
                  TIMEOUT, WRITE, AsyncConnectStatus, GetTransferStatusArgs, MemDesc, MemType, NotifyDesc,
                  TransferArgs, TransferOpDesc, TransferStatus)

from tests.engine_pair import (HOSTS, MiB, Pair, _addr, _engine, _readable, _until, _wait_status,  # noqa: F401
                               pair, transport, transport_name)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("size", [1, 63, 4097, 65537, MiB + 3, 4 * MiB + 1])
def test_write_then_read_back_bytes_verified(pair, size):
    p = pair
    soff, doff = 5, 11
    before = p.abuf.copy()
    d = TransferOpDesc(local_addr=_addr(p.bbuf) + soff, remote_addr=_addr(p.abuf) + doff, len=size)
    assert p.b.transfer_sync(p.a.local_engine, WRITE, [d], 60000) == SUCCESS, p.b.last_error()
    np.testing.assert_array_equal(p.abuf[doff:doff + size], p.bbuf[soff:soff + size])
    np.testing.assert_array_equal(p.abuf[:doff], before[:doff])  # nothing outside the range
    np.testing.assert_array_equal(p.abuf[doff + size:], before[doff + size:])

    # READ it back into a different place of b's buffer.
    p.bbuf[-size:] = 0
    r = TransferOpDesc(local_addr=_addr(p.bbuf) + p.bbuf.size - size, remote_addr=_addr(p.abuf) + doff, len=size)
    assert p.b.transfer_sync(p.a.local_engine, READ, [r], 60000) == SUCCESS, p.b.last_error()
    np.testing.assert_array_equal(p.bbuf[-size:], p.abuf[doff:doff + size])


def test_either_side_transfers_once_connected(pair):
    p = pair
    # a never called connect: it reaches b by b's name over the link b opened.
    assert p.b.local_engine in p.a._engine.peers()
    p.bbuf[:4096] = 0
    p.abuf[:4096] = 0x5A
    d = TransferOpDesc(_addr(p.abuf), _addr(p.bbuf), 4096)
    assert p.a.transfer_sync(p.b.local_engine, WRITE, [d], 10000) == SUCCESS, p.a.last_error()
    assert (p.bbuf[:4096] == 0x5A).all()
    assert p.a.connect(p.b.local_engine, 1000) == ALREADY_CONNECTED
    assert p.b.connect(p.a.local_engine, 1000) == ALREADY_CONNECTED
    assert p.a.get_transport(p.b.local_engine) == (SUCCESS, transport_name())
    rc, info = p.b.get_link_info(p.a.local_engine)
    assert rc == SUCCESS and info["transport"] == transport_name() and info["initiator"]
    assert info["remote_regions"] == 1
    if transport_name() == "rdma":
        assert info["path_mtu"] >= 256 and info["qpn"] and info["remote_qpn"]
        assert info["qps"] == HOSTS.qps and len(set(info["qpns"])) == HOSTS.qps and info["qpns"][0] == info["qpn"]


@pytest.mark.parametrize("qps_a,qps_b,want", [(4, 2, 2), (1, 4, 1), (16, 16, 16)])
def test_a_link_gets_the_smaller_queue_pair_count_of_its_two_ends(qps_a, qps_b, want):
    """HixlRdmaQpsPerLink: an rdma link has as many queue pairs as the end that allows fewer, and requests
    below, at and past the stripe size (64 KiB) land whole, in one descriptor or many, with their flag
    after their bytes. shm and tcp links ignore the option."""
    p = Pair(size=8 * MiB, a_opts={"HixlRdmaQpsPerLink": str(qps_a)}, b_opts={"HixlRdmaQpsPerLink": str(qps_b)})
    try:
        for e, peer in ((p.b, p.a), (p.a, p.b)):
            rc, info = e.get_link_info(peer.local_engine)
            assert rc == SUCCESS, e.last_error()
            if transport_name() == "rdma":
                assert info["qps"] == want and len(set(info["qpns"])) == want, info
        at = 0
        for size in (1, 64 * 1024, 64 * 1024 + 1, 3 * MiB + 5):
            soff, doff = at + 3, at + 7
            d = [TransferOpDesc(_addr(p.bbuf) + soff, _addr(p.abuf) + doff, size)]
            assert p.b.transfer_sync(p.a.local_engine, WRITE, d, 60000) == SUCCESS, p.b.last_error()
            np.testing.assert_array_equal(p.abuf[doff:doff + size], p.bbuf[soff:soff + size], err_msg=str(size))
            at += size + 4096
        # 300 descriptors of 7 KiB (2.1 MiB), reversed on the far side: stripes cut descriptors anywhere
        n, chunk = 300, 7 * 1024
        base = 4 * MiB
        descs = [TransferOpDesc(_addr(p.bbuf) + base + i * chunk, _addr(p.abuf) + base + (n - 1 - i) * chunk, chunk)
                 for i in range(n)]
        assert p.b.transfer_sync(p.a.local_engine, WRITE, descs, 60000) == SUCCESS, p.b.last_error()
        landed = np.asarray(p.abuf[base:base + n * chunk]).reshape(n, chunk)  # one read, if a is remote
        np.testing.assert_array_equal(landed[::-1], p.bbuf[base:base + n * chunk].reshape(n, chunk))
        # and back: a READ of the same, into zeroed memory of b
        p.bbuf[base:base + n * chunk] = 0
        back = [TransferOpDesc(_addr(p.bbuf) + base + i * chunk, _addr(p.abuf) + base + (n - 1 - i) * chunk, chunk)
                for i in range(n)]
        assert p.b.transfer_sync(p.a.local_engine, READ, back, 60000) == SUCCESS, p.b.last_error()
        np.testing.assert_array_equal(p.bbuf[base:base + n * chunk].reshape(n, chunk), landed[::-1])
    finally:
        p.close()


def test_a_descriptor_longer_than_one_work_request_is_sliced_and_lands_whole():
    """HixlRdmaMaxWrBytes: on rdma a descriptor longer than it goes out as several work requests of at most
    that many bytes (the link counts them), and sizes around the boundary land whole, written and read
    back, nothing outside them touched. The option is the sending end's own; shm and tcp ignore it."""
    wr = 4096
    p = Pair(size=4 * MiB, b_opts={"HixlRdmaMaxWrBytes": str(wr)})
    try:
        rc, info = p.b.get_link_info(p.a.local_engine)
        assert rc == SUCCESS, p.b.last_error()
        if transport_name() == "rdma":
            assert info["rdma_max_wr_bytes"] == wr, info
            assert p.a.get_link_info(p.b.local_engine)[1]["rdma_max_wr_bytes"] in (16 * 1024, 4 * MiB)  # defaults
        at = 0
        for size in (1, wr - 1, wr, wr + 1, 3 * wr + 5, MiB + 3):
            soff, doff = at + 3, at + 7
            before = p.abuf.copy()
            posted = p.b.get_link_info(p.a.local_engine)[1].get("posted_wrs", 0)
            d = [TransferOpDesc(_addr(p.bbuf) + soff, _addr(p.abuf) + doff, size)]
            assert p.b.transfer_sync(p.a.local_engine, WRITE, d, 60000) == SUCCESS, p.b.last_error()
            np.testing.assert_array_equal(p.abuf[doff:doff + size], p.bbuf[soff:soff + size], err_msg=str(size))
            np.testing.assert_array_equal(p.abuf[:doff], before[:doff])
            np.testing.assert_array_equal(p.abuf[doff + size:], before[doff + size:])
            if transport_name() == "rdma":
                grew = p.b.get_link_info(p.a.local_engine)[1]["posted_wrs"] - posted
                assert grew >= -(-size // wr), (size, grew)
            p.bbuf[soff:soff + size] = 0
            r = [TransferOpDesc(_addr(p.bbuf) + soff, _addr(p.abuf) + doff, size)]
            assert p.b.transfer_sync(p.a.local_engine, READ, r, 60000) == SUCCESS, p.b.last_error()
            np.testing.assert_array_equal(p.bbuf[soff:soff + size], p.abuf[doff:doff + size], err_msg=str(size))
            at += size + 4096
    finally:
        p.close()


def test_many_descriptors_async_with_user_data(pair):
    p = pair
    n, chunk = 4096, 1024  # 4096 descriptors, scattered (reversed order) on the remote side
    descs = [TransferOpDesc(_addr(p.bbuf) + i * chunk, _addr(p.abuf) + (n - 1 - i) * chunk, chunk) for i in range(n)]
    rc, req1 = p.b.transfer_async(p.a.local_engine, WRITE, descs[: n // 2], TransferArgs(user_data=111))
    assert rc == SUCCESS and req1 != 0, p.b.last_error()
    rc, req2 = p.b.transfer_async(p.a.local_engine, WRITE, descs[n // 2:], TransferArgs(user_data=222))
    assert rc == SUCCESS and req2 not in (0, req1)
    seen = {}
    deadline = time.monotonic() + 120
    while len(seen) < 2:
        rc, results = p.b.get_all_transfer_status(GetTransferStatusArgs(skip_waiting=True))
        assert rc == SUCCESS
        for r in results:
            assert r.status != TransferStatus.WAITING  # skip_waiting
            seen[r.req] = (r.user_data, r.status)
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert seen == {req1: (111, TransferStatus.COMPLETED), req2: (222, TransferStatus.COMPLETED)}
    for i in (0, 1, n // 2, n - 1):
        np.testing.assert_array_equal(p.abuf[(n - 1 - i) * chunk:(n - i) * chunk], p.bbuf[i * chunk:(i + 1) * chunk])
    # Freed after they were reported: the same ids are now unknown.
    assert p.b.get_transfer_status(req1) == (PARAM_INVALID, TransferStatus.FAILED)
    assert p.b.get_all_transfer_status() == (SUCCESS, [])


def test_get_transfer_status_frees_finished_requests(pair):
    p = pair
    rc, req = p.b.transfer_async(p.a.local_engine, WRITE, [TransferOpDesc(_addr(p.bbuf), _addr(p.abuf), MiB)])
    assert rc == SUCCESS
    assert _wait_status(p.b, req) == TransferStatus.COMPLETED
    assert p.b.get_transfer_status(req) == (PARAM_INVALID, TransferStatus.FAILED)
    np.testing.assert_array_equal(p.abuf[:MiB], p.bbuf[:MiB])


def _remote_ranges(p):
    a0, size = _addr(p.abuf), p.abuf.size
    return [
        (a0 + size - 100, 101, "straddles the end of the peer's region"),
        (a0 - 1, 10, "starts before the peer's region"),
        (a0 + size, 1, "just past the peer's region"),
        (a0 + 16 * size, 4096, "nowhere near a peer region"),
    ]


@pytest.mark.parametrize("case", range(4))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_out_of_range_remote_refused_before_anything_is_posted(pair, case, mode):
    p = pair
    p.abuf[:] = 0
    remote, length, _ = _remote_ranges(p)[case]
    # Valid descriptors first: they must not be posted either when a later one is refused.
    descs = [TransferOpDesc(_addr(p.bbuf) + i * 4096, _addr(p.abuf) + i * 4096, 4096) for i in range(8)]
    descs.append(TransferOpDesc(_addr(p.bbuf), remote, length))
    if mode == "sync":
        assert p.b.transfer_sync(p.a.local_engine, WRITE, descs, 5000) == PARAM_INVALID
    else:
        assert p.b.transfer_async(p.a.local_engine, WRITE, descs) == (PARAM_INVALID, 0)
    assert "remote range is not inside a region" in p.b.last_error()
    time.sleep(0.05)
    assert not p.abuf.any(), "a descriptor of a refused call was posted"
    # The link is still good.
    assert p.b.transfer_sync(p.a.local_engine, WRITE, descs[:1], 5000) == SUCCESS
    assert (p.abuf[:4096] == p.bbuf[:4096]).all()


def test_unregistered_local_range_refused(pair):
    p = pair
    other = np.ones(4096, np.uint8)  # never registered
    d = TransferOpDesc(_addr(other), _addr(p.abuf), 4096)
    assert p.b.transfer_sync(p.a.local_engine, WRITE, [d], 5000) == PARAM_INVALID
    assert "local range is not inside a registered region" in p.b.last_error()
    d = TransferOpDesc(_addr(p.bbuf) + p.bbuf.size - 10, _addr(p.abuf), 11)  # one byte past
    assert p.b.transfer_sync(p.a.local_engine, READ, [d], 5000) == PARAM_INVALID


def test_regions_registered_after_connect_are_visible(pair):
    p = pair
    late = p.a_zeros(64 * 1024)
    d = TransferOpDesc(_addr(p.bbuf), _addr(late) + 100, 1000)
    assert p.b.transfer_sync(p.a.local_engine, WRITE, [d], 5000) == PARAM_INVALID  # not registered yet
    rc, h = p.a.register_mem(MemDesc(_addr(late), late.size), MemType.MEM_HOST)
    assert rc == SUCCESS
    assert p.b.transfer_sync(p.a.local_engine, WRITE, [d], 5000) == SUCCESS, p.b.last_error()
    np.testing.assert_array_equal(late[100:1100], p.bbuf[:1000])
    assert not late[:100].any() and not late[1100:].any()
    # Deregistered: once the update reached b, b refuses instead of posting.
    assert p.a.deregister_mem(h) == SUCCESS
    assert p.a.deregister_mem(h) == SUCCESS  # idempotent
    _until(lambda: p.b.get_link_info(p.a.local_engine)[1]["remote_regions"] == 1, what="region update")
    assert p.b.transfer_sync(p.a.local_engine, WRITE, [d], 5000) == PARAM_INVALID


def test_notify_is_seen_only_after_the_transfer_bytes(pair):
    p = pair
    size = 2 * MiB
    seen, errors = [], []
    stop = threading.Event()

    def receiver():
        while not stop.is_set() and len(seen) < 20:
            rc, notes = p.a.get_notifies()
            for n in notes:
                i = int(n.notify_msg)
                digest = hashlib.sha256(p.abuf[:size].tobytes()).hexdigest()
                if n.name != "layer" or digest != expected[i]:
                    errors.append((i, n.name))
                seen.append(i)
            time.sleep(0.001)

    expected = []
    for i in range(20):
        pattern = np.full(size, i + 1, np.uint8)
        pattern[::4097] = 255 - i
        expected.append(hashlib.sha256(pattern.tobytes()).hexdigest())
    t = threading.Thread(target=receiver)
    t.start()
    try:
        for i in range(20):
            p.bbuf[:size] = np.full(size, i + 1, np.uint8)
            p.bbuf[:size:4097] = 255 - i
            if i % 2:
                assert p.b.transfer_sync(p.a.local_engine, WRITE,
                                         [TransferOpDesc(_addr(p.bbuf), _addr(p.abuf), size)], 60000) == SUCCESS
            else:
                rc, req = p.b.transfer_async(p.a.local_engine, WRITE,
                                             [TransferOpDesc(_addr(p.bbuf), _addr(p.abuf), size)])
                assert rc == SUCCESS and _wait_status(p.b, req) == TransferStatus.COMPLETED
            assert p.b.send_notify(p.a.local_engine, NotifyDesc("layer", str(i)), 10000) == SUCCESS
            # Next iteration overwrites abuf: wait until a has looked at this one.
            _until(lambda: len(seen) > i, what="notify %d" % i)
    finally:
        stop.set()
        t.join()
    assert seen == list(range(20))
    assert errors == []


def test_notify_limits_and_backpressure(pair):
    p = pair
    assert p.b.send_notify(p.a.local_engine, NotifyDesc("n" * 1025, "m"), 1000) == PARAM_INVALID
    assert p.b.send_notify(p.a.local_engine, NotifyDesc("n", "m" * 1025), 1000) == PARAM_INVALID
    # The limit is 1024 bytes of UTF-8, as in CANN: 1024 two-byte characters are refused, 512 fit.
    assert p.b.send_notify(p.a.local_engine, NotifyDesc("ü" * 1024, "m"), 5000) == PARAM_INVALID
    assert p.b.send_notify(p.a.local_engine, NotifyDesc("n", "€" * 342), 5000) == PARAM_INVALID
    assert p.b.send_notify(p.a.local_engine, NotifyDesc("ü" * 512, "€" * 341), 5000) == SUCCESS
    rc, notes = p.a.get_notifies()
    assert rc == SUCCESS and notes == [NotifyDesc("ü" * 512, "€" * 341)]
    for i in range(hixl.MAX_UNREAD_NOTIFIES):
        rc = p.b.send_notify(p.a.local_engine, NotifyDesc("k", str(i)), 10000)
        assert rc == SUCCESS, (i, p.b.last_error())
    assert p.b.send_notify(p.a.local_engine, NotifyDesc("k", "over"), 10000) == RESOURCE_EXHAUSTED
    # Reconnecting does not reset the count (nothing was read), and nothing queued was dropped.
    assert p.b.disconnect(p.a.local_engine) == SUCCESS
    assert p.b.connect(p.a.local_engine, 10000) == SUCCESS, p.b.last_error()
    assert p.b.send_notify(p.a.local_engine, NotifyDesc("k", "over"), 10000) == RESOURCE_EXHAUSTED
    rc, notes = p.a.get_notifies()
    assert rc == SUCCESS and [n.notify_msg for n in notes] == [str(i) for i in range(hixl.MAX_UNREAD_NOTIFIES)]
    assert p.b.send_notify(p.a.local_engine, NotifyDesc("k", "again"), 10000) == SUCCESS
    assert p.a.get_notifies() == (SUCCESS, [NotifyDesc("k", "again")])
    # The other direction too (a never called connect).
    assert p.a.send_notify(p.b.local_engine, NotifyDesc("back", "x"), 5000) == SUCCESS
    assert p.b.get_notifies() == (SUCCESS, [NotifyDesc("back", "x")])


@pytest.mark.onehost
def test_auto_connect():
    a = _engine()
    c = _engine({"AutoConnect": "1"}, listen=False)  # client only
    d = _engine()
    try:
        buf = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, np.uint8)
        assert a.register_mem(MemDesc(_addr(dst), dst.size))[0] == SUCCESS
        assert c.register_mem(MemDesc(_addr(buf), buf.size))[0] == SUCCESS
        assert d.register_mem(MemDesc(_addr(buf), buf.size))[0] == SUCCESS
        desc = [TransferOpDesc(_addr(buf), _addr(dst), 4096)]
        assert d.transfer_sync(a.local_engine, WRITE, desc, 5000) == NOT_CONNECTED  # AutoConnect off
        assert c.transfer_sync(a.local_engine, WRITE, desc, 10000) == SUCCESS, c.last_error()
        assert (dst == buf).all()
        assert c.get_async_connect_status(a.local_engine) == (SUCCESS, AsyncConnectStatus.CONNECTED)
        # a reaches the client-only engine by its bare IP name.
        assert a._engine.peers() == [c.local_engine] and c.local_engine == "127.0.0.1"
        assert a.transfer_sync(c.local_engine, READ, [TransferOpDesc(_addr(dst), _addr(buf), 4096)], 5000) == SUCCESS
        # A second client-only engine from the same IP cannot be told apart: refused, c keeps its link.
        c2 = _engine(listen=False)
        try:
            assert c2.connect(a.local_engine, 5000) == ALREADY_CONNECTED
            assert "client-only" in c2.last_error()
        finally:
            c2.finalize()
        assert c.transfer_sync(a.local_engine, WRITE, desc, 5000) == SUCCESS
    finally:
        for e in (c, d, a):
            e.finalize()


@pytest.mark.onehost
def test_connect_async_and_disconnect_async():
    a, b = _engine(), _engine()
    try:
        assert b.get_async_connect_status(a.local_engine) == (SUCCESS, AsyncConnectStatus.NOT_CONNECT)
        assert b.connect_async(a.local_engine, 10000) == SUCCESS
        _until(lambda: b.get_async_connect_status(a.local_engine)[1] == AsyncConnectStatus.CONNECTED,
               what="async connect")
        assert b.get_all_async_connect_status() == (SUCCESS, {a.local_engine: AsyncConnectStatus.CONNECTED})
        # as CANN: the call only queues; a connect over a live link ends CONNECTED
        assert b.connect_async(a.local_engine, 1000) == SUCCESS
        _until(lambda: b.get_async_connect_status(a.local_engine)[1] == AsyncConnectStatus.CONNECTED,
               what="async connect over a live link")
        assert b.disconnect_async(a.local_engine, 1000) == SUCCESS
        _until(lambda: b.get_async_connect_status(a.local_engine)[1] == AsyncConnectStatus.NOT_CONNECT,
               what="async disconnect")
        assert b.get_all_async_connect_status() == (SUCCESS, {})  # ended NOT_CONNECT: no longer listed
        # The peer notices the goodbye too.
        _until(lambda: a._engine.peers() == [], what="peer sees the disconnect")
        assert b.disconnect(a.local_engine) == NOT_CONNECTED
        # Nobody listening: the async connect ends in CONNECT_FAILED.
        dead = _engine()
        addr = dead.local_engine
        dead.finalize()
        assert b.connect_async(addr, 2000) == SUCCESS
        _until(lambda: b.get_async_connect_status(addr)[1] == AsyncConnectStatus.CONNECT_FAILED,
               what="failed async connect")
        assert b.connect(addr, 500) in (FAILED, TIMEOUT)
    finally:
        b.finalize()
        a.finalize()


def test_disconnect_and_reconnect_and_peer_finalize(pair):
    p = pair
    d = [TransferOpDesc(_addr(p.bbuf), _addr(p.abuf), 4096)]
    assert p.b.disconnect(p.a.local_engine) == SUCCESS
    assert p.b.transfer_sync(p.a.local_engine, WRITE, d, 1000) == NOT_CONNECTED
    # Reconnect at once, before a may even have read the goodbye: the new link supersedes the old.
    assert p.b.connect(p.a.local_engine, 10000) == SUCCESS, p.b.last_error()
    assert p.b.transfer_sync(p.a.local_engine, WRITE, d, 5000) == SUCCESS
    assert p.a._engine.peers() == [p.b.local_engine]
    for _ in range(3):  # and again, repeatedly
        assert p.b.disconnect(p.a.local_engine) == SUCCESS
        assert p.b.connect(p.a.local_engine, 10000) == SUCCESS, p.b.last_error()
    assert p.b.transfer_sync(p.a.local_engine, WRITE, d, 5000) == SUCCESS
    name = p.a.local_engine
    p.a.finalize()
    _until(lambda: p.b._engine.peers() == [], what="b notices a finalized")
    assert p.b.transfer_sync(name, WRITE, d, 1000) == NOT_CONNECTED
    assert p.b.send_notify(name, NotifyDesc("x", "y"), 1000) == NOT_CONNECTED
    assert p.b.connect(name, 1000) in (FAILED, TIMEOUT)  # nobody listens there any more


def test_reconnect_in_a_tight_loop_each_link_works_at_once(pair):
    """200 rounds of disconnect, connect at once, transfer at once (from both ends): a connect right after
    a disconnect is never refused ("a handshake ... is in progress"), and the new link is never hit by
    the old one's teardown (tcp: a data connection of the old link attached to the new one)."""
    p = pair
    a_name, b_name = p.a.local_engine, p.b.local_engine
    page = 4096
    slots = p.abuf.size // page // 2
    # Across the two-host tier's TCG link an rdma connect takes ~1 s: fewer rounds there.
    for i in range(200 if HOSTS.remote is None else 40):
        for _ in range(2):  # back to back, then once more with transfers on the link right away
            assert p.b.disconnect(a_name, 1000) == SUCCESS, (i, p.b.last_error())
            assert p.b.connect(a_name, 10000) == SUCCESS, (i, p.b.last_error())
        w = (2 * i % slots) * page  # b WRITEs bbuf[w:w+page] into abuf ...
        p.bbuf[w:w + 8] = np.frombuffer(np.uint64(i * 2 + 1).tobytes(), np.uint8)
        d = [TransferOpDesc(_addr(p.bbuf) + w, _addr(p.abuf) + w, page)]
        assert p.b.transfer_sync(a_name, WRITE, d, 10000) == SUCCESS, (i, p.b.last_error())
        np.testing.assert_array_equal(p.abuf[w:w + page], p.bbuf[w:w + page], err_msg="round %d: b's write" % i)
        r = w + page  # ... and a READs bbuf[r:r+page] over the same link, from its own end
        p.bbuf[r:r + 8] = np.frombuffer(np.uint64(i * 2 + 2).tobytes(), np.uint8)
        d = [TransferOpDesc(_addr(p.abuf) + r, _addr(p.bbuf) + r, page)]
        assert p.a.transfer_sync(b_name, READ, d, 10000) == SUCCESS, (i, p.a.last_error())
        np.testing.assert_array_equal(p.abuf[r:r + page], p.bbuf[r:r + page], err_msg="round %d: a's read" % i)
    assert p.b.disconnect(a_name, 1000) == SUCCESS, p.b.last_error()
    _until(lambda: p.a._engine.peers() == [], what="a sees the last goodbye")


def test_disconnect_succeeds_when_the_peer_closed_the_link_first(pair):
    """The peer's goodbye (disconnect or finalize) may arrive before our own disconnect(): that still
    returns SUCCESS, once; NOT_CONNECTED only when we never connected or already disconnected."""
    p = pair
    a_name, b_name = p.a.local_engine, p.b.local_engine
    assert p.a.disconnect(b_name) == SUCCESS
    _until(lambda: p.b._engine.peers() == [], what="b sees a's goodbye")
    assert p.b.disconnect(a_name) == SUCCESS, p.b.last_error()
    assert p.b.disconnect(a_name) == NOT_CONNECTED
    assert p.a.disconnect(b_name) == NOT_CONNECTED
    # The same through disconnect_async.
    assert p.b.connect(a_name, 10000) == SUCCESS, p.b.last_error()
    assert p.a.disconnect(b_name) == SUCCESS
    _until(lambda: p.b._engine.peers() == [], what="b sees a's goodbye")
    assert p.b.disconnect_async(a_name, 1000) == SUCCESS, p.b.last_error()
    _until(lambda: p.b.get_async_connect_status(a_name) == (SUCCESS, AsyncConnectStatus.NOT_CONNECT),
           what="the async disconnect ends")
    assert p.b.disconnect(a_name) == NOT_CONNECTED
    # A reconnect clears the record: the new link is disconnected normally.
    assert p.b.connect(a_name, 10000) == SUCCESS, p.b.last_error()
    assert p.b.disconnect(a_name) == SUCCESS
    assert p.b.disconnect(a_name) == NOT_CONNECTED
    # The peer finalized (examples/cann_style.py: decode may finalize before prefill's disconnect).
    assert p.b.connect(a_name, 10000) == SUCCESS, p.b.last_error()
    p.a.finalize()
    _until(lambda: p.b._engine.peers() == [], what="b notices a finalized")
    assert p.b.disconnect(a_name) == SUCCESS, p.b.last_error()
    assert p.b.disconnect(a_name) == NOT_CONNECTED


def _sixteenths(p, size):
    """b's buffer onto a's in 16 descriptors."""
    step = size // 16
    return [TransferOpDesc(_addr(p.bbuf) + i * step, _addr(p.abuf) + i * step, step) for i in range(16)]


def test_sync_timeout_lets_no_write_land_afterwards():
    size = HOSTS.big
    p = Pair(size=size)
    try:
        descs = _sixteenths(p, size)
        t0 = time.monotonic()
        rc = p.b.transfer_sync(p.a.local_engine, WRITE, descs, 1)
        returned = time.monotonic() - t0
        assert rc == TIMEOUT, (rc, p.b.last_error())
        snap = p.abuf.copy()
        time.sleep(2.0)  # far longer than the whole request takes to arrive on one host's rxe
        landed = int(np.count_nonzero(snap == p.bbuf))
        print("timeout returned after %.3fs; %d of %d bytes had landed" % (returned, landed, size))
        np.testing.assert_array_equal(p.abuf, snap, err_msg="bytes landed after transfer_sync returned TIMEOUT")
        # The link was torn down on both sides; a fresh connect works and moves the bytes.
        assert p.b.transfer_sync(p.a.local_engine, WRITE, descs[:1], 1000) == NOT_CONNECTED
        _until(lambda: p.a._engine.peers() == [], what="a drops the aborted link")
        assert p.b.connect(p.a.local_engine, 10000) == SUCCESS
        assert p.b.transfer_sync(p.a.local_engine, WRITE, descs, 120000) == SUCCESS, p.b.last_error()
        np.testing.assert_array_equal(p.abuf, p.bbuf)
    finally:
        p.close()


def test_async_deadline_aborts_the_link_and_no_write_lands_afterwards():
    """transfer_async(..., timeout_in_millis=1) with 16 requests of HOSTS.big queued: a request not done
    when the watchdog finds it past its deadline ends TIMEOUT (the live peer confirmed its end stopped),
    never WAITING; the link is aborted on both sides, and no byte lands after the statuses were
    reported."""
    size = HOSTS.big
    p = Pair(size=size)
    try:
        descs = _sixteenths(p, size)
        reqs = []
        for i in range(16):
            rc, req = p.b.transfer_async(p.a.local_engine, WRITE, descs, timeout_in_millis=1)
            if rc != SUCCESS:  # the abort for an earlier request's deadline already began: refused
                assert i > 0 and rc in (FAILED, NOT_CONNECTED), (i, rc, p.b.last_error())
                break
            reqs.append(req)
        ended = [p.b.transfer_wait(req, 30000) for req in reqs]
        assert all(rc == SUCCESS for rc, _ in ended), (ended, p.b.last_error())
        sts = [st for _, st in ended]
        # FAILED: a request whose link an earlier request's abort had already closed when the watchdog
        # looked at it. Never WAITING.
        assert TransferStatus.WAITING not in sts, sts
        if transport_name() == "tcp":  # 16 requests of HOSTS.big through TCP outlast a watchdog tick
            assert TransferStatus.TIMEOUT in sts, sts
        if TransferStatus.TIMEOUT in sts:
            snap = p.abuf.copy()
            time.sleep(1.0)
            np.testing.assert_array_equal(p.abuf, snap, err_msg="bytes landed after the requests ended TIMEOUT")
            assert p.b.transfer_sync(p.a.local_engine, WRITE, descs[:1], 1000) == NOT_CONNECTED
            _until(lambda: p.a._engine.peers() == [], what="a drops the aborted link")
            assert p.b.connect(p.a.local_engine, 10000) == SUCCESS, p.b.last_error()
        elif TransferStatus.FAILED in sts:  # aborted, unconfirmed: the link is gone all the same
            _until(lambda: p.b.get_transport(p.a.local_engine)[0] != SUCCESS, what="b drops the aborted link")
            assert p.b.connect(p.a.local_engine, 10000) == SUCCESS, p.b.last_error()
        assert p.b.transfer_sync(p.a.local_engine, WRITE, descs, 120000) == SUCCESS, p.b.last_error()
        np.testing.assert_array_equal(p.abuf, p.bbuf)
    finally:
        p.close()


@pytest.mark.onehost
def test_device_memory_from_the_acl_shim_and_options():
    from hixl import acl
    opts = {"RdmaTrafficClass": "32", "RdmaServiceLevel": "1", "BufferPool": "4:8", "LocalCommRes": "{}",
            "HixlRdmaTimeout": "12", "HixlRdmaRetryCount": "5"}
    a, b = _engine(opts), _engine(opts)
    ptrs = []
    try:
        size = 2 * MiB
        rc, pa = acl.aclrtMalloc(size, acl.ACL_MEM_MALLOC_HUGE_FIRST)
        assert rc == acl.ACL_SUCCESS
        rc, pb = acl.aclrtMalloc(size, acl.ACL_MEM_MALLOC_NORMAL_ONLY)
        assert rc == acl.ACL_SUCCESS
        ptrs = [pa, pb]
        assert acl.aclrtMemset(pb, size, 0x3C, size) == acl.ACL_SUCCESS
        assert a.register_mem(MemDesc(pa, size), MemType.MEM_DEVICE)[0] == SUCCESS, a.last_error()
        assert b.register_mem(MemDesc(pb, size), MemType.MEM_DEVICE)[0] == SUCCESS, b.last_error()
        assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
        for e, peer in ((b, a), (a, b)):
            rc, info = e.get_link_info(peer.local_engine)
            assert rc == SUCCESS and info["transport"] == transport_name()
            if transport_name() == "rdma":
                assert (info["traffic_class"], info["service_level"]) == (32, 1)
                assert (info["rdma_timeout"], info["rdma_retry_count"]) == (12, 5)
        assert b.transfer_sync(a.local_engine, WRITE, [TransferOpDesc(pb, pa, size)], 30000) == SUCCESS
        host = np.zeros(size, np.uint8)
        assert acl.aclrtMemcpy(_addr(host), size, pa, size, acl.ACL_MEMCPY_DEVICE_TO_HOST) == acl.ACL_SUCCESS
        assert (host == 0x3C).all()
    finally:
        b.finalize()
        a.finalize()
        for ptr in ptrs:
            acl.aclrtFree(ptr)


def test_concurrent_transfers_from_threads(pair):
    p = pair
    n_threads, per = 4, 25
    chunk = 64 * 1024
    errors = []

    def worker(t):
        for i in range(per):
            off = (t * per + i) * chunk
            d = [TransferOpDesc(_addr(p.bbuf) + off, _addr(p.abuf) + off, chunk)]
            rc = p.b.transfer_sync(p.a.local_engine, WRITE, d, 60000)
            if rc != SUCCESS:
                errors.append((t, i, rc, p.b.last_error()))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    total = n_threads * per * chunk
    np.testing.assert_array_equal(p.abuf[:total], p.bbuf[:total])


@pytest.mark.onehost
def test_cann_style_example_runs():
    env = dict(os.environ, HIXL_TRANSPORT=transport_name())
    out = subprocess.run([sys.executable, str(REPO / "examples" / "cann_style.py")], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "example OK" in out.stdout


def test_two_threads_polling_one_request_never_see_a_false_failure(pair):
    p = pair
    for _ in range(5):
        rc, req = p.b.transfer_async(p.a.local_engine, WRITE, [TransferOpDesc(_addr(p.bbuf), _addr(p.abuf), MiB)])
        assert rc == SUCCESS
        seen = []

        def poll():
            while True:
                r = p.b.get_transfer_status(req)
                if r != (SUCCESS, TransferStatus.WAITING):
                    seen.append(r)
                    return

        threads = [threading.Thread(target=poll) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Exactly one poller gets the completion; the other finds the request already freed.
        assert sorted(seen) == sorted([(SUCCESS, TransferStatus.COMPLETED), (PARAM_INVALID, TransferStatus.FAILED)])


def test_requests_in_flight_when_the_peer_disconnects_end_failed_not_waiting(pair):
    p = pair
    # Far more work requests than the send queue holds: the posting thread is still waiting for
    # send-queue room when the peer's goodbye closes the link under it.
    descs = [TransferOpDesc(_addr(p.bbuf) + (i % 4096) * 2048, _addr(p.abuf) + (i % 4096) * 2048, 2048)
             for i in range(40000)]
    reqs, refused = [], []

    def post():
        for _ in range(2):
            rc, req = p.b.transfer_async(p.a.local_engine, WRITE, descs)
            if rc == SUCCESS:
                reqs.append(req)
            else:  # the close was noticed while posting: FAILED (or NOT_CONNECTED once the link is gone)
                refused.append((rc, req))

    t = threading.Thread(target=post)
    t.start()
    time.sleep(0.05)
    assert p.a.disconnect(p.b.local_engine) == SUCCESS
    t.join(120)
    assert not t.is_alive()
    statuses = [_wait_status(p.b, r, timeout_s=60) for r in reqs]
    print("statuses after the peer left:", statuses, "refused:", refused)
    assert all(rc in (FAILED, NOT_CONNECTED) and req == 0 for rc, req in refused), refused
    assert all(s in (TransferStatus.COMPLETED, TransferStatus.FAILED) for s in statuses), statuses
    _until(lambda: p.b._engine.peers() == [], what="b drops the link")
    assert p.b.get_all_transfer_status() == (SUCCESS, [])


@pytest.mark.onehost
def test_target_killed_mid_transfer_gives_failed_within_the_timeout():
    size = 64 * MiB
    peer = subprocess.Popen([sys.executable, str(REPO / "tests" / "engine_peer.py"), transport_name(), str(size)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    b = _engine()
    try:
        info = json.loads(peer.stdout.readline())
        src = np.ones(size, np.uint8)
        assert b.register_mem(MemDesc(_addr(src), size))[0] == SUCCESS
        assert b.connect(info["name"], 20000) == SUCCESS, b.last_error()
        descs = [TransferOpDesc(_addr(src) + i * 4 * MiB, info["addr"] + i * 4 * MiB, 4 * MiB) for i in range(16)]
        assert b.transfer_sync(info["name"], WRITE, descs, 60000) == SUCCESS, b.last_error()
        threading.Timer(0.2, peer.kill).start()
        codes = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            rc = b.transfer_sync(info["name"], WRITE, descs, 20000)
            if rc != SUCCESS:
                codes.append(rc)
                if rc == NOT_CONNECTED:
                    break
        elapsed = time.monotonic() - t0
        print("after the kill: %s (%s) in %.2fs" % (codes, b.last_error(), elapsed))
        assert codes, "transfers kept succeeding to a killed peer"
        # The transfer in flight when the peer died fails (FAILED); later ones find the link gone.
        assert codes[0] in (FAILED, NOT_CONNECTED), codes
        assert FAILED in codes or codes == [NOT_CONNECTED]
        assert elapsed < 40
        _until(lambda: b._engine.peers() == [], what="the link to the killed peer goes away")
        rc, req = b.transfer_async(info["name"], WRITE, descs[:1])
        assert rc == NOT_CONNECTED and req == 0
    finally:
        peer.kill()
        peer.wait()
        peer.stdin.close()
        peer.stdout.close()
        b.finalize()


# ------------------------------------------------------------------ completion flags (beyond CANN)
@pytest.mark.parametrize("last", ["async", "sync"])
def test_flag_arrives_only_after_every_byte_of_the_earlier_requests(last):
    """Three async WRITEs of a quarter of HOSTS.big each (long enough that the fourth is submitted while
    they run), then a fourth (async or sync) carrying the flag: the moment the target sees the flag,
    every byte is already in its memory (RDMA: WRITE_WITH_IMM on the same QP; shm/tcp: the flag frame
    follows the bytes of every earlier request on the link, a flagged sync request queueing behind
    the async ones)."""
    chunk = HOSTS.big // 4
    p = Pair(size=4 * chunk)
    try:
        _flags_after_bytes(p, chunk, last)
    finally:
        p.close()


def _flags_after_bytes(p, chunk, last):
    for rnd in range(3):
        p.bbuf[:] = np.random.default_rng(rnd).integers(0, 256, p.bbuf.size, dtype=np.uint8)
        seen = {}

        def receiver():  # checks the bytes at once, in another thread than the writer
            seen["flags"] = p.a.wait_flags(30000)
            seen["equal"] = bool(np.array_equal(p.abuf, p.bbuf))

        t = threading.Thread(target=receiver)
        t.start()
        reqs = []
        for i in range(4):
            d = [TransferOpDesc(_addr(p.bbuf) + i * chunk, _addr(p.abuf) + i * chunk, chunk)]
            flag = (1000 + rnd) if i == 3 else None
            if i == 3 and last == "sync":
                assert p.b.transfer_sync(p.a.local_engine, WRITE, d, 30000, flag=flag) == SUCCESS, p.b.last_error()
                continue
            rc, req = p.b.transfer_async(p.a.local_engine, WRITE, d, flag=flag)
            assert rc == SUCCESS, p.b.last_error()
            reqs.append(req)
        t.join(60)
        assert not t.is_alive()
        assert seen["flags"] == (SUCCESS, [(p.b.local_engine, 1000 + rnd)]), p.a.last_error()
        assert seen["equal"], "the flag arrived before every byte of the earlier requests had landed"
        for req in reqs:
            assert p.b.transfer_wait(req, 20000) == (SUCCESS, TransferStatus.COMPLETED), p.b.last_error()
    assert p.a.poll_flags() == (SUCCESS, [])


def test_flag_on_a_sync_write_and_the_three_ways_to_wait(pair):
    p = pair
    a, name = p.a, p.b.local_engine
    d = [TransferOpDesc(_addr(p.bbuf), _addr(p.abuf), 4096)]
    # 1. timeout: nothing pending -> empty after roughly the timeout, not before.
    t0 = time.monotonic()
    assert a.wait_flags(200) == (SUCCESS, [])
    assert time.monotonic() - t0 >= 0.15
    # 2. the event fd: not readable, then readable once a flag is pending, not after poll_flags().
    fd = a.flag_fd()
    assert fd >= 0
    assert not _readable(fd, 0)
    assert p.b.transfer_sync(p.a.local_engine, WRITE, d, 10000, flag=2 ** 32 - 1) == SUCCESS, p.b.last_error()
    assert _readable(fd, 10)
    # 3. polling
    assert a.poll_flags() == (SUCCESS, [(name, 2 ** 32 - 1)])
    assert not _readable(fd, 0)
    # blocking with no limit, woken by a write from another thread
    threading.Timer(0.2, lambda: p.b.transfer_sync(p.a.local_engine, WRITE, d, 10000, flag=5)).start()
    assert a.wait_flags(None) == (SUCCESS, [(name, 5)])


def test_flag_refused_on_read_or_out_of_range(pair):
    p = pair
    d = [TransferOpDesc(_addr(p.bbuf), _addr(p.abuf), 64)]
    assert p.b.transfer_sync(p.a.local_engine, READ, d, 1000, flag=1) == PARAM_INVALID
    assert "flag" in p.b.last_error()
    for bad in (-1, 2 ** 32, True, "1", 1.0):
        assert p.b.transfer_async(p.a.local_engine, WRITE, d, flag=bad) == (PARAM_INVALID, 0), bad
    assert p.a.wait_flags(100) == (SUCCESS, [])


def test_transfer_wait_blocks_until_done_and_reports_once(pair):
    p = pair
    d = [TransferOpDesc(_addr(p.bbuf), _addr(p.abuf), 8 * MiB)]
    rc, req = p.b.transfer_async(p.a.local_engine, WRITE, d)
    assert rc == SUCCESS
    assert p.b.transfer_wait(req, 30000) == (SUCCESS, TransferStatus.COMPLETED), p.b.last_error()
    np.testing.assert_array_equal(p.abuf, p.bbuf)
    rc, st = p.b.transfer_wait(req, 10)
    assert rc == PARAM_INVALID and st == TransferStatus.FAILED  # already reported
    assert p.b.transfer_wait("x", 10)[0] == PARAM_INVALID


def test_wait_notifies_blocks_until_one_arrives(pair):
    p = pair
    t0 = time.monotonic()
    assert p.a.wait_notifies(150) == (SUCCESS, [])
    assert time.monotonic() - t0 >= 0.1
    threading.Timer(0.2, lambda: p.b.send_notify(p.a.local_engine, NotifyDesc("n", "m"), 5000)).start()
    rc, got = p.a.wait_notifies(20000)
    assert rc == SUCCESS and [(n.name, n.notify_msg) for n in got] == [("n", "m")]
