"""Head-sliced transfers between real hixl engines (rdma in the VM, shm, tcp): a prefill with TP 2
into a decoder with TP 1, and a prefill with TP 1 into a decoder with TP 2, push (KVSender targets
with head-sliced grants, one completion flag each) and pull (KVReceiver reads from each prefill rank
that holds some of its heads), every byte compared with numpy slicing of the head axis. Each rank is
an engine of its own, over a cache laid out like vLLM's (CPU packed, or GPU NHD)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

import hixl
from hixl import SUCCESS, kv
from hixl.kv.heads import head_range, head_sources
from tests.test_kv_heads import BS, HD, LAYOUTS, NB, Side, _model_cache, _take
from tests.test_kv_heads import L as N_LAYERS

TRANSPORTS = [pytest.param("rdma", marks=pytest.mark.rdma), "shm", "tcp"]
TOTAL = 4
N_TOKENS = 3 * BS - 1  # the last block partly filled: whole blocks move anyway
SRC_BLOCKS, DST_BLOCKS = [3, 1, 4], [0, 5, 2]


def _layout(heads: int) -> kv.KVLayout:
    return kv.KVLayout(n_layers=N_LAYERS, n_kv_heads=heads, head_dim=HD, dtype="float32", block_tokens=BS)


class Rank:
    """One TP rank: an engine, its cache (a Side) and a KVSender or KVReceiver over it."""

    def __init__(self, transport, name, tp, rank, data=None, role="send"):
        self.lo, self.hi = head_range(rank, tp, TOTAL)
        self.side = Side(name, self.lo, self.hi, data)
        self.engine = hixl.Hixl()
        assert self.engine.initialize("127.0.0.1:0", {"HixlTransport": transport}) == SUCCESS, self.engine.last_error()
        self.layout = _layout(self.hi - self.lo)
        pool = kv.KVPool.wrap(self.engine, self.layout, self.side.memory)
        cls = kv.KVSender if role == "send" else kv.KVReceiver
        self.end = cls(self.engine, self.layout, pool=pool, heads=self.side.heads)

    @property
    def addr(self):
        return self.engine.local_engine

    def source(self, rid, want):
        """This prefill rank's blocks as a pull source (what the worker learns by describe)."""
        return kv.Grant(request_id=rid, decode=self.addr, ticket=0, blocks=tuple(SRC_BLOCKS), n_tokens=N_TOKENS,
                        layers=(0, N_LAYERS), pool_addr=0, num_blocks=NB, aux_addr=0, aux_bytes=0,
                        layout=dataclasses.asdict(self.layout), memory=self.side.memory.to_dict(),
                        heads={"slice": self.side.heads.to_dict(), "want": list(want)})

    def close(self):
        self.end.close()
        self.end.pool.close()
        self.engine.finalize()


@pytest.fixture
def ranks():
    made = []
    yield made
    for r in reversed(made):
        r.close()


def _run(transport, name, tp_p, tp_d, mode, ranks):
    head_axis, block_axis = LAYOUTS[name][1], LAYOUTS[name][3]
    g = _model_cache(name, TOTAL, np.random.default_rng(11))
    prefills = [Rank(transport, name, tp_p, q, _take(g, head_axis, range(*head_range(q, tp_p, TOTAL))))
                for q in range(tp_p)]
    decoders = [Rank(transport, name, tp_d, r, role="recv") for r in range(tp_d)]
    ranks.extend(prefills + decoders)
    for p in prefills:
        p.end.add_request("req", SRC_BLOCKS, N_TOKENS)
    slots = []
    for r, d in enumerate(decoders):
        for q, a, b in head_sources(d.lo, d.hi, tp_p, TOTAL, prefer=r):
            sid = f"req.p{q}"  # one slot per prefill rank, all over the same blocks
            grant = d.end.expect(sid, DST_BLOCKS, N_TOKENS, prefill=prefills[q].addr, want=(a, b))
            slots.append((d, sid))
            if mode == "push":
                prefills[q].end.add_target("req", dataclasses.replace(grant, request_id="req"))
            else:
                d.end.pull(sid, prefills[q].source("req", (a, b)), timeout_ms=10000)
    if mode == "push":
        for p in prefills:  # layer by layer, as a forward pass computes them
            for layer in range(N_LAYERS):
                p.end.push("req", layer, complete=layer == N_LAYERS - 1)
    left = set(slots)
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:  # poll(): what the connector does (it reaps pulls too)
        for d in decoders:
            left -= {(d, sid) for sid in d.end.poll()}
            assert not d.end.take_failed()
        time.sleep(0.01)
    assert not left, f"slots not complete: {[sid for _, sid in left]}"
    for r, d in enumerate(decoders):
        want = _take(_take(g, head_axis, range(d.lo, d.hi)), block_axis, SRC_BLOCKS)
        np.testing.assert_array_equal(_take(d.side.a, block_axis, DST_BLOCKS), want)
        assert (_take(d.side.a, block_axis, [x for x in range(NB) if x not in DST_BLOCKS]) == -1.0).all()
    for p in prefills:
        if mode == "push":
            p.end.flush("req", timeout=10)
            assert p.end.stats("req")["flagged"]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("tp_p,tp_d", [(2, 1), (1, 2)])
def test_each_decoder_rank_receives_exactly_its_heads(transport, mode, tp_p, tp_d, ranks):
    _run(transport, "cpu-packed", tp_p, tp_d, mode, ranks)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_token_major_interiors_move_a_run_per_token(mode, ranks):
    _run("shm", "nhd-kv-outer", 2, 1, mode, ranks)


def test_a_head_sliced_grant_without_common_heads_is_refused(ranks):
    p = Rank("shm", "cpu-packed", 2, 0, np.zeros(LAYOUTS["cpu-packed"][0](2), np.float32))
    d = Rank("shm", "cpu-packed", 2, 1, role="recv")
    ranks.extend([p, d])
    p.end.add_request("req", SRC_BLOCKS, N_TOKENS)
    grant = d.end.expect("req", DST_BLOCKS, N_TOKENS, want=(2, 4))
    with pytest.raises(kv.KVError, match="none in common"):
        p.end.add_target("req", grant)
    with pytest.raises(kv.KVError, match="none of heads"):
        d.end.pull("req", p.source("req", (2, 4)))
