"""The worker's parts with tensor parallelism, driven directly (no vLLM instance): each TP rank is a
Producer (prefill) or Consumer (decode) on an engine of its own (tcp) over a cache laid out like
vLLM's CPU cache for its heads; links are fakes that carry the messages between the parts. P TP 2 ->
D TP 1 and P TP 1 -> D TP 2, push (layer by layer) and pull (the memory map learned by describe), every
byte compared with numpy slicing of the head axis; several grants for one transfer; describe cached
and asked again after a new link."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

pytest.importorskip("vllm")

import hixl  # noqa: E402
from hixl import SUCCESS, kv  # noqa: E402
from hixl.kv.heads import head_range  # noqa: E402
from hixl.vllm.cache import CacheGroups  # noqa: E402
from hixl.vllm.config import ConnectorConfig  # noqa: E402
from hixl.vllm.consumer import Consumer  # noqa: E402
from hixl.vllm.metadata import HixlConnectorMetadata, LoadSpec, SendStep  # noqa: E402
from hixl.vllm.peers import PeerBook  # noqa: E402
from hixl.vllm.producer import Producer  # noqa: E402
from hixl.vllm.specs import GroupSpec  # noqa: E402
from hixl.vllm.stats import Recorder  # noqa: E402
from tests.test_kv_heads import BS, HD, LAYOUTS, NB, Side, _take  # noqa: E402
from tests.test_kv_heads import L as N_LAYERS  # noqa: E402

pytestmark = pytest.mark.vllm

TOTAL = 4
N_TOKENS = 3 * BS - 2
P_BLOCKS, D_BLOCKS = [3, 1, 4], [0, 5, 2]
HEAD_AXIS, BLOCK_AXIS = LAYOUTS["cpu-packed"][1], LAYOUTS["cpu-packed"][3]


class Net:
    """Fake links between the ranks' parts: what one sends reaches the addressed part at once
    (grants, releases, describes); every peer is linked unless ``down``."""

    def __init__(self):
        self.ranks = {}     # engine address -> Rank
        self.log = []       # (from, to, kind, tid)
        self.down = set()

    def links(self, me):
        return _Links(self, me)


class _Links:
    def __init__(self, net, me):
        self.net, self.me = net, me
        self.jobs = []
        self.peers = set()

    def linked(self, peer):
        return peer in self.peers and peer not in self.net.down

    def ensure_link(self, peer):
        self.net.down.discard(peer)
        self.peers.add(peer)

    def send(self, peer, kind, tid, payload="", connect=True):
        if connect:
            self.ensure_link(peer)
        self.net.log.append((self.me.addr, peer, kind, tid))
        self.net.ranks[peer].receive(self.me, kind, tid, payload)

    def post(self, peer, kind, tid, payload=""):
        self.send(peer, kind, tid, payload, connect=False)

    def submit(self, job):
        self.jobs.append(job)

    def disconnect(self, peer):
        self.peers.discard(peer)

    def run_jobs(self):
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job()


class Rank:
    """One TP rank's worker parts: an engine, a cache for its heads, a Producer or a Consumer."""

    def __init__(self, net, role, tp, rank, data=None):
        self.net, self.role, self.tp, self.rank = net, role, tp, rank
        self.lo, self.hi = head_range(rank, tp, TOTAL)
        self.side = Side("cpu-packed", self.lo, self.hi, data)
        self.engine = hixl.Hixl()
        assert self.engine.initialize("127.0.0.1:0", {"HixlTransport": "tcp"}) == SUCCESS, self.engine.last_error()
        self.addr = self.engine.local_engine
        net.ranks[self.addr] = self
        self.layout = kv.KVLayout(n_layers=N_LAYERS, n_kv_heads=self.hi - self.lo, head_dim=HD, dtype="float32",
                                  block_tokens=BS)
        self.pool = kv.KVPool.wrap(self.engine, self.layout, self.side.memory)
        self.interior = f"float32:packed({self.hi - self.lo}, {BS}, {2 * HD})"
        self.links = net.links(self)
        self.groups = CacheGroups.single(self.layout, self.side.memory, self.interior, self.side.heads, TOTAL)
        shared = dict(engine=self.engine, pool=self.pool, groups=self.groups, config=ConnectorConfig(timeout_s=10),
                      stats=Recorder(), links=self.links)
        if role == "prefill":
            self.part = Producer(**shared)
        else:
            self.book = PeerBook(self.links, self.addr, 5.0)
            self.part = Consumer(**shared, tp=(rank, tp), peers=self.book)

    def receive(self, sender, kind, tid, payload):
        """What the worker's inbox does with a message (the parts' handlers)."""
        if kind == "grant":
            self.links.peers.add(sender.addr)  # it came over the decoder's link
            self.part.on_grant(tid, json.loads(payload))
        elif kind == "release":
            self.part.on_release(tid, payload)
        elif kind == "cancel":
            self.part.on_cancel(tid, payload)
        elif kind == "describe":
            d = {"engine": self.addr, "groups": self.groups.infos(), "rank": self.rank, "tp": self.tp,
                 "epoch": f"e{id(self)}"}
            sender.book.on_described(tid, d)
        elif kind in ("abort", "cancelled"):
            self.part.on_peer_message(kind, tid, payload)

    def close(self):
        if self.role == "prefill":
            self.part.close()
        else:
            self.part.rx.close()
        self.pool.close()
        self.engine.finalize()


