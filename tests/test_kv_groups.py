"""hixl.kv over several KV cache groups in one cache (what vLLM's hybrid KV cache manager hands a connector),
over rdma (in the VM), shm and tcp.

The cache is laid out as vLLM lays out a hybrid model's: one allocation of ``SLOTS`` layer slots, each of
``NUM_BLOCKS`` pages, and every group's layer ``i`` aliases slot ``i`` (a page belongs to whichever group owns
that block id: ids are unique across groups). Four groups: full attention (K and V packed in a page), a
sliding window (the same interior; the decoder wants only the blocks its window keeps), an MLA latent (one
plane) and a Mamba-like state (one opaque state per request, smaller than a page). Every byte of both caches
is compared with a reference computed here from page arithmetic alone, so a unit moved to the wrong page, a
block behind the window that moved anyway or a state that came short all show."""
from __future__ import annotations

import numpy as np
import pytest

import hixl
from hixl import SUCCESS
from hixl import kv
from tests.engine_pair import _until
from tests.test_kv_byom import pair  # noqa: F401  (two engines per transport)

SLOTS, NUM_BLOCKS, PAGE = 2, 48, 2048
STATE_BYTES = 1500
N_TOKENS = 100  # 7 blocks of 16 tokens; one state block
LAYOUTS = (
    kv.KVLayout(n_layers=2, n_kv_heads=2, head_dim=8, dtype="float32", block_tokens=16),               # full
    kv.KVLayout(n_layers=2, n_kv_heads=2, head_dim=8, dtype="float32", block_tokens=16),               # sliding
    kv.KVLayout(n_layers=2, n_kv_heads=1, head_dim=32, dtype="float32", block_tokens=16, kind="latent"),
    kv.KVLayout(n_layers=2, n_kv_heads=1, head_dim=STATE_BYTES, dtype="uint8", block_tokens=2048, kind="state"),
)
UNITS = (PAGE, PAGE, PAGE, STATE_BYTES)
# vLLM model order: the groups' layers interleave (global layer = group * 2 + i)
MODEL_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
P_BLOCKS = [[1, 2, 3, 4, 5, 6, 7], [None, None, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20]]
D_BLOCKS = [[30, 31, 32, 33, 34, 35, 36], [None, None, None, None, 37, 38, 39], [40, 41, 42, 43, 44, 45, 46], [47]]


class Cache:
    """One allocation of SLOTS x NUM_BLOCKS pages; every group's layer i starts at slot i."""

    def __init__(self, rng=None):
        shape = (SLOTS, NUM_BLOCKS, PAGE)
        self.a = rng.integers(0, 256, shape, dtype=np.uint8) if rng is not None else np.zeros(shape, np.uint8)
        self.groups = kv.KVGroups(LAYOUTS, tuple(
            kv.BlockMemory(layer_addrs=tuple(self.a[i].ctypes.data for i in range(SLOTS)), num_blocks=NUM_BLOCKS,
                           block_stride=PAGE, unit_bytes=unit, parts=1, token_major=False) for unit in UNITS))


@pytest.fixture
def sides(pair):
    src, dst = Cache(np.random.default_rng(3)), Cache()
    tx = kv.KVSender(pair[0], None, pool=kv.KVPool.wrap_groups(pair[0], src.groups))
    rx = kv.KVReceiver(pair[1], None, pool=kv.KVPool.wrap_groups(pair[1], dst.groups))
    yield src, dst, tx, rx
    tx.close()
    rx.close()
    tx.pool.close()
    rx.pool.close()


def _expected(src, dst_before, p_blocks=P_BLOCKS, d_blocks=D_BLOCKS):
    """The decoder's cache once every wanted unit landed: page arithmetic only."""
    want = dst_before.copy()
    for g, unit in enumerate(UNITS):
        for i in range(SLOTS):
            for j, b in enumerate(d_blocks[g]):
                if b is not None:
                    want[i, b, :unit] = src.a[i, p_blocks[g][j], :unit]
    return want


