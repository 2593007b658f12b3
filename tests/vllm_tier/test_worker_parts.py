"""The worker's two parts on their own: a :class:`~hixl.vllm.producer.Producer` and a
:class:`~hixl.vllm.consumer.Consumer` over real hixl engines (tcp) and KV pools of their own, with a fake
:class:`~hixl.vllm.links.Links` that records what they send, post and submit (jobs run when the test
says). No worker, no inbox or jobs thread, no torch: the messages each part gives the link and the
failures it reports are checked directly.

The modules import vLLM (``hixl.vllm`` does on import), hence the vLLM tier."""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

import numpy as np
import pytest

pytest.importorskip("vllm")

import hixl  # noqa: E402
from hixl import SUCCESS, kv  # noqa: E402
from hixl.vllm.cache import CacheGroups  # noqa: E402
from hixl.vllm.config import ConnectorConfig  # noqa: E402
from hixl.vllm.consumer import Consumer  # noqa: E402
from hixl.vllm.metadata import HixlConnectorMetadata, LoadSpec, SendStep  # noqa: E402
from hixl.vllm.producer import Producer  # noqa: E402
from hixl.vllm.stats import Recorder  # noqa: E402

pytestmark = pytest.mark.vllm

LAYOUT = kv.KVLayout(n_layers=3, n_kv_heads=2, head_dim=4, dtype="float32", block_tokens=4)
BLOCKS = 8
INTERIOR = "float32:test"
PREFILL = "192.0.2.1:5000"  # a prefill the consumer never reaches: the fake link answers for it
N_TOKENS = 7                # two blocks


class FakeLinks:
    """Links that record what a part asks of them. ``linked`` peers are up; ``ensure_link`` links a
    peer; ``send`` raises ConnectionError(``fail_send``) when set; submitted jobs wait for
    :meth:`run_jobs`."""

    def __init__(self, linked=()):
        self.peers = set(linked)
        self.sent, self.posted, self.jobs, self.disconnected = [], [], [], []
        self.fail_send = None
        self.describe = None  # (peer, nonce) -> None: answers a describe (the test's stand-in peer)

    def linked(self, peer):
        return peer in self.peers

    def ensure_link(self, peer):
        self.peers.add(peer)

    def send(self, peer, kind, tid, payload="", connect=True):
        if self.fail_send is not None:
            raise ConnectionError(self.fail_send)
        if connect:
            self.ensure_link(peer)
        self.sent.append((peer, kind, tid, payload))
        if kind == "describe" and self.describe is not None:
            self.describe(peer, tid)

    def post(self, peer, kind, tid, payload=""):
        self.posted.append((peer, kind, tid, payload))

    def submit(self, job):
        self.jobs.append(job)

    def disconnect(self, peer):
        self.disconnected.append(peer)
        self.peers.discard(peer)

    def run_jobs(self):
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()


class Rig:
    """Engines with a KV pool each; the parts made on them; all closed in reverse order."""

    def __init__(self):
        self._closers = []

    def side(self, seed=None):
        e = hixl.Hixl()
        assert e.initialize("127.0.0.1:0", {"HixlTransport": "tcp"}) == SUCCESS, e.last_error()
        self._closers.append(e.finalize)
        pool = kv.KVPool(e, LAYOUT, BLOCKS, memory="host")
        self._closers.append(pool.close)
        if seed is not None:
            pool.bytes[:] = np.random.default_rng(seed).integers(0, 256, pool.nbytes, dtype=np.uint8)
        return e, pool

    def producer(self, links, seed=1, **cfg):
        e, pool = self.side(seed)
        p = Producer(engine=e, pool=pool, groups=CacheGroups.single(LAYOUT, pool.memory, INTERIOR),
                     config=ConnectorConfig(**cfg), stats=Recorder(), links=links)
        self._closers.append(p.close)
        return p, e, pool

    def consumer(self, links, **cfg):
        e, pool = self.side()
        c = Consumer(engine=e, pool=pool, groups=CacheGroups.single(LAYOUT, pool.memory, INTERIOR),
                     config=ConnectorConfig(**cfg), stats=Recorder(), links=links)
        self._closers.append(c.rx.close)
        return c, e, pool

    def close(self):
        for c in reversed(self._closers):
            c()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def _until(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout} s")