@pytest.fixture
def net():
    n = Net()
    yield n
    for r in reversed(list(n.ranks.values())):
        r.close()


def _pd(net, tp_p, tp_d, seed=5):
    g = np.random.default_rng(seed).standard_normal(LAYOUTS["cpu-packed"][0](TOTAL)).astype(np.float32)
    prefills = [Rank(net, "prefill", tp_p, q, _take(g, HEAD_AXIS, range(*head_range(q, tp_p, TOTAL))))
                for q in range(tp_p)]
    decoders = [Rank(net, "decode", tp_d, r) for r in range(tp_d)]
    return g, prefills, decoders


def _spec(prefills, mode, tid="t"):
    peers = [p.addr for p in prefills]
    spec = LoadSpec(transfer_id=tid, mode=mode, peer=peers[0], blocks=list(D_BLOCKS), first_block=0,
                    n_tokens=N_TOKENS, source={"remote_blocks": list(P_BLOCKS)} if mode == "pull" else None)
    spec.peers, spec.remote_tp = peers, len(peers)  # what the scheduler side sets (getattr-read)
    return spec


def _compute(p, tid="t", layers_first=None):
    """One vLLM step computing the whole prompt of request "r" on prefill rank ``p``."""
    p.part.begin_step(HixlConnectorMetadata(sends={"r": SendStep(tid, list(P_BLOCKS), N_TOKENS, 0, 3, True)}))
    for layer in range(N_LAYERS):
        if layers_first is not None and layer == layers_first[0]:
            layers_first[1]()
        p.part.layer_done(layer)
    p.part.end_step()


def _finish(decoders, timeout=10.0):
    """Steps each decoder rank's get_finished until load "d" ended; returns whether any failed."""
    left, failed = set(range(len(decoders))), False
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        for i in list(left):
            ended, bad = decoders[i].part.finished(set(), False)
            if ended:
                assert ended == {"d"}
                failed |= "d" in bad
                left.discard(i)
        time.sleep(0.01)
    assert not left, f"decoder ranks {left} did not end"
    return failed


def _check(g, decoders):
    for d in decoders:
        want = _take(_take(g, HEAD_AXIS, range(d.lo, d.hi)), BLOCK_AXIS, P_BLOCKS)
        np.testing.assert_array_equal(_take(d.side.a, BLOCK_AXIS, D_BLOCKS), want)
        assert (_take(d.side.a, BLOCK_AXIS, [x for x in range(NB) if x not in D_BLOCKS]) == -1.0).all()