def test_groups_number_layers_across_groups_and_register_shared_memory_once():
    c = Cache()
    assert c.groups.n_layers == 8 and c.groups.group_of(5) == (2, 1) and list(c.groups.layers(3)) == [6, 7]
    assert c.groups.ranges() == [(c.a.ctypes.data, c.a.nbytes)]  # the groups alias one allocation: one region
    assert c.groups.blocks_for(N_TOKENS) == [7, 7, 7, 1]
    assert LAYOUTS[2].planes == 1 and LAYOUTS[2].block_bytes == PAGE and LAYOUTS[3].block_bytes == STATE_BYTES
    assert LAYOUTS[3].kv_bytes(N_TOKENS) == 2 * STATE_BYTES and LAYOUTS[2].kv_bytes(N_TOKENS) == 2 * N_TOKENS * 128
    with pytest.raises(ValueError, match="group 3"):
        kv.KVGroups(LAYOUTS, c.groups.memories[:3] + (c.groups.memories[0],))
    with pytest.raises(ValueError, match="kind"):
        kv.KVLayout(n_layers=1, n_kv_heads=1, head_dim=1, kind="mamba")
    with pytest.raises(ValueError, match="outside its pool"):
        c.groups.per_group([[1], [2], [3], [NUM_BLOCKS]])


def test_a_layer_wise_push_moves_each_groups_blocks_and_only_those_with_one_flag(pair, sides):
    src, dst, tx, rx = sides
    before = dst.a.copy()
    g = rx.expect("r", D_BLOCKS, N_TOKENS, prefill=pair[0].local_engine)
    assert len(g.to_dict()["groups"]) == 4
    tx.add_request("r", P_BLOCKS, N_TOKENS)
    tx.add_target("r", kv.Grant.from_dict(g.to_dict()))
    for k, layer in enumerate(MODEL_ORDER):  # as the forward computes them; the last push carries the flag
        tx.push("r", [layer], complete=k == len(MODEL_ORDER) - 1)
    assert _until(lambda: rx.poll(), 10.0, "the flag") == ["r"]
    np.testing.assert_array_equal(dst.a, _expected(src, before))
    st = tx.stats("r")
    # the sliding group moved its window's 3 blocks, not the 5 the prefill still held, nor the prompt's 7
    assert st["bytes"] == SLOTS * (7 * PAGE + 3 * PAGE + 7 * PAGE + STATE_BYTES) and st["flagged"]
    assert st["group_bytes"] == [SLOTS * 7 * PAGE, SLOTS * 3 * PAGE, SLOTS * 7 * PAGE, SLOTS * STATE_BYTES]
    tx.release("r")
    rx.free("r")


def test_a_pull_reads_every_groups_blocks_into_place(pair, sides):
    src, dst, tx, rx = sides
    before = dst.a.copy()
    rx.expect("r", D_BLOCKS, N_TOKENS)
    offer = kv.Grant(request_id="r", decode=pair[0].local_engine, ticket=0, blocks=(), n_tokens=N_TOKENS,
                     layers=(0, 8), pool_addr=0, num_blocks=NUM_BLOCKS, aux_addr=0, aux_bytes=0, groups=tuple(
                         kv.GroupGrant(tuple(b), vars(lay), mem).to_dict()
                         for b, lay, mem in zip(P_BLOCKS, LAYOUTS, src.groups.memories)))
    n = rx.pull("r", offer, timeout_ms=10000)
    assert n == SLOTS * (7 * PAGE + 3 * PAGE + 7 * PAGE + STATE_BYTES)
    assert _until(lambda: rx.poll(), 10.0, "the flag") == ["r"]
    np.testing.assert_array_equal(dst.a, _expected(src, before))
    assert rx.warm("r") == tx.pool.checksum(
        [[p if d is not None else None for p, d in zip(pb, db)] for pb, db in zip(P_BLOCKS, D_BLOCKS)], N_TOKENS, (0, 8))
    rx.free("r")


def test_a_pull_from_a_source_that_lacks_a_wanted_block_is_refused_before_any_read(pair, sides):
    src, dst, tx, rx = sides
    rx.expect("r", D_BLOCKS, N_TOKENS)
    lacking = [list(b) for b in P_BLOCKS]
    lacking[1][4] = None
    offer = kv.Grant(request_id="r", decode=pair[0].local_engine, ticket=0, blocks=(), n_tokens=N_TOKENS,
                     layers=(0, 8), pool_addr=0, num_blocks=NUM_BLOCKS, aux_addr=0, aux_bytes=0, groups=tuple(
                         kv.GroupGrant(tuple(b), vars(lay), mem).to_dict()
                         for b, lay, mem in zip(lacking, LAYOUTS, src.groups.memories)))
    with pytest.raises(kv.KVError, match="lacks blocks .* of KV cache group 1"):
        rx.pull("r", offer)
    assert not dst.a.any()
    rx.free("r")


