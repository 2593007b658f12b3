"""Reliability: who may connect.

* ``HixlAuthToken`` / ``HIXL_AUTH_TOKEN``: matching tokens connect and transfer; a missing or wrong
  token is refused with FAILED before anything of the listener is revealed (checked on the raw bytes
  a bare TCP client receives); a client with a token refuses a server without one, and a server that
  cannot prove the token; a recorded session replayed byte for byte is refused.
* The listener binds only the address it was given.
* Hostile handshake frames (truncated, oversized, wrong magic/version, garbage, slowloris) are refused
  without a crash, and the listener keeps serving others meanwhile.

One suite over rdma (rxe0 in the CI VM), shm and tcp (host) where the transport matters.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct
import threading
import time

import numpy as np
import pytest

import hixl
from hixl import (FAILED, NOT_CONNECTED, READ, RESOURCE_EXHAUSTED, SUCCESS, UNSUPPORTED, WRITE, MemDesc,
                   TransferOpDesc)
from hixl import _core

from .helpers import listen_port as _port
from .helpers import (ACCEPT, AUTH_CHALLENGE, AUTH_HELLO, AUTH_PROOF, CONNECT, HDR, LOGS_WARN, MAGIC, NOTIFY,
                      REFUSE, TCP_BIT, TRANSPORTS, RecordingRelay)

HOST_TRANSPORTS = ["shm", "tcp"]
SIZE = 1 << 16
TOKEN = "correct horse battery staple 7c1e4b0d9f2a"
HANDSHAKE_TIMEOUT_S = 5.0  # engine::Options::handshake_timeout_ms


# ------------------------------------------------------------------------------ helpers
@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("HIXL_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("HIXL_TRANSPORT", raising=False)


@pytest.fixture
def make():
    made = []

    def _make(transport="tcp", token=None, addr="127.0.0.1:0"):
        opts = {"HixlTransport": transport}
        if token is not None:
            opts["HixlAuthToken"] = token
        e = hixl.Hixl()
        assert e.initialize(addr, opts) == SUCCESS, e.last_error()
        made.append(e)
        return e

    yield _make
    for e in reversed(made):
        e.finalize()


def _buffers(a, b):
    abuf = np.zeros(SIZE, np.uint8)
    bbuf = np.random.default_rng(5).integers(0, 256, SIZE, dtype=np.uint8)
    assert a.register_mem(MemDesc(abuf.ctypes.data, SIZE))[0] == SUCCESS, a.last_error()
    assert b.register_mem(MemDesc(bbuf.ctypes.data, SIZE))[0] == SUCCESS, b.last_error()
    return abuf, bbuf


def _transfers(a, b, abuf, bbuf):
    """b writes its buffer into a's, then reads a changed half back."""
    w = [TransferOpDesc(bbuf.ctypes.data, abuf.ctypes.data, SIZE)]
    assert b.transfer_sync(a.local_engine, WRITE, w, 20000) == SUCCESS, b.last_error()
    np.testing.assert_array_equal(abuf, bbuf)
    abuf[: SIZE // 2] = 3
    r = [TransferOpDesc(bbuf.ctypes.data, abuf.ctypes.data, SIZE // 2)]
    assert b.transfer_sync(a.local_engine, READ, r, 20000) == SUCCESS, b.last_error()
    assert (bbuf[: SIZE // 2] == 3).all()


def frame(ftype, payload=b"", version=None, magic=MAGIC, plen=None, reserved=0):
    v = _core.WIRE_VERSION if version is None else version
    return HDR.pack(magic, v, ftype, len(payload) if plen is None else plen, reserved) + payload


def pstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<I", len(b)) + b


def connect_payload(name="127.0.0.1:1", offers=TCP_BIT, boot_id="x" * 36, regions=0, pid=4242):
    """A Connect frame's payload as control.h documents it (no queue pair, no extents, no regions; link id
    0x11; no fence; no further queue pairs)."""
    return (struct.pack("<IIQQ", 0, offers, 0x1234, 1) + pstr(name) + pstr(boot_id) +
            struct.pack("<IQQ", pid, 0, 0) + struct.pack("<I", 0) + struct.pack("<I", 0) +
            struct.pack("<I", regions) + struct.pack("<Q", 0x11) + struct.pack("<I", 0xFFFFFFFF) +
            struct.pack("<I", 0))


def parse_frames(data):
    out, off = [], 0
    while len(data) - off >= HDR.size:
        magic, _, ftype, plen, _ = HDR.unpack_from(data, off)
        assert magic == MAGIC
        if len(data) - off - HDR.size < plen:
            break
        out.append((ftype, bytes(data[off + HDR.size: off + HDR.size + plen])))
        off += HDR.size + plen
    assert off == len(data), "trailing partial frame"
    return out


def refusal(payload):
    status, n = struct.unpack_from("<II", payload)
    assert len(payload) == 8 + n
    return status, payload[8:].decode()


def raw(port, host="127.0.0.1", source=None, timeout=10.0):
    s = socket.socket()
    try:
        s.settimeout(timeout)
        if source:
            s.bind((source, 0))
        s.connect((host, port))
    except BaseException:
        s.close()
        raise
    return s


def read_all(s, timeout=10.0):
    """Everything the peer sends until it closes (or the timeout)."""
    s.settimeout(timeout)
    data = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        except socket.timeout:
            break
        if not chunk:
            break
        data += chunk
    return data


def read_frame(s, timeout=10.0):
    s.settimeout(timeout)
    buf = b""
    while len(buf) < HDR.size:
        chunk = s.recv(HDR.size - len(buf))
        assert chunk, "peer closed"
        buf += chunk
    _, _, ftype, plen, _ = HDR.unpack(buf)
    payload = b""
    while len(payload) < plen:
        chunk = s.recv(plen - len(payload))
        assert chunk, "peer closed"
        payload += chunk
    return ftype, payload


def mac(token, label, nc, ns):
    return hmac.new(token.encode(), b"hixl-auth-v1 " + label + nc + ns, hashlib.sha256).digest()


def py_client_auth(s, token):
    """The client side of auth/handshake.h in Python (hmac/hashlib: an independent HMAC-SHA-256)."""
    nc = os.urandom(32)
    s.sendall(frame(AUTH_HELLO, struct.pack("<I", 1) + nc))
    t, ns = read_frame(s)
    assert t == AUTH_CHALLENGE and len(ns) == 32
    s.sendall(frame(AUTH_PROOF, mac(token, b"client", nc, ns)))
    t, proof = read_frame(s)
    return t, proof, nc, ns


# ------------------------------------------------------------------ tokens that match
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_matching_tokens_connect_and_transfer(make, transport):
    a = make(transport, TOKEN)
    b = make(transport, TOKEN)
    abuf, bbuf = _buffers(a, b)
    assert b.connect(a.local_engine, 20000) == SUCCESS, b.last_error()
    assert b.get_transport(a.local_engine) == (SUCCESS, transport)
    _transfers(a, b, abuf, bbuf)
    # the other direction over the same link, and a reconnect (new nonces) works too
    assert a.transfer_sync(b.local_engine, READ, [TransferOpDesc(abuf.ctypes.data, bbuf.ctypes.data, 64)],
                           20000) == SUCCESS, a.last_error()
    assert b.disconnect(a.local_engine, 5000) == SUCCESS
    assert b.connect(a.local_engine, 20000) == SUCCESS, b.last_error()
    _transfers(a, b, abuf, bbuf)


def test_python_hmac_completes_the_handshake(make):
    """The C++ HMAC-SHA-256 and the handshake's labels agree with Python's hmac/hashlib."""
    a = make("tcp", TOKEN)
    with raw(_port(a)) as s:
        t, proof, nc, ns = py_client_auth(s, TOKEN)
        assert t == AUTH_PROOF and proof == mac(TOKEN, b"server", nc, ns)
    with raw(_port(a)) as s:
        t, payload, _, _ = py_client_auth(s, TOKEN + "x")
        assert t == REFUSE and refusal(payload) == (FAILED, "authentication failed: wrong HixlAuthToken")


# -------------------------------------------------------------- missing / wrong token
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_missing_or_wrong_token_is_refused(make, transport, capfd):
    a = make(transport, TOKEN)
    abuf = np.zeros(SIZE, np.uint8)
    assert a.register_mem(MemDesc(abuf.ctypes.data, SIZE))[0] == SUCCESS
    none = make(transport)
    wrong = make(transport, "not the token")
    assert none.connect(a.local_engine, 20000) == FAILED
    assert "authentication required" in none.last_error(), none.last_error()
    assert wrong.connect(a.local_engine, 20000) == FAILED
    assert "wrong HixlAuthToken" in wrong.last_error(), wrong.last_error()
    for c in (none, wrong):
        assert a.get_link_info(c.local_engine)[0] == NOT_CONNECTED
        assert c.get_link_info(a.local_engine)[0] == NOT_CONNECTED
        rc = c.transfer_sync(a.local_engine, WRITE, [TransferOpDesc(abuf.ctypes.data, abuf.ctypes.data, 8)], 1000)
        assert rc == NOT_CONNECTED
    # AutoConnect takes the same path
    auto = hixl.Hixl()
    assert auto.initialize("127.0.0.1:0", {"HixlTransport": transport, "AutoConnect": "1",
                                           "HixlAuthToken": "nope"}) == SUCCESS
    src = np.ones(64, np.uint8)
    assert auto.register_mem(MemDesc(src.ctypes.data, 64))[0] == SUCCESS
    assert auto.transfer_sync(a.local_engine, WRITE, [TransferOpDesc(src.ctypes.data, abuf.ctypes.data, 64)],
                              10000) == FAILED
    auto.finalize()
    assert not abuf.any()
    err = capfd.readouterr().err
    assert TOKEN not in err and "not the token" not in err and "nope" not in err
    if LOGS_WARN:
        assert "[hixl WARN] engine %s: refusing the peer at 127.0.0.1:" % a.local_engine in err, err
        assert "authentication required" in err and "wrong HixlAuthToken" in err


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_client_with_token_refuses_a_server_without_one(make, transport):
    server = make(transport)
    client = make(transport, TOKEN)
    assert client.connect(server.local_engine, 20000) == FAILED
    assert "does not authenticate its peers" in client.last_error(), client.last_error()
    assert server.get_link_info(client.local_engine)[0] == NOT_CONNECTED
    with raw(_port(server)) as s:  # what such a server answers an AuthHello with
        s.sendall(frame(AUTH_HELLO, struct.pack("<I", 1) + os.urandom(32)))
        frames = parse_frames(read_all(s))
    assert [t for t, _ in frames] == [REFUSE]
    assert refusal(frames[0][1]) == (UNSUPPORTED, "this engine has no HixlAuthToken: it does not authenticate peers")
    # and a server that has a token connects to a client without one? No: the listener decides.
    assert server.connect(client.local_engine, 20000) == FAILED
    assert "authentication required" in server.last_error()


def test_client_refuses_a_server_that_cannot_prove_the_token(make):
    """Mutual: a fake server that plays along but does not know the token gets no Connect."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    got = {}

    def fake_server():
        conn, _ = lsock.accept()
        with conn:
            t, hello_payload = read_frame(conn)
            got["hello"] = t
            conn.sendall(frame(AUTH_CHALLENGE, os.urandom(32)))
            t, _ = read_frame(conn)
            got["proof"] = t
            conn.sendall(frame(AUTH_PROOF, os.urandom(32)))
            got["after"] = read_all(conn, 10)

    th = threading.Thread(target=fake_server)
    th.start()
    client = make("tcp", TOKEN)
    b = np.zeros(64, np.uint8)
    client.register_mem(MemDesc(b.ctypes.data, 64))
    assert client.connect("127.0.0.1:%d" % lsock.getsockname()[1], 10000) == FAILED
    assert "did not prove it knows our HixlAuthToken" in client.last_error(), client.last_error()
    th.join(20)
    lsock.close()
    assert got["hello"] == AUTH_HELLO and got["proof"] == AUTH_PROOF
    assert got["after"] == b"", "the client sent something after the server failed to prove the token"


# ------------------------------------------------------------------------ env token
def test_token_from_env_and_the_option_wins(make, monkeypatch):
    monkeypatch.setenv("HIXL_AUTH_TOKEN", TOKEN)
    a = make("tcp")          # token from the env
    b = make("tcp")
    abuf, bbuf = _buffers(a, b)
    assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
    _transfers(a, b, abuf, bbuf)
    c = make("tcp", "option token")  # the option wins over the env
    assert c.connect(a.local_engine, 10000) == FAILED and "wrong HixlAuthToken" in c.last_error()
    d = make("tcp", "option token")
    assert c.connect(d.local_engine, 10000) == SUCCESS, c.last_error()
    monkeypatch.setenv("HIXL_AUTH_TOKEN", "")  # empty: no token
    e = make("tcp")
    assert e.connect(a.local_engine, 10000) == FAILED and "authentication required" in e.last_error()


def test_token_option_parsing(monkeypatch):
    T = hixl.types
    rc, p = T.parse_options({"HixlAuthToken": "s3cr3t-value"})
    assert rc == SUCCESS and p.auth_token == "s3cr3t-value"
    assert p.raw == {"HixlAuthToken": "<redacted>"} and p.notes == []
    assert "s3cr3t-value" not in repr(p)
    for bad in ("", "x" * (T.MAX_AUTH_TOKEN_BYTES + 1), "\ud800-s3cr3t"):
        rc, p = T.parse_options({"HixlAuthToken": bad})
        assert rc == hixl.PARAM_INVALID and "HixlAuthToken" in p.error
        assert (bad[:8] not in p.error) if bad else True
    assert T.parse_options({"HixlAuthToken": "é" * 2048})[0] == SUCCESS  # 4096 bytes of UTF-8
    monkeypatch.setenv("HIXL_AUTH_TOKEN", "from-env")
    assert T.parse_options({})[1].auth_token == "from-env"
    assert T.parse_options({"HixlAuthToken": "opt"})[1].auth_token == "opt"
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1", {"HixlAuthToken": ""}) == hixl.PARAM_INVALID
    e.finalize()


# -------------------------------------------------------------- what a refusal reveals
def _only_a_refusal(data, want_text):
    frames = parse_frames(data)
    assert [t for t, _ in frames] == [REFUSE], frames
    status, text = refusal(frames[0][1])
    assert (status, text) == (FAILED, want_text)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_refusal_bytes_reveal_nothing(make, transport):
    a = make(transport, TOKEN)
    open_ = make("tcp")  # control: a listener without a token answers such a Connect
    buf = np.zeros(SIZE, np.uint8)
    for e in (a, open_):
        assert e.register_mem(MemDesc(buf.ctypes.data, SIZE))[0] == SUCCESS
    secret = [struct.pack("<Q", buf.ctypes.data), struct.pack("<Q", SIZE), str(os.getpid()).encode(),
              struct.pack("<I", os.getpid())]
    with open("/proc/sys/kernel/random/boot_id", "rb") as f:
        secret.append(f.read().strip())
    hello = frame(CONNECT, connect_payload(offers=(1 << 1) | (1 << 2) | TCP_BIT))

    # a bare Connect: one Refuse frame, its reason and nothing else
    with raw(_port(a)) as s:
        s.sendall(hello)
        data = read_all(s)
    _only_a_refusal(data, "authentication required (this engine accepts only peers with its HixlAuthToken)")
    for b in secret:
        assert b not in data
    # the auth exchange with a wrong token: a random challenge, then the refusal
    with raw(_port(a)) as s:
        nc = os.urandom(32)
        s.sendall(frame(AUTH_HELLO, struct.pack("<I", 1) + nc))
        t, ns = read_frame(s)
        assert t == AUTH_CHALLENGE and len(ns) == 32
        s.sendall(frame(AUTH_PROOF, mac("wrong", b"client", nc, ns)) + hello)
        data = read_all(s)
    _only_a_refusal(data, "authentication failed: wrong HixlAuthToken")
    for b in secret:
        assert b not in data
    # control: without a token the listener answers the same Connect with its regions
    with raw(_port(open_)) as s:
        s.sendall(frame(CONNECT, connect_payload(offers=TCP_BIT)))
        t, payload = read_frame(s)
    assert t == ACCEPT and secret[0] in payload and secret[1] in payload


# ---------------------------------------------------------------------------- replay
def test_a_recorded_session_replayed_is_refused(make):
    a = make("shm", TOKEN)
    proxy = RecordingRelay(_port(a))
    try:
        b = make("shm", TOKEN)
        via = "127.0.0.1:%d" % proxy.port
        assert b.connect(via, 10000) == SUCCESS, b.last_error()
        assert b.disconnect(via, 5000) == SUCCESS
        time.sleep(0.2)
    finally:
        proxy.close()
    captured = b"".join(proxy.record[0])
    sent = parse_frames(captured)
    assert [t for t, _ in sent][:3] == [AUTH_HELLO, AUTH_PROOF, CONNECT], sent
    # the whole recorded client stream, byte for byte, to the listener again
    with raw(_port(a)) as s:
        s.sendall(captured)
        data = read_all(s)
    frames = parse_frames(data)
    assert [t for t, _ in frames] == [AUTH_CHALLENGE, REFUSE], frames
    assert refusal(frames[1][1]) == (FAILED, "authentication failed: wrong HixlAuthToken")
    assert a.get_link_info(b.local_engine)[0] == NOT_CONNECTED
    # only its Connect frame: refused as unauthenticated
    with raw(_port(a)) as s:
        s.sendall(frame(CONNECT, sent[2][1]))
        _only_a_refusal(read_all(s), "authentication required (this engine accepts only peers with its "
                                     "HixlAuthToken)")


# ------------------------------------------------------------------------ bind address
def _listening_local_addresses(port):
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, st = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and st == "0A":
                out.append(addr)
    return out


def test_listener_binds_only_the_given_address(make):
    a = make("tcp", addr="127.0.0.1:0")
    port = _port(a)
    # bound to 127.0.0.1 only (little-endian hex in /proc/net/tcp), not the wildcard
    assert _listening_local_addresses(port) == ["0100007F"]
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
    with socket.socket() as s:  # the same port on another loopback address is free
        s.bind(("127.0.0.2", port))
        s.listen()
    b = make("tcp")
    assert b.connect("127.0.0.2:%d" % port, 2000) == FAILED
    assert b.connect(a.local_engine, 5000) == SUCCESS
    # and the other way round: an engine on 127.0.0.2 is not reachable on 127.0.0.1
    c = make("tcp", addr="127.0.0.2:0")
    assert c.local_engine.startswith("127.0.0.2:")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", _port(c)), timeout=2).close()


# --------------------------------------------------------------------- hostile frames
def _hostile_cases():
    good = frame(CONNECT, connect_payload())
    return {
        "empty": b"",
        "truncated-header": good[:10],
        "truncated-payload": good[:-5],
        "wrong-magic": frame(CONNECT, connect_payload(), magic=0xDEADBEEF),
        "wrong-version": frame(CONNECT, connect_payload(), version=99),
        "unknown-type": frame(99, b"x" * 8),
        "reserved-set": frame(CONNECT, connect_payload(), reserved=1),
        "not-a-connect": frame(NOTIFY, struct.pack("<Q", 1) + pstr("n") + pstr("m")),
        "region-count-huge": frame(CONNECT, connect_payload(regions=0xFFFFFFFF)),
        "name-len-huge": frame(CONNECT, struct.pack("<IIQQ", 0, TCP_BIT, 1, 1) + struct.pack("<I", 0x7FFFFFFF)),
        "garbage": bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8)),
        "http": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    }


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_hostile_frames_are_refused_and_the_listener_keeps_serving(make, token):
    a = make("tcp", token)
    for name, payload in _hostile_cases().items():
        t0 = time.monotonic()
        with raw(_port(a)) as s:
            if payload:
                s.sendall(payload)
            s.shutdown(socket.SHUT_WR)  # a peer that stops sending: refused now, not at the deadline
            data = read_all(s)
        assert time.monotonic() - t0 < 3, name
        frames = parse_frames(data)
        assert len(frames) <= 1 and all(t == REFUSE for t, _ in frames), (name, frames)
        if frames:
            assert refusal(frames[0][1])[0] == FAILED, name
    # an announced length beyond the limit, or (with a token) anything but an auth frame, is refused
    # by its header alone, without waiting for the payload
    cases = [frame(CONNECT, plen=0xFFFFFFFF)]
    if token:
        cases.append(frame(CONNECT, plen=_core.WIRE_MAX_PAYLOAD))
        cases.append(frame(AUTH_HELLO, plen=_core.WIRE_MAX_PAYLOAD))
    for hdr in cases:
        t0 = time.monotonic()
        with raw(_port(a)) as s:
            s.sendall(hdr)
            t, payload = read_frame(s, timeout=3)
        assert t == REFUSE and refusal(payload)[0] == FAILED
        assert time.monotonic() - t0 < 2
    b = make("tcp", token)
    abuf, bbuf = _buffers(a, b)
    assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
    _transfers(a, b, abuf, bbuf)


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_slowloris_does_not_stall_other_handshakes(make, token):
    a = make("tcp", token)
    hello = frame(AUTH_HELLO if token else CONNECT, struct.pack("<I", 1) + os.urandom(32) if token
                  else connect_payload())
    slow = [raw(_port(a)) for _ in range(8)]
    stop = threading.Event()

    def dribble():  # one byte every 0.4 s: a frame would take longer than the handshake deadline
        i = 0
        while not stop.is_set() and i < len(hello):
            for s in slow:
                try:
                    s.send(hello[i:i + 1])
                except OSError:
                    pass
            i += 1
            stop.wait(0.4)

    th = threading.Thread(target=dribble)
    th.start()
    t_open = time.monotonic()
    try:
        time.sleep(0.5)
        b = make("tcp", token)
        abuf, bbuf = _buffers(a, b)
        t0 = time.monotonic()
        assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
        assert time.monotonic() - t0 < 2.0, "a slow client stalled another handshake"
        _transfers(a, b, abuf, bbuf)
        # the server gives up on each slow client at its handshake deadline
        for s in slow:
            data = read_all(s, timeout=HANDSHAKE_TIMEOUT_S + 5)
            assert time.monotonic() - t_open < HANDSHAKE_TIMEOUT_S + 4
            frames = parse_frames(data)
            assert [t for t, _ in frames] == [REFUSE] and refusal(frames[0][1])[0] == FAILED
    finally:
        stop.set()
        th.join()
        for s in slow:
            s.close()


def test_a_linked_peer_sending_slowly_does_not_delay_handshakes(make):
    """A peer that completed its handshake (no token here) and then sends half a control frame: handshakes
    run on threads of their own and go on meanwhile (that the progress thread, and so the other links,
    go on too is reliability/test_half_frame.py's)."""
    a = make("tcp")
    with raw(_port(a)) as s:
        s.sendall(frame(CONNECT, connect_payload(name="127.0.0.1:1", offers=TCP_BIT)))
        t, _ = read_frame(s)
        assert t == ACCEPT
        s.sendall(frame(2))  # READY
        t, _ = read_frame(s)
        assert t == 2
        s.sendall(frame(NOTIFY, struct.pack("<Q", 1) + pstr("n") + pstr("m"))[:7])  # never finished
        time.sleep(0.3)
        b = make("tcp")
        t0 = time.monotonic()
        assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
        assert time.monotonic() - t0 < 1.0, "a linked peer's slow frame delayed a handshake"


def test_one_address_cannot_hold_every_handshake_slot(make):
    a = make("tcp")
    idle = [raw(_port(a), source="127.0.0.2") for _ in range(40)]
    try:
        time.sleep(0.5)
        refused = []
        for s in idle:
            r, _, _ = select.select([s], [], [], 0.05)
            if r:
                t, payload = read_frame(s, timeout=2)
                assert t == REFUSE
                refused.append(refusal(payload)[0])
        assert refused == [RESOURCE_EXHAUSTED] * 8, refused  # 32 per address at most
        # another address is served at once
        b = make("tcp")
        t0 = time.monotonic()
        assert b.connect(a.local_engine, 10000) == SUCCESS, b.last_error()
        assert time.monotonic() - t0 < 2.0
    finally:
        for s in idle:
            s.close()
    # the slots come back when those peers go away
    deadline = time.monotonic() + 5
    while True:
        with raw(_port(a), source="127.0.0.2") as s:
            s.sendall(b"nonsense-nonsense")
            t, payload = read_frame(s, timeout=3)
        if refusal(payload)[0] == FAILED:
            break
        assert time.monotonic() < deadline, "slots were not released"
        time.sleep(0.1)
