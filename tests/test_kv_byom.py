"""hixl.kv over memory it did not allocate (bring your own memory and layout), over rdma (in the VM),
shm and tcp: what the vLLM connector builds on.

Both ends wrap a numpy array laid out like vLLM's CPU KV cache (one tensor per layer, views of one
allocation, blocks ``[head][token][K|V dim]``: K and V packed in one block, head-major inside), the
block ids are chosen by the "owner" (the test), pushes go block by block as a chunked prefill fills
them, and the decoder may already hold the first blocks (a prefix-cache hit). Every byte of the
granted blocks is compared, and so are the blocks around them that must stay untouched.
"""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

import hixl
from hixl import SUCCESS
from hixl import kv

TRANSPORTS = [pytest.param("rdma", marks=pytest.mark.rdma), "shm", "tcp"]
LAYOUT = kv.KVLayout(n_layers=4, n_kv_heads=2, head_dim=8, dtype="float32", block_tokens=16)
NUM_BLOCKS = 24


class Cache:
    """A vLLM-CPU-like KV cache: [layer][block][head][token][2 * head_dim] float32, one allocation."""

    def __init__(self, rng=None, layout=LAYOUT, num_blocks=NUM_BLOCKS):
        shape = (layout.n_layers, num_blocks, layout.n_kv_heads, layout.block_tokens, 2 * layout.head_dim)
        self.a = (rng.standard_normal(shape).astype(np.float32) if rng is not None
                  else np.full(shape, -1.0, np.float32))
        unit = self.a[0, 0].nbytes
        self.memory = kv.BlockMemory(
            layer_addrs=tuple(self.a[i].ctypes.data for i in range(layout.n_layers)), num_blocks=num_blocks,
            block_stride=unit, unit_bytes=unit, parts=1, token_major=False)


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    engines = []
    for _ in range(2):
        e = hixl.Hixl()
        assert e.initialize("127.0.0.1:0", {"HixlTransport": request.param}) == SUCCESS, e.last_error()
        engines.append(e)
    yield engines
    for e in reversed(engines):
        e.finalize()


def _sides(pair, rng, **kw):
    src, dst = Cache(rng), Cache()
    tx = kv.KVSender(pair[0], LAYOUT, pool=kv.KVPool.wrap(pair[0], LAYOUT, src.memory), **kw)
    rx = kv.KVReceiver(pair[1], LAYOUT, pool=kv.KVPool.wrap(pair[1], LAYOUT, dst.memory))
    return src, dst, tx, rx


def _close(tx, rx):
    tx.close()
    rx.close()
    tx.pool.close()
    rx.pool.close()


# ------------------------------------------------------------------------------------ tier 1
def test_block_memory_addresses_ranges_and_checks():
    c = Cache()
    m = c.memory
    assert m.unit_bytes == LAYOUT.block_bytes * 2  # K and V packed: one unit is both
    assert m.addr(2, 0, 5) == c.a[2, 5].ctypes.data
    assert m.ranges() == [(c.a.ctypes.data, c.a.nbytes)]  # adjacent layers merge into one region
    m.check(LAYOUT)
    assert kv.BlockMemory.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    with pytest.raises(ValueError, match="layers"):
        m.check(kv.KVLayout(n_layers=5, n_kv_heads=2, head_dim=8, dtype="float32", block_tokens=16))
    with pytest.raises(ValueError, match="unit_bytes"):
        m.check(kv.KVLayout(n_layers=4, n_kv_heads=2, head_dim=8, dtype="float16", block_tokens=16))
    with pytest.raises(ValueError, match="unknown fields"):
        kv.BlockMemory.from_dict({**m.to_dict(), "evil": 1})
    with pytest.raises(ValueError, match="overlap"):
        kv.BlockMemory(layer_addrs=(4096,), num_blocks=4, block_stride=8, unit_bytes=16, parts=1)
    with pytest.raises(ValueError, match="part_stride"):
        kv.BlockMemory(layer_addrs=(4096,), num_blocks=4, block_stride=16, unit_bytes=16, parts=2)
    with pytest.raises(ValueError, match="u64"):
        kv.BlockMemory(layer_addrs=(2 ** 64 - 8,), num_blocks=4, block_stride=16, unit_bytes=16, parts=1)