def _prefills_free(prefills, timeout=10.0):
    deadline = time.monotonic() + timeout
    left = set(range(len(prefills)))
    while left and time.monotonic() < deadline:
        left = {i for i in left if prefills[i].part.finished({"r"}) != {"r"}}
        time.sleep(0.01)
    assert not left, f"prefill ranks {left} still hold the request's blocks"


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2)])
def test_push_each_decoder_rank_gets_its_heads_layer_by_layer(net, tp_p, tp_d):
    g, prefills, decoders = _pd(net, tp_p, tp_d)
    spec = _spec(prefills, "push")
    for d in decoders:
        d.part.start(HixlConnectorMetadata(loads={"d": spec}))
    # rank 0's grants go out before the prefill starts, the others' after its first layer (a late grant
    # gets the layers already pushed to the first, then goes on with it)
    decoders[0].links.run_jobs()
    late = (1, lambda: [d.links.run_jobs() for d in decoders[1:]])
    for p in prefills:
        _compute(p, layers_first=late)
    assert _finish(decoders) is False
    _check(g, decoders)
    _prefills_free(prefills)
    grants = [(a, b) for a, b, kind, _ in net.log if kind == "grant"]
    assert len(grants) == max(tp_p, tp_d)  # each decoder rank to each prefill rank holding its heads
    assert not [x for x in net.log if x[2] == "abort"]


@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2)])
def test_pull_each_decoder_rank_reads_its_heads_with_a_learned_memory_map(net, tp_p, tp_d):
    g, prefills, decoders = _pd(net, tp_p, tp_d)
    for p in prefills:
        _compute(p)
    spec = _spec(prefills, "pull")
    assert "remote_memory" not in spec.source  # learned by describe, not carried in the request
    for d in decoders:
        d.part.start(HixlConnectorMetadata(loads={"d": spec}))
        d.links.run_jobs()
    assert _finish(decoders) is False
    _check(g, decoders)
    for p in prefills:
        assert p.part.finished({"r"}) == {"r"}  # released by every decoder rank that read it
    describes = [x for x in net.log if x[2] == "describe"]
    assert len(describes) == max(tp_p, tp_d)


def test_describe_is_cached_per_peer_and_asked_again_after_a_new_link(net):
    _, prefills, decoders = _pd(net, 2, 1)
    d = decoders[0]
    for tid in ("t1", "t2"):
        for p in prefills:
            _compute(p, tid=tid)
        d.part.start(HixlConnectorMetadata(loads={"d": _spec(prefills, "pull", tid)}))
        d.links.run_jobs()
        assert _finish(decoders) is False
        for p in prefills:
            assert p.part.finished({"r"}) == {"r"}
    assert d.book.asked == 2  # once per prefill rank, not per request
    net.down.add(prefills[0].addr)  # the link to rank 0 went (it may have restarted)
    assert d.book.get(prefills[0].addr)["engine"] == prefills[0].addr
    assert d.book.get(prefills[1].addr)["engine"] == prefills[1].addr
    assert d.book.asked == 3  # asked rank 0 again, rank 1 still cached
    d.book.forget(prefills[1].addr)  # what a failed read does
    d.book.get(prefills[1].addr)
    assert d.book.asked == 4


def test_a_second_grant_for_one_transfer_is_served_with_its_own_flag(net):
    # P TP 1 -> D TP 2: the prefill gets two grants for "t", one of them after the prompt was computed
    g, prefills, decoders = _pd(net, 1, 2)
    spec = _spec(prefills, "push")
    for d in decoders:
        d.part.start(HixlConnectorMetadata(loads={"d": spec}))
    decoders[0].links.run_jobs()
    _compute(prefills[0])
    assert prefills[0].part.finished({"r"}) == set()  # fanin 2: the second decoder rank is still to grant
    decoders[1].links.run_jobs()  # its grant: the whole request at once, from the held blocks
    assert _finish(decoders) is False
    _check(g, decoders)
    _prefills_free(prefills)