def test_a_block_the_decoder_wants_but_the_prefill_freed_fails_the_push_not_the_flag(pair, sides):
    src, dst, tx, rx = sides
    g = rx.expect("r", D_BLOCKS, N_TOKENS, prefill=pair[0].local_engine)
    held = [list(b) for b in P_BLOCKS]
    tx.add_request("r", held, N_TOKENS)
    tx.add_target("r", g)
    held[1][4] = None  # the owner freed a block the window needs (blocks may only be given up)
    tx.set_blocks("r", held)
    with pytest.raises(kv.KVError, match="does not hold"):
        tx.push("r", list(range(8)), complete=True)
    with pytest.raises(kv.KVError, match="cannot change"):
        tx.set_blocks("r", [held[0], [None, None, 8, 9, 21, 11, 12], held[2], held[3]])
    assert rx.poll() == []
    tx.release("r")
    rx.free("r")


def test_a_flag_is_never_sent_before_every_group_was_pushed(pair, sides):
    src, dst, tx, rx = sides
    g = rx.expect("r", D_BLOCKS, N_TOKENS, prefill=pair[0].local_engine)
    tx.add_request("r", P_BLOCKS, N_TOKENS)
    tx.add_target("r", g)
    tx.push("r", [0, 1, 2, 3, 4, 5], complete=False)  # the state group (layers 6, 7) not yet
    with pytest.raises(kv.KVError, match="2 of its 36 .* pairs not pushed"):
        tx.push("r", [5], complete=True)
    with pytest.raises(kv.KVError, match="not pushed yet"):
        tx.complete("r")
    tx.push("r", [6, 7], blocks={3: [0]})  # complete=None: the push that completes the target flags it
    assert _until(lambda: rx.poll(), 10.0, "the flag") == ["r"]
    tx.release("r")
    rx.free("r")


def test_grants_that_do_not_fit_the_senders_groups_are_refused_naming_the_group(pair, sides):
    src, dst, tx, rx = sides
    g = rx.expect("r", D_BLOCKS, N_TOKENS).to_dict()
    tx.add_request("r", P_BLOCKS, N_TOKENS)
    bad = dict(g, groups=g["groups"][:3])
    with pytest.raises(kv.KVError, match="3 KV cache group"):
        tx.add_target("r", bad)
    wrong = [dict(x) for x in g["groups"]]
    wrong[2] = dict(wrong[2], layout=dict(wrong[2]["layout"], head_dim=16))  # another kv_lora_rank
    with pytest.raises(kv.KVError, match=r"group 2\) has layout"):
        tx.add_target("r", dict(g, groups=wrong))
    wrong = [dict(x) for x in g["groups"]]
    wrong[1] = dict(wrong[1], layout=dict(wrong[1]["layout"], block_tokens=32))  # blocks of another size
    with pytest.raises(kv.KVError, match=r"group 1\) has layout .*'block_tokens': 32"):
        tx.add_target("r", dict(g, groups=wrong))
    wrong = [dict(x) for x in g["groups"]]
    wrong[3] = dict(wrong[3], memory=dict(wrong[3]["memory"], unit_bytes=PAGE))
    with pytest.raises(kv.KVError, match="group 3.*bad memory"):
        tx.add_target("r", dict(g, groups=wrong))
    none = [dict(x, blocks=[None] * len(x["blocks"])) for x in g["groups"]]
    with pytest.raises(kv.KVError, match="wants no block"):
        tx.add_target("r", dict(g, groups=none))
    tx.release("r")
    rx.free("r")


def test_expect_with_groups_checks_each_groups_blocks():
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"HixlTransport": "shm"}) == SUCCESS
    c = Cache()
    rx = kv.KVReceiver(e, None, pool=kv.KVPool.wrap_groups(e, c.groups))
    try:
        with pytest.raises(ValueError, match="need 1 blocks in KV cache group 3"):
            rx.expect("r", D_BLOCKS[:3] + [[47, 46]], N_TOKENS)
        with pytest.raises(ValueError, match="no block to receive"):
            rx.expect("r", [[None] * 7, [None] * 7, [None] * 7, [None]], N_TOKENS)
        with pytest.raises(ValueError, match="first_block"):
            rx.expect("r", D_BLOCKS, N_TOKENS, first_block=1)
        with pytest.raises(ValueError, match="group 0 needs its heads"):
            rx.expect("r", D_BLOCKS, N_TOKENS, want=[(0, 1), None, None, None])
    finally:
        rx.close()
        rx.pool.close()
        e.finalize()