def test_block_descs_match_an_oracle_and_merge_adjacent_blocks():
    a, b = Cache(), Cache()
    # request blocks 0..3 at local 5,6,7,2 and remote 9,10,11,12: 5,6,7 -> 9,10,11 merge per layer
    descs = kv.block_descs(LAYOUT, a.memory, [5, 6, 7, 2], b.memory, [9, 10, 11, 12], [1, 3], 60)
    unit = a.memory.unit_bytes
    want = []
    for layer in (1, 3):
        want += [(a.memory.addr(layer, 0, 5), b.memory.addr(layer, 0, 9), 3 * unit),
                 (a.memory.addr(layer, 0, 2), b.memory.addr(layer, 0, 12), unit)]  # head-major: whole last block
    assert descs == want
    # only blocks 1 and 3, and remote None entries are skipped
    descs = kv.block_descs(LAYOUT, a.memory, [5, 6, 7, 2], b.memory, [None, 10, None, 12], [0], 60, js=[1, 2, 3])
    assert descs == [(a.memory.addr(0, 0, 6), b.memory.addr(0, 0, 10), unit),
                     (a.memory.addr(0, 0, 2), b.memory.addr(0, 0, 12), unit)]
    own = kv.BlockMemory(layer_addrs=(1 << 20,) * 4, num_blocks=8, block_stride=LAYOUT.block_bytes,
                         unit_bytes=LAYOUT.block_bytes, parts=2, part_stride=8 * LAYOUT.block_bytes)
    with pytest.raises(ValueError, match="pack K and V differently"):
        kv.block_descs(LAYOUT, own, [0], a.memory, [0], [0], 4)


def test_a_wrapped_pool_hands_out_no_blocks():
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1", {"HixlTransport": "tcp"}) == SUCCESS
    c = Cache()
    try:
        pool = kv.KVPool.wrap(e, LAYOUT, c.memory)
        rx, tx = kv.KVReceiver(e, LAYOUT, pool=pool), kv.KVSender(e, LAYOUT, pool=pool)
        with pytest.raises(kv.KVError, match="expect"):
            rx.allocate("r", 10)
        with pytest.raises(kv.KVError, match="add_request"):
            tx.allocate("r", 10)
        with pytest.raises(ValueError, match="need 3 blocks"):
            rx.expect("r", [1, 2], 40)
        with pytest.raises(ValueError, match="outside the pool"):
            rx.expect("r", [1, 2, NUM_BLOCKS], 40)
        with pytest.raises(ValueError, match="need 3 blocks"):
            tx.add_request("r", [1, 2], 40)
        with pytest.raises(ValueError):
            kv.KVReceiver(e, kv.KVLayout(n_layers=4, n_kv_heads=2, head_dim=8, block_tokens=16), pool=pool)
        tx.close()
        pool.close()
    finally:
        e.finalize()


# ------------------------------------------------------------------------------------ two engines
@pytest.mark.parametrize("first_block", [0, 2])
def test_chunked_block_pushes_into_owner_blocks_land_every_byte(pair, first_block):
    rng = np.random.default_rng(7)
    src, dst, tx, rx = _sides(pair, rng)
    try:
        n_tokens = 77  # 5 blocks of 16, the last one part full
        p_blocks = [3, 4, 5, 11, 20]
        d_blocks = [7, 8, 1, 2, 9][first_block:]
        before = dst.a.copy()
        g = rx.expect("req-1", d_blocks, n_tokens, first_block=first_block, prefill=pair[0].local_engine)
        wire = json.loads(json.dumps(g.to_dict()))  # the grant travels as JSON
        tx.add_request("req-1", p_blocks, n_tokens)
        tx.add_target("req-1", wire)
        # a chunked prefill: blocks 0-1 full after chunk 1, 2-3 after chunk 2, 4 (the tail) at the end
        chunks = [[0, 1], [2, 3], [4]]
        for c, js in enumerate(chunks):
            for layer in range(LAYOUT.n_layers):
                last = c == len(chunks) - 1 and layer == LAYOUT.n_layers - 1
                tx.push("req-1", layer, blocks=js, complete=True if last else False)
        rx.wait("req-1", timeout=30)
        tx.flush("req-1", timeout=30)
        st = tx.stats("req-1")
        assert st["flagged"] and not st["errors"]
        granted = range(first_block, 5)
        assert st["bytes"] == LAYOUT.n_layers * len(granted) * src.memory.unit_bytes
        for j in range(5):
            for layer in range(LAYOUT.n_layers):
                db = [7, 8, 1, 2, 9][j]
                if j in granted:
                    np.testing.assert_array_equal(dst.a[layer, db], src.a[layer, p_blocks[j]],
                                                  err_msg=f"layer {layer} block {j}")
                else:
                    np.testing.assert_array_equal(dst.a[layer, db], before[layer, db])
        others = [b for b in range(NUM_BLOCKS) if b not in (7, 8, 1, 2, 9)]
        np.testing.assert_array_equal(dst.a[:, others], before[:, others])
        assert rx.warm("req-1") == tx.pool.checksum([None] * first_block + p_blocks[first_block:], n_tokens,
                                                    (0, LAYOUT.n_layers))
        rx.free("req-1")
        tx.release("req-1", timeout=10)
    finally:
        _close(tx, rx)