def _load(blocks=(5, 6), mode="push", source=None, peer=PREFILL):
    return HixlConnectorMetadata(loads={"d": LoadSpec(transfer_id="t", mode=mode, peer=peer, blocks=list(blocks),
                                                      first_block=0, n_tokens=N_TOKENS, source=source)})


def _prefill(p, tid="t", blocks=(1, 2)):
    """One vLLM step computing the whole prompt of request "r" (``tid``), every layer."""
    p.begin_step(HixlConnectorMetadata(sends={"r": SendStep(tid, list(blocks), N_TOKENS, 0, len(blocks), True)}))
    for layer in range(LAYOUT.n_layers):
        p.layer_done(layer)
    p.end_step()


def _grant(c, links, prefill=PREFILL):
    """The consumer's grant for load "d" (transfer "t") from ``prefill`` as its link sent it (after the
    jobs ran): (payload, grant)."""
    c.start(_load(peer=prefill))
    assert links.sent == []  # only the jobs thread sends
    links.run_jobs()
    [(peer, kind, tid, payload)] = links.sent
    assert (peer, kind, tid) == (prefill, "grant", "t")
    d = json.loads(payload)
    return d, kv.Grant.from_dict(d["grant"])


def _finished(c, timeout=10.0):
    """Steps the consumer's get_finished until load "d" ended: whether it failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended, failed = c.finished(set(), False)
        if ended:
            assert ended == {"d"}
            return "d" in failed
        time.sleep(0.01)
    raise AssertionError(f"load d not ended within {timeout} s")


# ------------------------------------------------------------------------------------ producer
def test_the_producer_pushes_a_requests_blocks_to_the_decoder_its_grant_names(rig):
    plinks, dlinks = FakeLinks(), FakeLinks()
    p, p_engine, p_pool = rig.producer(plinks)
    c, d_engine, d_pool = rig.consumer(dlinks)
    d, g = _grant(c, dlinks, p_engine.local_engine)  # the flag must come from the prefill the load names
    [group] = g.group_grants(LAYOUT)
    assert d["groups"][0]["interior"] == INTERIOR and g.decode == d_engine.local_engine and group.blocks == (5, 6)
    plinks.peers.add(g.decode)  # the decoder's grant came over its link
    p.on_grant("t", d)  # before the prefill: claimed by its first step, pushed layer by layer
    _prefill(p)
    assert _finished(c) is False
    for layer in range(LAYOUT.n_layers):
        for part in range(2):  # K, V: the prompt's tokens (the last block is partly used)
            assert d_pool.gather(layer, part, [5, 6], N_TOKENS).tobytes() == \
                p_pool.gather(layer, part, [1, 2], N_TOKENS).tobytes()  # random bytes: NaNs among them
            assert not d_pool.unit(layer, part, 4).any()  # a neighbour stays untouched
    assert _until(lambda: p.finished({"r"})) == {"r"}
    assert plinks.posted == []  # delivered: nothing to tell the decoder
    assert len(p.stats.take().data["send_bytes"]) == 1
    assert c.stats.take().data["recv_tokens"] == [N_TOKENS]


def test_an_idle_prefill_step_waits_for_the_decoders_grant_instead_of_spinning(rig):
    """Blocks held for a grant keep vLLM stepping: an idle step waits (up to idle_wait_ms) for the
    grant instead of returning at once, and the grant ends that wait early."""
    plinks, dlinks = FakeLinks(), FakeLinks()
    p, p_engine, _ = rig.producer(plinks, idle_wait_ms=200)
    c, _, _ = rig.consumer(dlinks)
    _prefill(p)  # computed and finished: its blocks are held for a grant that has not come
    assert p.finished({"r"}) == set()
    t0 = time.monotonic()
    for _ in range(3):
        assert p.finished(set(), True) == set()
    idle = time.monotonic() - t0
    t0 = time.monotonic()
    for _ in range(3):
        assert p.finished(set(), False) == set()  # a step that computes something never waits
    busy = time.monotonic() - t0
    assert idle >= 3 * 0.2 * 0.9 and busy < 0.1, (idle, busy)
    d, g = _grant(c, dlinks, p_engine.local_engine)
    plinks.peers.add(g.decode)
    threading.Timer(0.3, p.on_grant, ("t", d)).start()
    p.config = dataclasses.replace(p.config, idle_wait_ms=5000)
    t0 = time.monotonic()
    while not p.finished(set(), True):  # the grant wakes the wait; the push then completes the send
        assert time.monotonic() - t0 < 4.0, "the grant did not end the idle step's wait"
    assert time.monotonic() - t0 < 4.0
    assert _finished(c) is False


def test_a_grant_from_a_decoder_without_a_link_fails_and_the_decoder_hears_why(rig):
    dlinks = FakeLinks()
    c, _, _ = rig.consumer(dlinks)
    d, g = _grant(c, dlinks)
    plinks = FakeLinks()  # the decoder went away
    p, _, _ = rig.producer(plinks)
    p.on_grant("t", d)
    _prefill(p)
    assert _until(lambda: p.finished({"r"})) == {"r"}
    [(peer, kind, tid, why)] = plinks.posted
    assert (peer, kind, tid) == (g.decode, "abort", "t")
    assert f"no link to the decoder {g.decode}" in why
    assert p.stats.take().data["send_failed"] == 1


def test_a_grant_for_another_block_interior_is_aborted_through_the_link(rig):
    dlinks = FakeLinks()
    c, _, _ = rig.consumer(dlinks)
    d, g = _grant(c, dlinks)
    plinks = FakeLinks(linked={g.decode})
    p, _, _ = rig.producer(plinks)
    p.on_grant("t", dict(d, groups=[dict(d["groups"][0], interior="float32:packed(9, 9, 9)")]))
    [(peer, kind, tid, why)] = plinks.posted
    assert (peer, kind, tid) == (g.decode, "abort", "t")
    assert INTERIOR in why and "float32:packed(9, 9, 9)" in why
    assert not p.needs_ticks()  # not kept


def test_a_malformed_grant_is_aborted_to_the_decoder_it_names(rig):
    plinks = FakeLinks()
    p, _, _ = rig.producer(plinks)
    p.on_grant("t", {"grant": {"decode": "192.0.2.7:1"}, "interior": INTERIOR})
    [(peer, kind, tid, why)] = plinks.posted
    assert (peer, kind, tid) == ("192.0.2.7:1", "abort", "t") and why.startswith("malformed grant")


def test_a_cancel_before_the_grant_is_confirmed_at_once_and_a_late_grant_aborted(rig):
    dlinks = FakeLinks()
    c, _, _ = rig.consumer(dlinks)
    d, g = _grant(c, dlinks)
    plinks = FakeLinks(linked={g.decode})
    p, _, _ = rig.producer(plinks)
    p.on_cancel("t", json.dumps({"decode": g.decode, "why": "timed out"}))
    assert plinks.posted == [(g.decode, "cancelled", "t", "")]
    p.on_grant("t", d)
    assert plinks.posted[1][:3] == (g.decode, "abort", "t")
    assert "cancelled by the decoder (timed out)" in plinks.posted[1][3]


def test_an_unclaimed_grant_expires_after_the_lease(rig):
    dlinks = FakeLinks()
    c, _, _ = rig.consumer(dlinks)
    d, g = _grant(c, dlinks)
    plinks = FakeLinks(linked={g.decode})
    p, _, _ = rig.producer(plinks, lease_s=0.1)
    p.on_grant("t", d)
    assert p.needs_ticks() and plinks.posted == []
    p.tick()
    assert plinks.posted == []  # within the lease
    time.sleep(0.15)
    p.tick()
    [(peer, kind, tid, why)] = plinks.posted
    assert (peer, kind, tid) == (g.decode, "abort", "t") and "within the lease (0.1 s)" in why
    assert not p.needs_ticks()


# ------------------------------------------------------------------------------------ consumer
def test_the_consumer_cancels_what_the_scheduler_says_through_the_link(rig):
    links = FakeLinks()
    c, e, _ = rig.consumer(links)
    c.start(HixlConnectorMetadata(cancels={"t": PREFILL}))
    [(peer, kind, tid, payload)] = links.posted
    assert (peer, kind, tid) == (PREFILL, "cancel", "t")
    assert json.loads(payload) == {"decode": e.local_engine, "why": "the decoder holds the whole prompt already"}


def test_a_grant_the_link_cannot_send_fails_the_load(rig, caplog):
    links = FakeLinks()
    links.fail_send = "refused"
    c, _, _ = rig.consumer(links)
    c.start(_load())
    links.run_jobs()
    with caplog.at_level(logging.WARNING, logger="hixl.vllm"):
        assert _finished(c) is True
    assert f"grant to the prefill {PREFILL} failed: refused" in caplog.text
    assert c.stats.take().data["recv_failed"] == 1


def test_an_abort_from_the_prefill_fails_the_load(rig, caplog):
    links = FakeLinks()
    c, _, _ = rig.consumer(links)
    _grant(c, links)
    assert c.finished(set(), False) == (set(), set())
    c.on_peer_message("abort", "t", "expired")
    with caplog.at_level(logging.WARNING, logger="hixl.vllm"):
        assert _finished(c) is True
    assert f"the prefill {PREFILL} aborted the transfer: expired" in caplog.text
    assert links.posted == [] and links.disconnected == []


def test_the_link_to_the_prefill_closing_fails_the_load(rig, caplog):
    links = FakeLinks()
    c, _, _ = rig.consumer(links)
    _grant(c, links)
    links.peers.discard(PREFILL)  # the prefill died
    with caplog.at_level(logging.WARNING, logger="hixl.vllm"):
        assert _finished(c) is True
    assert f"the link to the prefill {PREFILL} closed" in caplog.text


def test_a_timeout_cancels_and_a_confirmed_cancel_ends_the_load(rig):
    links = FakeLinks()
    c, e, _ = rig.consumer(links, timeout_s=0.1, cancel_grace_s=30)
    _grant(c, links)
    time.sleep(0.15)
    assert c.finished(set(), False) == (set(), set())  # cancelling: waits for the prefill
    [(peer, kind, tid, payload)] = links.posted
    assert (peer, kind, tid) == (PREFILL, "cancel", "t")
    assert json.loads(payload) == {"decode": e.local_engine, "why": "KV not complete within 0.1 s"}
    c.on_peer_message("cancelled", "t", "")
    assert _finished(c) is True
    assert links.disconnected == []
    data = c.stats.take().data
    assert (data["recv_failed"], data["recv_timeouts"]) == (1, 1)


def test_an_unconfirmed_cancel_closes_the_link(rig):
    links = FakeLinks()
    c, _, _ = rig.consumer(links, timeout_s=0.1, cancel_grace_s=0.1)
    _grant(c, links)
    time.sleep(0.15)
    assert c.finished(set(), False) == (set(), set())
    assert [m[1] for m in links.posted] == ["cancel"]
    time.sleep(0.15)
    assert _finished(c) is True
    assert links.disconnected == [PREFILL]


def test_a_pull_from_a_prefill_of_another_layout_fails_without_a_read(rig, caplog):
    links = FakeLinks()
    c, _, pool = rig.consumer(links)
    [ours] = c.groups.infos()
    m = pool.memory
    theirs = dict(ours, layout=dict(vars(LAYOUT), n_layers=LAYOUT.n_layers + 1),
                  memory=dict(m.to_dict(), layer_addrs=list(m.layer_addrs) + [m.layer_addrs[-1] + m.span]))
    links.describe = lambda peer, nonce: c.peers.on_described(nonce, {"engine": peer, "groups": [theirs], "rank": 0,
                                                                      "tp": 1, "epoch": "e"})
    c.start(_load(mode="pull", source={"remote_blocks": [1, 2]}))
    links.run_jobs()
    assert [k for _, k, _, _ in links.sent] == ["describe"]  # asked what it is, then read nothing
    assert not c.rx._pulls
    with caplog.at_level(logging.WARNING, logger="hixl.vllm"):
        assert _finished(c) is True
    assert f"read from the prefill {PREFILL} failed" in caplog.text and "the slot wants" in caplog.text
