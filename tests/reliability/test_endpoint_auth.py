"""Reliability: who may connect to a low-level ``hixl.Endpoint`` (rdma only: rxe0 in the CI VM).

The out-of-band handshake of ``Endpoint.listen/accept/connect_tcp`` takes the same shared secret as
``hixl.Hixl`` (``auth_token=`` / ``HIXL_AUTH_TOKEN``, HMAC-SHA-256 challenge/response, auth/handshake.h):
matching tokens connect and move bytes; a peer without the token, with another one, or a listener
without one is refused with an error that says so; a refused ``accept`` leaves the endpoint listening
and unconnected, and nothing of the listener (QPN, GID, regions, rkeys) is in the bytes a refused
client receives (checked on the raw bytes, with an independent HMAC written in Python).
"""
from __future__ import annotations

import os
import struct
import threading

import numpy as np
import pytest

import hixl
from hixl import FAILED, UNSUPPORTED

from .test_auth import (AUTH_PROOF, REFUSE, frame, parse_frames, py_client_auth, raw, read_all, read_frame,
                        refusal)

pytestmark = pytest.mark.rdma

TOKEN = "endpoint secret 5d0e9a7b31c4"
HELLO = 1  # wire.h FrameType::kHello
SIZE = 1 << 16


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("HIXL_AUTH_TOKEN", raising=False)


@pytest.fixture
def eps():
    made = []

    def _make(**kw):
        ep = hixl.Endpoint(**kw)
        made.append(ep)
        return ep
    yield _make
    for ep in made:
        ep.close()


def _handshake(srv, cli, port=None, timeout_ms=10000):
    """accept() on a thread, connect_tcp() here: (what accept returned or raised, same for connect_tcp)."""
    if port is None:
        port = srv.listen("127.0.0.1", 0)
    out = {}

    def run():
        try:
            out["srv"] = srv.accept(timeout_ms)
        except hixl.HixlError as ex:
            out["srv"] = ex
    t = threading.Thread(target=run)
    t.start()
    try:
        got = cli.connect_tcp("127.0.0.1", port, timeout_ms)
    except hixl.HixlError as ex:
        got = ex
    t.join(timeout_ms / 1000 + 10)
    assert not t.is_alive(), "accept() did not return"
    return out["srv"], got


def _moves_bytes(srv, cli):
    dst = np.zeros(SIZE, np.uint8)
    src = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8)
    md = srv.register(dst)
    ms = cli.register(src)
    cli.wait_ok(cli.write([(ms.addr, md.addr, SIZE)], md.rkey))
    np.testing.assert_array_equal(dst, src)


def test_matching_tokens_connect_and_transfer(eps):
    srv, cli = eps(auth_token=TOKEN), eps(auth_token=TOKEN)
    got_srv, got_cli = _handshake(srv, cli)
    assert isinstance(got_srv, dict) and isinstance(got_cli, dict), (got_srv, got_cli)
    assert got_srv["qpn"] == cli.info()["qpn"] and got_cli["qpn"] == srv.info()["qpn"]
    _moves_bytes(srv, cli)


def test_token_from_env_and_explicit_empty_means_none(eps, monkeypatch):
    monkeypatch.setenv("HIXL_AUTH_TOKEN", TOKEN)
    srv, cli = eps(), eps()  # both from the environment
    got_srv, got_cli = _handshake(srv, cli)
    assert isinstance(got_srv, dict) and isinstance(got_cli, dict), (got_srv, got_cli)
    srv2, cli2 = eps(), eps(auth_token="")  # "" overrides the environment: no token
    got_srv, got_cli = _handshake(srv2, cli2)
    assert isinstance(got_srv, hixl.HixlError) and "authentication required" in str(got_srv)
    assert isinstance(got_cli, hixl.HixlError) and "authentication required" in str(got_cli)