def test_a_prefill_rank_whose_replicas_nobody_reads_is_released(net):
    # 2 KV heads over prefill TP 4: ranks 1 and 3 hold replicas the decoder (TP 1) takes from 0 and 2
    global TOTAL
    g = np.random.default_rng(9).standard_normal(LAYOUTS["cpu-packed"][0](2)).astype(np.float32)
    old, TOTAL = TOTAL, 2
    try:
        prefills = [Rank(net, "prefill", 4, q, _take(g, HEAD_AXIS, range(*head_range(q, 4, 2)))) for q in range(4)]
        decoders = [Rank(net, "decode", 1, 0)]
        spec = _spec(prefills, "push")
        decoders[0].part.start(HixlConnectorMetadata(loads={"d": spec}))
        decoders[0].links.run_jobs()
        for p in prefills:
            _compute(p)
        assert _finish(decoders) is False
        _check(g, decoders)
        _prefills_free(prefills)
        assert sorted((b, kind) for a, b, kind, _ in net.log if kind in ("grant", "release")) == sorted(
            [(prefills[0].addr, "grant"), (prefills[2].addr, "grant"), (prefills[1].addr, "release"),
             (prefills[3].addr, "release")])
    finally:
        TOTAL = old


# ------------------------------------------------------------------- whole workers, real links
def _worker(role, rank, tp, data=None):
    import torch

    from hixl.vllm.worker import HixlWorker
    heads = TOTAL // tp
    raw = torch.full((N_LAYERS, NB, heads, BS, 2 * HD), -1.0) if data is None else torch.from_numpy(data.copy())
    config = ConnectorConfig.parse({"transport": "tcp", "host": "127.0.0.1"}, env={})
    w = HixlWorker(config, role, "e", NB, [GroupSpec("full", BS, (), heads, HD, TOTAL)], rank=rank, tp_size=tp)
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": raw[i] for i in range(N_LAYERS)})
    w.raw = raw
    return w


def _step(w, meta=None, finished=()):
    w.bind(meta or HixlConnectorMetadata(idle=True))
    for i in range(N_LAYERS):
        w.save_kv_layer(f"model.layers.{i}.self_attn.attn")
    w.wait_for_save()
    return w.transfer_results(set(finished))


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2)])
def test_workers_of_different_tp_move_each_ranks_heads_over_real_links(mode, tp_p, tp_d):
    g = np.random.default_rng(13).standard_normal(LAYOUTS["cpu-packed"][0](TOTAL)).astype(np.float32)
    made = []
    try:
        prefills = [_worker("kv_producer", q, tp_p, _take(g, HEAD_AXIS, range(*head_range(q, tp_p, TOTAL))))
                    for q in range(tp_p)]
        made += prefills
        decoders = [_worker("kv_consumer", r, tp_d) for r in range(tp_d)]
        made += decoders
        assert all(w.heads is not None and w.heads.order == "head" for w in made)
        peers = [w.engine.local_engine for w in prefills]
        spec = LoadSpec(transfer_id="t", mode=mode, peer=peers[0], blocks=list(D_BLOCKS), first_block=0,
                        n_tokens=N_TOKENS, source={"remote_blocks": list(P_BLOCKS)} if mode == "pull" else None)
        spec.peers, spec.remote_tp = peers, tp_p
        sends = HixlConnectorMetadata(sends={"r": SendStep("t", list(P_BLOCKS), N_TOKENS, 0, 3, True)})
        if mode == "pull":
            for p in prefills:
                _step(p, sends)
        for d in decoders:
            d.bind(HixlConnectorMetadata(loads={"d": spec}))
        if mode == "push":
            time.sleep(0.2)  # let the grants arrive (a late one is served too)
            for p in prefills:
                _step(p, sends)
        deadline = time.monotonic() + 15
        left = set(range(tp_d))
        while left and time.monotonic() < deadline:
            for i in list(left):
                _, recving, failed = _step(decoders[i])
                assert not failed
                if "d" in recving:
                    left.discard(i)
            time.sleep(0.02)
        assert not left
        for d in decoders:
            lo, hi = head_range(d.rank, tp_d, TOTAL)
            np.testing.assert_array_equal(_take(d.raw.numpy(), BLOCK_AXIS, D_BLOCKS),
                                          _take(_take(g, HEAD_AXIS, range(lo, hi)), BLOCK_AXIS, P_BLOCKS))
        deadline = time.monotonic() + 15
        left = set(range(tp_p))
        while left and time.monotonic() < deadline:
            left = {i for i in left if "r" not in _step(prefills[i], finished={"r"})[0]}
            time.sleep(0.02)
        assert not left, "a prefill rank still holds the blocks"
        if mode == "pull":
            assert sum(d.peers.asked for d in decoders) == max(tp_p, tp_d)
    finally:
        for w in reversed(made):
            w.shutdown()


