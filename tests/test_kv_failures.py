"""Failures reach the decoder at once: a prefill whose push fails tells the decoder
(``Hixl.fail_flag``), and a link that closes ends every flag still expected over it; the decoder's
``KVReceiver.wait`` then raises ``TransferFailed`` with the prefill's reason within 100 ms, instead
of waiting for its own timeout. rdma (in the CI VM), shm and tcp.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import hixl
from hixl import SUCCESS
from hixl import kv

TRANSPORTS = [pytest.param("rdma", marks=pytest.mark.rdma), "shm", "tcp"]
LAYOUT = kv.KVLayout(n_layers=4, n_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)
BOUND_S = 0.1  # the decoder's wait ends this soon after the prefill failed


def _engine(transport: str) -> hixl.Hixl:
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"HixlTransport": transport}) == SUCCESS, e.last_error()
    return e


@pytest.fixture(params=TRANSPORTS)
def pd(request):
    rx = kv.KVReceiver(_engine(request.param), LAYOUT, 32)
    tx = kv.KVSender(_engine(request.param), LAYOUT, 32, timeout=30)
    rx.transport = request.param
    yield rx, tx
    tx.close()
    rx.close()
    tx.engine.finalize()
    rx.engine.finalize()


class Waiter(threading.Thread):
    """The decoder's wait(), in a thread: what it raised and when."""

    def __init__(self, rx: kv.KVReceiver, rid: str, timeout: float = 30):
        super().__init__(daemon=True)
        self.rx, self.rid, self.timeout = rx, rid, timeout
        self.error, self.t_end = None, 0.0
        self.start()
        time.sleep(0.05)  # it is blocked in wait() before the failure happens

    def run(self):
        try:
            self.rx.wait(self.rid, self.timeout)
        except Exception as e:  # noqa: BLE001 (the test looks at it)
            self.error = e
        self.t_end = time.monotonic()


def _start(rx, tx, rid, n_tokens=8):
    data = np.random.default_rng(1).standard_normal((n_tokens, LAYOUT.n_kv_heads, LAYOUT.head_dim)).astype(np.float32)
    tx.allocate(rid, n_tokens)
    tx.add_target(rid, rx.allocate(rid, n_tokens, prefill=tx.engine.local_engine))
    for layer in range(LAYOUT.n_layers):
        tx.store(rid, layer, data, data)
    tx.push(rid, 0)
    tx.flush(rid, 30)  # layer 0 landed: the request is mid-push


def test_a_push_that_fails_ends_the_decoders_wait_at_once_with_the_prefills_reason(pd):
    rx, tx = pd
    _start(rx, tx, "r")
    w = Waiter(rx, "r")
    free_before = rx.free_blocks
    # The prefill's own KV memory goes away: its next push is refused before anything is posted
    # (deterministic; the decoder's memory going away would race with the prefill's region cache).
    tx.pool.close()
    t_fail = time.monotonic()
    with pytest.raises(kv.TransferFailed):
        tx.push("r", range(1, LAYOUT.n_layers))
    w.join(10)
    assert isinstance(w.error, kv.TransferFailed), w.error
    assert "will not come" in str(w.error) and "failed request 'r'" in str(w.error)
    assert "local range is not inside a registered region" in str(w.error)  # the prefill's own reason
    assert w.t_end - t_fail < BOUND_S, "the decoder learned %.3f s after the prefill" % (w.t_end - t_fail)
    assert rx.engine.get_link_info(tx.engine.local_engine)[0] == SUCCESS  # the link stays
    assert rx.free_blocks >= free_before  # the slot's blocks went back (nothing more can land)
    assert rx.take_failed() == {}  # wait() reported it


def test_a_prefill_that_closes_its_link_mid_push_ends_the_decoders_wait_at_once(pd):
    rx, tx = pd
    _start(rx, tx, "r")
    w = Waiter(rx, "r")
    t_fail = time.monotonic()
    assert tx.engine.disconnect(rx.engine.local_engine, 5000) == SUCCESS
    w.join(10)
    assert isinstance(w.error, kv.TransferFailed), w.error
    assert "the link to its prefill closed" in str(w.error) and "peer disconnected" in str(w.error)
    assert w.t_end - t_fail < BOUND_S, "the decoder learned %.3f s after the prefill" % (w.t_end - t_fail)


def test_a_failure_for_another_prefills_slot_or_a_stale_ticket_is_ignored(pd):
    rx, tx = pd
    _start(rx, tx, "r")
    g = rx.grant("r")
    other = _engine(rx.transport)
    try:
        assert other.connect(rx.engine.local_engine, 5000) == SUCCESS, other.last_error()
        assert other.fail_flag(rx.engine.local_engine, g.ticket, "not mine") == SUCCESS
        assert tx.engine.fail_flag(rx.engine.local_engine, g.ticket + 1000, "stale") == SUCCESS
        time.sleep(0.2)
        assert rx.poll() == [] and rx.take_failed() == {}
        assert not rx.is_complete("r")
        # The slot still completes normally.
        tx.push("r", range(1, LAYOUT.n_layers))
        tx.flush("r", 30)
        rx.wait("r", 30)
    finally:
        other.finalize()


def test_fail_flag_and_poll_flag_failures_on_the_engine(pd):
    rx, tx = pd
    a, b = tx.engine, rx.engine
    assert a.connect(b.local_engine, 5000) in (SUCCESS, hixl.ALREADY_CONNECTED)
    assert a.fail_flag(b.local_engine, 7, "why not") == SUCCESS
    assert b.wait_flags(5000) == (SUCCESS, [])  # woken by the failure, no flag
    assert b.poll_flag_failures() == (SUCCESS, [(a.local_engine, 7, "why not")])
    assert b.poll_flag_failures() == (SUCCESS, [])
    assert a.fail_flag(b.local_engine, -1, "x") == hixl.PARAM_INVALID
    assert a.fail_flag("127.0.0.1:1", 1, "x") == hixl.NOT_CONNECTED
    assert a.fail_flag(b.local_engine, 1, "y" * 10000) == SUCCESS  # cut to 4096 bytes
    deadline = time.monotonic() + 5
    rows = []
    while not rows and time.monotonic() < deadline:
        rows = b.poll_flag_failures()[1]
        time.sleep(0.01)
    assert rows and len(rows[0][2]) == 4096
    # A link that closes: (peer, -1, why) on the other end.
    assert a.disconnect(b.local_engine, 5000) == SUCCESS
    deadline = time.monotonic() + 5
    rows = []
    while not rows and time.monotonic() < deadline:
        rows = b.poll_flag_failures()[1]
        time.sleep(0.01)
    assert rows and rows[0][0] == a.local_engine and rows[0][1] == -1 and "closed" in rows[0][2]