def test_client_without_token_is_refused_and_accept_can_be_retried(eps):
    srv = eps(auth_token=TOKEN)
    port = srv.listen("127.0.0.1", 0)
    got_srv, got_cli = _handshake(srv, eps(), port)
    assert isinstance(got_srv, hixl.HixlError), got_srv
    assert "refused the peer at 127.0.0.1" in str(got_srv) and "authentication required" in str(got_srv)
    assert isinstance(got_cli, hixl.HixlError), got_cli
    assert "peer refused us: authentication required" in str(got_cli)
    # The refused accept left the endpoint listening and unconnected: a peer with the token gets in.
    good = eps(auth_token=TOKEN)
    got_srv, got_cli = _handshake(srv, good, port)
    assert isinstance(got_srv, dict) and got_srv["qpn"] == good.info()["qpn"], got_srv
    _moves_bytes(srv, good)


def test_wrong_token_is_refused_on_both_sides(eps):
    got_srv, got_cli = _handshake(eps(auth_token=TOKEN), eps(auth_token="not the token"))
    assert isinstance(got_srv, hixl.HixlError) and "wrong HixlAuthToken" in str(got_srv), got_srv
    assert isinstance(got_cli, hixl.HixlError) and "refused by the peer" in str(got_cli), got_cli


def test_client_with_token_refuses_a_listener_without_one(eps):
    got_srv, got_cli = _handshake(eps(), eps(auth_token=TOKEN))
    assert isinstance(got_cli, hixl.HixlError) and "does not authenticate its peers" in str(got_cli), got_cli
    assert isinstance(got_srv, hixl.HixlError) and "this endpoint has no auth token" in str(got_srv), got_srv


def _accept_in_background(srv):
    box = {}

    def run():
        try:
            box["r"] = srv.accept(10000)
        except hixl.HixlError as ex:
            box["r"] = ex
    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_refusal_bytes_reveal_nothing(eps):
    """A bare client that sends a Hello without authenticating gets one Refuse frame and nothing else."""
    srv = eps(auth_token=TOKEN)
    dst = np.zeros(SIZE, np.uint8)
    srv.register(dst)
    port = srv.listen("127.0.0.1", 0)
    t, box = _accept_in_background(srv)
    s = raw(port)
    try:
        s.sendall(frame(HELLO, b"\0" * 64))
        data = read_all(s)
    finally:
        s.close()
        t.join(20)
    frames = parse_frames(data)
    assert [f for f, _ in frames] == [REFUSE], frames
    assert refusal(frames[0][1]) == (FAILED, "authentication required (this endpoint accepts only peers with its "
                                             "auth token)")
    assert isinstance(box["r"], hixl.HixlError)


def test_python_hmac_client_gets_the_listener_proof(eps):
    """An independent HMAC-SHA-256 (Python's hmac) completes the exchange: the same protocol as hixl.Hixl."""
    from .test_auth import mac
    srv = eps(auth_token=TOKEN)
    port = srv.listen("127.0.0.1", 0)
    t, box = _accept_in_background(srv)
    s = raw(port)
    try:
        ftype, proof, nc, ns = py_client_auth(s, TOKEN)
        assert ftype == AUTH_PROOF and proof == mac(TOKEN, b"server", nc, ns)
        s.sendall(frame(HELLO, b"\0" * 8))  # now a malformed hello: refused with a Reject, not a crash
        ftype, _ = read_frame(s)
        assert ftype == 3  # FrameType::kReject
    finally:
        s.close()
        t.join(20)
    assert isinstance(box["r"], hixl.HixlError)


def test_unsupported_status_is_what_a_listener_without_token_sends(eps):
    """auth/handshake.h: a listener without a token refuses an AuthHello with UNSUPPORTED."""
    srv = eps()
    port = srv.listen("127.0.0.1", 0)
    t, box = _accept_in_background(srv)
    s = raw(port)
    try:
        s.sendall(frame(16, struct.pack("<I", 1) + os.urandom(32)))  # AuthHello
        ftype, payload = read_frame(s)
    finally:
        s.close()
        t.join(20)
    assert ftype == REFUSE and refusal(payload)[0] == UNSUPPORTED
    assert isinstance(box["r"], hixl.HixlError)