def test_describe_messages_travel_in_parts_like_grants():
    from hixl.vllm import messages
    big = json.dumps({"engine": "h:1", "memory": {"layer_addrs": list(range(10**14, 10**14 + 400))}})
    notes = messages.encode("described", "q7", big)
    assert len(notes) > 1
    r = messages.Reassembler()
    got = None
    for name, msg in notes:
        kind, tid, i, n = messages.decode_name(name)
        assert (kind, tid) == ("described", "q7")
        got = r.add(f"{kind}/{tid}", i, n, msg)
    assert got == json.loads(big)
    assert messages.decode_name("hixl.vllm/describe/q7") == ("describe", "q7", 0, 1)
    assert len(messages.encode("describe", "q7", "x" * 5000)) == 1  # not a parted kind: one notify


# ------------------------------------------------------------------- the connector and the worker
def _vllm_config(tp, pp):
    from types import SimpleNamespace as NS
    return NS(kv_transfer_config=NS(kv_connector_extra_config={}, kv_role="kv_consumer", engine_id="e"),
              parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp),
              model_config=NS(get_total_num_kv_heads=lambda: 8))


def _kv_cache_config():
    from types import SimpleNamespace as NS

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float32)
    return NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["model.layers.0.self_attn.attn"])], num_blocks=10)


