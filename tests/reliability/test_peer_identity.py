"""Reliability: who a peer is, and how many of them one address may hold.

* A live link is never replaced by a new connection that merely claims its peer's name: without a token
  the claimed name must be on the connection's source address (``HixlTrustClaimedAddress=1`` lifts that
  for NAT), and a claim for a name with a live link is refused unless that link is proven dead (its
  connection closed, or no answer to a ping). A peer that restarted on the same address connects again
  at once.
* Handshake slots cannot be starved: idle connections from many addresses give way to a new one (the
  oldest unauthenticated first), so a peer connects within 2 s under such a flood, with and without a
  token; when every slot is held by a settled handshake the refusal is RESOURCE_EXHAUSTED.
* Bounds: unread notifies per engine (all peers together) and links per source address, each answered
  with RESOURCE_EXHAUSTED beyond it.

Attackers are raw sockets on loopback, bound to 127.0.0.2, 127.0.0.3, ... (valid source addresses on
Linux). The transports matter where a real link is involved (rdma in the CI VM, shm and tcp on the host);
a raw client speaks tcp only.
"""
from __future__ import annotations

import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import hixl
from hixl import (ALREADY_CONNECTED, FAILED, PARAM_INVALID, RESOURCE_EXHAUSTED, SUCCESS, WRITE, MemDesc,
                  NotifyDesc, TransferOpDesc)

from .helpers import listen_port as _port
from .helpers import (ACCEPT, AUTH_PROOF, CONNECT, REFUSE, REPO, TCP_BIT, TRANSPORTS, engine, free_port,
                      until)
from .test_auth import connect_payload, frame, py_client_auth, raw, read_frame, refusal

READY, PING, PONG = 2, 19, 20
TOKEN = "peer identity token 5b9e0c41d7"
SIZE = 1 << 16
MAX_HELD_NOTIFIES = 4 * hixl.MAX_UNREAD_NOTIFIES  # engine::kMaxHeldNotifies
MAX_LINKS_PER_HOST = 64                           # engine::kMaxLinksPerHost
HANDSHAKE_SLOTS, SLOTS_PER_HOST = 256, 32         # engine::kMaxHandshakes, kMaxHandshakesPerHost
with open("/proc/sys/kernel/random/boot_id") as _f:
    BOOT_ID = _f.read().strip()                   # a peer with it runs on this host (pid checked)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("HIXL_AUTH_TOKEN", "HIXL_TRANSPORT", "HIXL_TRUST_CLAIMED_ADDRESS"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def make():
    made = []

    def _make(transport="tcp", token=None, **opts):
        if token:
            opts["HixlAuthToken"] = token
        e = engine(transport, **opts)
        made.append(e)
        return e

    yield _make
    for e in reversed(made):
        e.finalize()


def claim(port, name, source, token=None, **payload):
    """A raw client from `source` claiming `name`: (socket, frame type of the answer, its payload).
    payload: more of connect_payload()'s fields (boot_id, pid)."""
    s = raw(port, source=source)
    if token:
        t, _, _, _ = py_client_auth(s, token)
        assert t == AUTH_PROOF
    s.sendall(frame(CONNECT, connect_payload(name=name, offers=TCP_BIT, **payload)))
    t, payload = read_frame(s)
    return s, t, payload


def link_raw(port, name, source, token=None, **payload):
    """A raw client that completes the handshake as `name`: the linked socket."""
    s, t, payload = claim(port, name, source, token, **payload)
    assert t == ACCEPT, refusal(payload) if t == REFUSE else t
    s.sendall(frame(READY))
    t, _ = read_frame(s)
    assert t == READY
    return s


def refused(t, payload, status, text=""):
    assert t == REFUSE, "accepted (frame type %d) where a refusal was due" % t
    got = refusal(payload)
    assert got[0] == status and text in got[1], got


def _linked_pair(make, transport, token, we_connected):
    """a (auto: a raw client's tcp is one of its transports) linked to b over `transport`."""
    a, b = make("auto", token), make(transport, token)
    abuf, bbuf = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    assert a.register_mem(MemDesc(abuf.ctypes.data, SIZE))[0] == SUCCESS
    assert b.register_mem(MemDesc(bbuf.ctypes.data, SIZE))[0] == SUCCESS
    rc = a.connect(b.local_engine, 20000) if we_connected else b.connect(a.local_engine, 20000)
    assert rc == SUCCESS
    return a, b, abuf, bbuf