def test_every_pair_pushed_completes_without_an_explicit_flag(pair):
    rng = np.random.default_rng(8)
    src, dst, tx, rx = _sides(pair, rng)
    try:
        g = rx.expect("r", [10, 11], 20)
        tx.add_request("r", [0, 1], 20)
        tx.add_target("r", g)
        tx.push("r", range(4), blocks=[1])
        assert not tx.stats("r")["flagged"]
        tx.push("r", range(4), blocks=[0, 1])  # (layer, 1) pairs again: sent once only
        rx.wait("r", timeout=30)
        tx.flush("r", timeout=30)
        assert tx.stats("r")["bytes"] == 4 * 2 * src.memory.unit_bytes
        np.testing.assert_array_equal(dst.a[:, 10:12], src.a[:, 0:2])
    finally:
        _close(tx, rx)


def test_complete_without_an_aux_area_resends_the_last_block_with_the_flag(pair):
    rng = np.random.default_rng(9)
    src, dst, tx, rx = _sides(pair, rng)
    try:
        g = rx.expect("r", [4, 5], 30)
        tx.add_request("r", [6, 7], 30)
        tx.add_target("r", g)
        tx.push("r", range(4), complete=False)
        time.sleep(0.2)
        assert rx.poll() == []  # no flag yet
        tx.complete("r")
        rx.wait("r", timeout=30)
        np.testing.assert_array_equal(dst.a[:, 4:6], src.a[:, 6:8])
    finally:
        _close(tx, rx)


def test_pull_reads_the_prefill_blocks_into_the_owner_blocks(pair):
    rng = np.random.default_rng(10)
    src, dst, tx, rx = _sides(pair, rng)
    try:
        before = dst.a.copy()
        # the prefill describes its blocks like a grant (its engine in `decode`: the one to read from)
        offer = kv.Grant(request_id="r", decode=pair[0].local_engine, ticket=0, blocks=(13, 2, 17, 5),
                         n_tokens=50, layers=(0, 4), pool_addr=0, num_blocks=NUM_BLOCKS, aux_addr=0, aux_bytes=0,
                         layout=dict(LAYOUT.__dict__), memory=src.memory.to_dict())
        rx.expect("r", [20, 21, 22], 50, first_block=1)
        nbytes = rx.pull("r", json.loads(json.dumps(offer.to_dict())))
        assert nbytes == 4 * 3 * src.memory.unit_bytes
        deadline = time.monotonic() + 30
        done = []
        while not done and time.monotonic() < deadline:
            done = rx.poll()
            time.sleep(0.01)
        assert done == ["r"] and rx.take_failed() == {}
        np.testing.assert_array_equal(dst.a[:, 20:23], src.a[:, [2, 17, 5]])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (20, 21, 22)]
        np.testing.assert_array_equal(dst.a[:, untouched], before[:, untouched])
    finally:
        _close(tx, rx)


def test_a_pull_from_a_prefill_that_went_away_fails_with_the_reason(pair):
    rng = np.random.default_rng(11)
    src, dst, tx, rx = _sides(pair, rng)
    try:
        offer = kv.Grant(request_id="r", decode=pair[0].local_engine, ticket=0, blocks=(1, 2), n_tokens=20,
                         layers=(0, 4), pool_addr=0, num_blocks=NUM_BLOCKS, aux_addr=0, aux_bytes=0,
                         layout=dict(LAYOUT.__dict__), memory=src.memory.to_dict())
        rx.expect("r", [3, 4], 20)
        tx.close()
        pair[0].finalize()
        with pytest.raises(kv.TransferFailed, match="connect to prefill"):
            rx.pull("r", offer, timeout_ms=2000)
        rx.fail("r", "prefill gone")
        assert rx.take_failed() == {"r": "prefill gone"}
        with pytest.raises(kv.KVError, match="no slot"):
            rx.wait("r", timeout=0.1)
    finally:
        rx.close()


def test_a_flag_for_a_failed_slot_is_ignored(pair):
    rng = np.random.default_rng(12)
    src, dst, tx, rx = _sides(pair, rng)
    try:
        g = rx.expect("r", [1, 2], 20)
        rx.fail("r", "timed out")
        assert rx.take_failed() == {"r": "timed out"}
        tx.add_request("r", [3, 4], 20)
        tx.add_target("r", g)
        tx.push("r", range(4))
        tx.flush("r", timeout=30)
        deadline = time.monotonic() + 5
        while rx.ignored_flags == 0 and time.monotonic() < deadline:
            assert rx.poll() == []
            time.sleep(0.01)
        assert rx.ignored_flags == 1
    finally:
        _close(tx, rx)