def test_the_connector_serves_tensor_parallel_ranks_and_refuses_pipeline_parallel(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hixl.vllm import connector
    monkeypatch.setattr(connector, "_tp_rank", lambda tp: (1, tp))
    c = connector.HixlConnector(_vllm_config(2, 1), KVConnectorRole.WORKER, _kv_cache_config())
    w = c._worker
    assert (w.rank, w.tp_size, w.specs[0].total_kv_heads, w.specs[0].num_kv_heads) == (1, 2, 8, 4)
    with pytest.raises(NotImplementedError, match="pipeline parallelism: pipeline_parallel_size must be 1"):
        connector.HixlConnector(_vllm_config(2, 2), KVConnectorRole.WORKER, _kv_cache_config())


@pytest.mark.parametrize("interior,order,row", [
    ("float32:packed(4, 16, 128)", "head", 512),       # CPU [blocks, heads, tokens, 2 * head]
    ("float16:kv-outer(16, 4, 64)", "token", 128),     # GPU NHD [2, blocks, tokens, heads, head]
    ("float16:kv-outer(4, 16, 64)", "head", 128),      # GPU HND [2, blocks, heads, tokens, head]
    ("bfloat16:kv-inner(4, 16, 64)", "head", 128),     # [blocks, 2, heads, tokens, head]
    ("bfloat16:kv-inner(16, 4, 64)", "token", 128),    # [blocks, 2, tokens, heads, head]
])
def test_a_workers_head_slice_comes_from_its_blocks_interior(interior, order, row):
    from hixl.vllm.cache import head_slice_of
    hs = head_slice_of(interior, 4, 16, 4, 8)
    assert (hs.lo, hs.hi, hs.order, hs.tokens, hs.row) == (4, 8, order, 16, row)


def test_a_head_slice_is_not_guessed_where_tokens_and_heads_cannot_be_told_apart():
    from hixl.vllm.cache import head_slice_of
    assert head_slice_of("float16:kv-outer(16, 16, 64)", 16, 16, 0, 16) is None  # NHD or HND?
    assert head_slice_of("float32:packed(16, 16, 128)", 16, 16, 0, 16).order == "head"  # the CPU layout is known
    assert head_slice_of("float16:kv-outer(8, 4, 64)", 4, 16, 0, 4) is None  # not this block size


def test_a_cancel_from_the_scheduler_reaches_every_prefill_rank_it_names(net):
    _, prefills, decoders = _pd(net, 2, 1)
    for p in prefills:
        _compute(p)
    decoders[0].part.start(HixlConnectorMetadata(cancels={"t": [p.addr for p in prefills]}))
    assert sorted(b for _, b, kind, _ in net.log if kind == "cancel") == sorted(p.addr for p in prefills)
    for p in prefills:  # nothing will be sent: each confirms (its inbox ticks) and frees the blocks
        assert _until_set(lambda: (p.part.tick(), p.part.finished({"r"}))[1]) == {"r"}
    assert sorted(a for a, _, kind, _ in net.log if kind == "cancelled") == sorted(p.addr for p in prefills)


def _until_set(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.01)
    return set()


def _until_ended(d, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended, failed = d.part.finished(set(), False)
        if ended:
            return ended, failed
        time.sleep(0.01)
    raise AssertionError("the load did not end")


def test_a_push_failing_in_one_part_ends_once_every_other_part_confirmed_it_stopped(net):
    """P TP 2 -> D TP 1: one prefill rank aborts while the other's part is live. The load does not end
    (its blocks stay vLLM's, unused) until every live part confirmed it stopped: a write of the other
    rank could otherwise land in blocks vLLM gave to another request."""
    _, prefills, decoders = _pd(net, 2, 1)
    d = decoders[0]
    d.part.start(HixlConnectorMetadata(loads={"d": _spec(prefills, "push")}))
    d.links.run_jobs()  # grants to both ranks
    held = prefills[1].part.on_cancel
    prefills[1].part.on_cancel = lambda tid, msg: None  # rank 1 answers later
    d.part.on_peer_message("abort", "t", "rank 0 gave up")
    assert d.part.finished(set(), False) == (set(), set())
    assert sorted(b for _, b, kind, _ in net.log if kind == "cancel") == sorted(p.addr for p in prefills)
    for _ in range(5):
        assert d.part.finished(set(), False) == (set(), set()), "ended before rank 1 confirmed"
    held("t", json.dumps({"decode": d.addr, "why": "test"}))  # rank 1 confirms now
    assert _until_ended(d) == ({"d"}, {"d"})
    assert d.links.linked(prefills[1].addr)  # confirmed in time: its link stays


def test_a_push_part_that_never_confirms_has_its_link_closed_before_the_load_ends(net):
    _, prefills, decoders = _pd(net, 2, 1)
    d = decoders[0]
    d.part.config = ConnectorConfig(timeout_s=10, cancel_grace_s=0.3)
    d.part.start(HixlConnectorMetadata(loads={"d": _spec(prefills, "push")}))
    d.links.run_jobs()
    prefills[1].part.on_cancel = lambda tid, msg: None  # never confirms
    d.part.on_peer_message("abort", "t", "rank 0 gave up")
    t0 = time.monotonic()
    assert _until_ended(d) == ({"d"}, {"d"})
    assert time.monotonic() - t0 >= 0.3
    assert not d.links.linked(prefills[1].addr)  # closed: nothing of rank 1 can land any more