def _bytes_reach(a, b, abuf, bbuf, value):
    abuf[:] = value
    d = [TransferOpDesc(abuf.ctypes.data, bbuf.ctypes.data, SIZE)]
    assert a.transfer_sync(b.local_engine, WRITE, d, 20000) == SUCCESS, a.last_error()
    assert (bbuf == value).all(), "the bytes went elsewhere"


# --------------------------------------------------------------------------- peer identity
@pytest.mark.parametrize("we_connected", [True, False], ids=["we-connected", "peer-connected"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_claimed_name_never_replaces_a_live_link(make, transport, we_connected):
    a, b, abuf, bbuf = _linked_pair(make, transport, None, we_connected)
    info = a.get_link_info(b.local_engine)[1]
    # From another address: the name is not the connection's.
    s, t, payload = claim(_port(a), b.local_engine, "127.0.0.3")
    s.close()
    refused(t, payload, FAILED, "not on the address the connection comes from (127.0.0.3)")
    # From b's own address (another process there): b answers pings, so its link stays.
    t0 = time.monotonic()
    s, t, payload = claim(_port(a), b.local_engine, "127.0.0.1")
    s.close()
    refused(t, payload, ALREADY_CONNECTED, "has a live link to " + b.local_engine)
    assert time.monotonic() - t0 < 3.0
    # An invented name on another host: refused as well.
    s, t, payload = claim(_port(a), "127.0.0.9:5555", "127.0.0.3")
    s.close()
    refused(t, payload, FAILED, "not on the address")
    after = a.get_link_info(b.local_engine)[1]
    assert info["transport"] == transport
    assert (after["transport"], after["initiator"]) == (info["transport"], info["initiator"])
    _bytes_reach(a, b, abuf, bbuf, 7)
    assert a.get_link_info("127.0.0.9:5555")[0] != SUCCESS


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_with_a_token_a_member_may_claim_any_name_but_never_a_live_link(make, transport):
    a, b, abuf, bbuf = _linked_pair(make, transport, TOKEN, True)
    # A peer that proved the token is trusted with its name, from any address (NAT) ...
    s, t, payload = claim(_port(a), "127.0.0.9:5555", "127.0.0.3", TOKEN)
    s.close()
    assert t == ACCEPT, refusal(payload) if t == REFUSE else t
    # ... but a live link is not replaced by a claim.
    s, t, payload = claim(_port(a), b.local_engine, "127.0.0.3", TOKEN)
    s.close()
    refused(t, payload, ALREADY_CONNECTED, "live link")
    _bytes_reach(a, b, abuf, bbuf, 9)


def test_trust_claimed_address_lifts_the_address_check_only(make):
    a, b = make("tcp", HixlTrustClaimedAddress="1"), make("tcp")
    abuf, bbuf = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    assert a.register_mem(MemDesc(abuf.ctypes.data, SIZE))[0] == SUCCESS
    assert b.register_mem(MemDesc(bbuf.ctypes.data, SIZE))[0] == SUCCESS
    assert a.connect(b.local_engine, 20000) == SUCCESS
    s, t, payload = claim(_port(a), "127.0.0.9:5555", "127.0.0.3")  # behind NAT: another source address
    s.close()
    assert t == ACCEPT, refusal(payload) if t == REFUSE else t
    s, t, payload = claim(_port(a), b.local_engine, "127.0.0.3")
    s.close()
    refused(t, payload, ALREADY_CONNECTED, "live link")
    _bytes_reach(a, b, abuf, bbuf, 11)
    for bad in ("2", "yes", ""):
        e = hixl.Hixl()
        assert e.initialize("127.0.0.1", {"HixlTrustClaimedAddress": bad}) == PARAM_INVALID
        e.finalize()


def _answer_pings(s, stop):
    """Plays a live peer on a raw link: every Ping gets its Pong."""
    buf = b""
    s.settimeout(0.05)
    while not stop.is_set():
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while len(buf) >= 16:
            ftype, plen = struct.unpack_from("<HI", buf, 6)
            if len(buf) < 16 + plen:
                break
            buf = buf[16 + plen:]
            if ftype == PING:
                s.sendall(frame(PONG))


def test_a_peer_that_comes_back_takes_its_name_at_once_and_a_live_one_keeps_it(make):
    a = make("tcp")
    name = "127.0.0.2:%d" % free_port()
    # The old connection closed: the new one gets the name at once.
    first = link_raw(_port(a), name, "127.0.0.2")
    first.close()
    hung = subprocess.Popen(["sleep", "60"])
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        # It comes back as a peer on this host whose process is stopped (hung) from now on.
        t0 = time.monotonic()
        second = link_raw(_port(a), name, "127.0.0.2", boot_id=BOOT_ID, pid=hung.pid)
        assert time.monotonic() - t0 < 1.0
        # The old connection open but silent, its process stopped: the probe's ping goes unanswered.
        t0 = time.monotonic()
        third = link_raw(_port(a), name, "127.0.0.2")
        assert time.monotonic() - t0 < 3.0
        second.close()
    finally:
        hung.kill()
        hung.wait()
    # The old connection open and silent, but its host acknowledges the ping (another host, as far as a
    # knows: a starved peer, slow not dead, as the heartbeat judges it): it keeps the name.
    t0 = time.monotonic()
    s, t, payload = claim(_port(a), name, "127.0.0.2")
    s.close()
    refused(t, payload, ALREADY_CONNECTED, "its host acknowledges")
    assert time.monotonic() - t0 < 3.0
    # The old connection answering pings: it keeps the name.
    stop = threading.Event()
    th = threading.Thread(target=_answer_pings, args=(third, stop))
    th.start()
    try:
        s, t, payload = claim(_port(a), name, "127.0.0.2")
        s.close()
        refused(t, payload, ALREADY_CONNECTED, "live link")
        assert a.get_transport(name)[0] == SUCCESS
    finally:
        stop.set()
        th.join()
        third.close()


_CONNECT_AND_WAIT = """
import sys, time, hixl
e = hixl.Hixl()
assert e.initialize("127.0.0.1:%s" % sys.argv[1], {"HixlTransport": sys.argv[2]}) == hixl.SUCCESS
t0 = time.monotonic()
rc = e.connect(sys.argv[3], 20000)
print(rc, time.monotonic() - t0, flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_peer_killed_and_restarted_on_its_address_connects_again_at_once(make, transport):
    a = make(transport)
    port = free_port()
    name = "127.0.0.1:%d" % port

    def start():
        p = subprocess.Popen([sys.executable, "-c", _CONNECT_AND_WAIT, str(port), transport, a.local_engine],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(REPO / "tests"))
        rc, took = p.stdout.readline().split()
        return p, int(rc), float(took)

    def kill(p):
        p.kill()
        p.wait(30)
        for f in (p.stdin, p.stdout):
            f.close()

    p, rc, first = start()
    try:
        assert rc == SUCCESS
        until(lambda: a.get_transport(name)[0] == SUCCESS, 10, "the peer's link")
        kill(p)
        p, rc, again = start()
        assert rc == SUCCESS
        assert again < first + 2.0, "the restarted peer's connect took %.2f s, the first %.2f s" % (again, first)
        until(lambda: a.get_transport(name)[0] == SUCCESS, 10, "the restarted peer's link")
    finally:
        kill(p)


# --------------------------------------------------------------------------- handshake slots
class Flood:
    """Idle connections that send nothing, `per_source` from each source address, renewed whenever the
    engine drops or refuses one."""

    def __init__(self, port, sources, per_source):
        self.port = port
        self.socks = [(src, raw(port, source=src)) for src in sources for _ in range(per_source)]
        self.stop = threading.Event()
        self.renewed = 0
        self.th = threading.Thread(target=self._renew, daemon=True)
        self.th.start()

    def _renew(self):
        while not self.stop.is_set():
            p = select.poll()  # not select(): the fds of a process with this many sockets pass 1024
            for _, s in self.socks:
                if s is not None:
                    p.register(s, select.POLLIN)
            ready = {fd for fd, _ in p.poll(50)}
            for i, (src, s) in enumerate(self.socks):
                if self.stop.is_set() or (s is not None and s.fileno() not in ready):
                    continue
                if s is not None:
                    s.close()  # the engine dropped or refused it: a new one takes its place
                try:
                    self.socks[i] = (src, raw(self.port, source=src, timeout=2))
                    self.renewed += 1
                except OSError:
                    self.socks[i] = (src, None)  # tried again next round

    def close(self):
        self.stop.set()
        self.th.join()
        for _, s in self.socks:
            if s is not None:
                s.close()


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_idle_connections_from_many_addresses_do_not_lock_a_peer_out(make, transport, token):
    a, b = make(transport, token), make(transport, token)
    abuf, bbuf = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    assert a.register_mem(MemDesc(abuf.ctypes.data, SIZE))[0] == SUCCESS
    assert b.register_mem(MemDesc(bbuf.ctypes.data, SIZE))[0] == SUCCESS
    t0 = time.monotonic()  # what a connect costs here without a flood (rdma under emulation: much)
    assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
    baseline = time.monotonic() - t0
    assert b.disconnect(a.local_engine, 5000) == SUCCESS
    # 261 idle connections, 29 from each of 9 addresses (under the 32 per address): more than the 256 slots.
    flood = Flood(_port(a), ["127.0.0.%d" % i for i in range(2, 11)], 29)
    try:
        time.sleep(0.5)  # all accepted, every slot taken
        for _ in range(3):  # and again, while the flood renews itself
            t0 = time.monotonic()
            assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
            took = time.monotonic() - t0
            assert took < 2.0 + baseline, "connect took %.2f s under the flood (%.2f s without)" % (took, baseline)
            _bytes_reach(b, a, bbuf, abuf, 5)
            assert b.disconnect(a.local_engine, 5000) == SUCCESS
            time.sleep(0.3)
    finally:
        flood.close()


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_slots_held_by_settled_handshakes_refuse_with_resource_exhausted(make, token):
    a = make("tcp", token)
    held = []
    try:
        # 8 addresses x 32: every slot holds a handshake past its first frame (or its proof), then stalls.
        for i in range(HANDSHAKE_SLOTS // SLOTS_PER_HOST):
            src = "127.0.0.%d" % (i + 2)
            for j in range(SLOTS_PER_HOST):
                s = raw(_port(a), source=src)
                held.append(s)
                if token:
                    assert py_client_auth(s, token)[0] == AUTH_PROOF
                else:
                    s.sendall(frame(CONNECT, connect_payload(name="%s:%d" % (src, j + 1), offers=TCP_BIT)))
                    assert read_frame(s)[0] == ACCEPT  # and no READY: it stalls there
        b = make("tcp", token)
        assert b.connect(a.local_engine, 4000) == RESOURCE_EXHAUSTED, b.last_error()
        assert "too many handshakes" in b.last_error(), b.last_error()
    finally:
        for s in held:
            s.close()
    # the slots come back with the handshakes' deadlines (or their peers' going away)
    until(lambda: b.connect(a.local_engine, 4000) == SUCCESS, 15, "a connect once the slots are free")


# --------------------------------------------------------------------------- bounds
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_unread_notifies_are_bounded_per_engine(make, transport):
    a = make(transport)
    senders = [make(transport) for _ in range(MAX_HELD_NOTIFIES // hixl.MAX_UNREAD_NOTIFIES + 1)]
    for s in senders:
        assert s.connect(a.local_engine, 20000) == SUCCESS, s.last_error()
    counts = {SUCCESS: 0, RESOURCE_EXHAUSTED: 0}
    for s in senders:
        for i in range(hixl.MAX_UNREAD_NOTIFIES):
            rc = s.send_notify(a.local_engine, NotifyDesc("n", "m%d" % i), 5000)
            assert rc in counts, (rc, s.last_error())
            counts[rc] += 1
    assert counts[SUCCESS] == MAX_HELD_NOTIFIES, counts
    assert counts[RESOURCE_EXHAUSTED] == hixl.MAX_UNREAD_NOTIFIES, counts
    rc, got = a.get_notifies()
    assert rc == SUCCESS and len(got) == MAX_HELD_NOTIFIES
    assert senders[-1].send_notify(a.local_engine, NotifyDesc("n", "after reading"), 5000) == SUCCESS


def test_links_per_source_address_are_bounded(make):
    a = make("tcp")
    socks = []
    try:
        for i in range(MAX_LINKS_PER_HOST):
            socks.append(link_raw(_port(a), "127.0.0.2:%d" % (i + 1), "127.0.0.2"))
        s, t, payload = claim(_port(a), "127.0.0.2:%d" % (MAX_LINKS_PER_HOST + 1), "127.0.0.2")
        s.close()
        refused(t, payload, RESOURCE_EXHAUSTED, "links from 127.0.0.2")
        socks.append(link_raw(_port(a), "127.0.0.3:1", "127.0.0.3"))  # another address is not affected
        socks[0].close()  # a link that goes away makes room
        until(lambda: a.get_transport("127.0.0.2:1")[0] != SUCCESS, 10, "the closed link to go")
        socks.append(link_raw(_port(a), "127.0.0.2:%d" % (MAX_LINKS_PER_HOST + 1), "127.0.0.2"))
    finally:
        for s in socks:
            s.close()