def test_a_grant_with_a_foreign_layout_or_bad_memory_is_refused(pair):
    rng = np.random.default_rng(13)
    src, dst, tx, rx = _sides(pair, rng)
    try:
        g = rx.expect("r", [1, 2], 20).to_dict()
        tx.add_request("r", [3, 4], 20)
        bad = dict(g, memory=dict(g["memory"], unit_bytes=g["memory"]["unit_bytes"] // 2))
        with pytest.raises(kv.KVError, match="bad memory"):
            tx.add_target("r", bad)
        bad = dict(g, memory=dict(g["memory"], evil=1))
        with pytest.raises(kv.KVError, match="bad memory"):
            tx.add_target("r", bad)
        with pytest.raises(kv.KVError, match="outside the decoder"):
            tx.add_target("r", dict(g, blocks=[1, NUM_BLOCKS]))
        with pytest.raises(kv.KVError, match="malformed"):
            tx.add_target("r", dict(g, first_block=2))
    finally:
        _close(tx, rx)


def _reference_block_descs(layout, local, local_blocks, remote, remote_blocks, layers, n_tokens, js=None):
    """The descriptor builder as it was written per descriptor in Python (as it once was)."""
    nb = layout.blocks_for(n_tokens)
    js = range(nb) if js is None else sorted(set(js))
    short = local.token_major and remote.token_major
    tail = n_tokens - (nb - 1) * layout.block_tokens
    out, last = [], None
    for layer in layers:
        for part in range(local.parts):
            for j in js:
                lb, rb = local_blocks[j], remote_blocks[j]
                if lb is None or rb is None:
                    continue
                n = local.unit_bytes
                if short and j == nb - 1:
                    n = n * tail // layout.block_tokens
                loc, rem = local.addr(layer, part, lb), remote.addr(layer, part, rb)
                if last is not None and last[0] + last[2] == loc and last[1] + last[2] == rem:
                    last[2] += n
                else:
                    last = [loc, rem, n]
                    out.append(last)
    return [tuple(x) for x in out]


@pytest.mark.parametrize("seed", range(40))
def test_block_desc_array_matches_the_per_descriptor_builder(seed):
    """The vectorized builder (a numpy descriptor array, what KVSender and KVReceiver post) gives the
    same descriptors as the per-descriptor one: merging, None blocks, short last blocks, K/V packing."""
    from hixl.kv import block_desc_array
    rng = np.random.default_rng(seed)
    layout = kv.KVLayout(n_layers=int(rng.integers(1, 5)), n_kv_heads=2, head_dim=8, dtype="float32",
                         block_tokens=int(rng.choice([4, 16])))
    parts = int(rng.choice([1, 2]))
    unit = layout.block_bytes * (2 // parts)

    def memory(base, nblocks, contiguous):
        stride = unit if contiguous else unit + 64
        pstride = nblocks * stride if parts == 2 else 0
        span = (parts - 1) * pstride + (nblocks - 1) * stride + unit
        return kv.BlockMemory(layer_addrs=tuple(base + k * (span + 4096) for k in range(layout.n_layers)),
                              num_blocks=nblocks, block_stride=stride, unit_bytes=unit, parts=parts,
                              part_stride=pstride, token_major=bool(rng.integers(0, 2)))
    nblocks = 12
    local, remote = memory(1 << 30, nblocks, bool(rng.integers(0, 2))), memory(1 << 34, nblocks, bool(rng.integers(0, 2)))
    n_tokens = int(rng.integers(1, 8 * layout.block_tokens))
    nb = layout.blocks_for(n_tokens)
    lbs = [int(x) for x in rng.permutation(nblocks)[:nb]] if rng.integers(0, 2) else list(range(nb))
    rbs = [int(x) for x in rng.permutation(nblocks)[:nb]] if rng.integers(0, 2) else list(range(nb))
    if nb > 1 and rng.integers(0, 2):
        rbs[int(rng.integers(0, nb))] = None
    layers = sorted(set(int(x) for x in rng.integers(0, layout.n_layers, 3)))
    js = None if rng.integers(0, 2) else [int(x) for x in rng.integers(0, nb, 4)]
    want = _reference_block_descs(layout, local, lbs, remote, rbs, layers, n_tokens, js)
    got = block_desc_array(layout, local, lbs, remote, rbs, layers, n_tokens, js)
    assert got.dtype == np.uint64 and got.shape == (len(want), 3)
    assert [tuple(int(v) for v in row) for row in got] == want
    assert kv.block_descs(layout, local, lbs, remote, rbs, layers, n_tokens, js) == want
