"""hixl.kv: the PD KV-cache layer, one suite over rdma (in the VM), shm and tcp.

Prefill engines push K/V of random requests layer by layer into decode engines' paged pools; every
byte is checked on the decode side, and so are the neighbours that must stay untouched.
"""
from __future__ import annotations

import dataclasses
import select
import struct
import threading
import time

import numpy as np
import pytest

import hixl
from hixl import SUCCESS, TransferOpDesc, WRITE
from hixl import kv
from tests.engine_pair import _until

TRANSPORTS = [pytest.param("rdma", marks=pytest.mark.rdma), "shm", "tcp"]
LAYOUT = kv.KVLayout(n_layers=6, n_kv_heads=3, head_dim=8, dtype="float32", block_tokens=4)


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


class Rig:
    """Engines with the chosen transport; closed in reverse order of creation."""

    def __init__(self, transport):
        self.transport = transport
        self._closers = []

    def engine(self):
        e = hixl.Hixl()
        assert e.initialize("127.0.0.1:0", {"HixlTransport": self.transport}) == SUCCESS, e.last_error()
        self._closers.append(e.finalize)
        return e

    def receiver(self, num_blocks=64, layout=LAYOUT, **kw):
        r = kv.KVReceiver(self.engine(), layout, num_blocks, **kw)
        self._closers.append(r.close)
        return r

    def sender(self, num_blocks=64, layout=LAYOUT, **kw):
        s = kv.KVSender(self.engine(), layout, num_blocks, **kw)
        self._closers.append(s.close)
        return s

    def close(self):
        for c in reversed(self._closers):
            c()


@pytest.fixture
def rig(transport):
    r = Rig(transport)
    yield r
    r.close()


def _kv(rng, n_tokens, layout=LAYOUT):
    shape = (n_tokens, layout.n_kv_heads, layout.head_dim)
    return [(rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32))
            for _ in range(layout.n_layers)]


def _push_all(tx, rid, data, chunk=1, aux=None):
    L = len(data)
    for layer, (k, v) in enumerate(data):
        tx.store(rid, layer, k, v)
        if (layer + 1) % chunk == 0 or layer == L - 1:
            tx.push(rid, range(layer + 1 - ((layer % chunk) + 1), layer + 1), aux=aux if layer == L - 1 else None)


def _check(rx, rid, data, layers=None):
    lo, hi = layers or (0, len(data))
    for layer in range(lo, hi):
        k, v = rx.kv(rid, layer)
        np.testing.assert_array_equal(k, data[layer][0], err_msg=f"K of layer {layer}")
        np.testing.assert_array_equal(v, data[layer][1], err_msg=f"V of layer {layer}")


# ------------------------------------------------------------------------------------ tier 1 (layout)
def test_layout_offsets_match_a_numpy_oracle():
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1", {"HixlTransport": "shm"}) == SUCCESS
    try:
        L = LAYOUT
        pool = kv.KVPool(e, L, 7, memory="host")
        oracle = pool.bytes[:L.n_layers * 2 * 7 * L.block_bytes].view(np.float32).reshape(
            L.n_layers, 2, 7, L.block_tokens, L.n_kv_heads, L.head_dim)
        rng = np.random.default_rng(1)
        for _ in range(200):
            layer, k, b, t = (int(rng.integers(n)) for n in (L.n_layers, 2, 7, L.block_tokens))
            val = np.float32(rng.standard_normal())
            off = pool.offset(layer, k, b, t)
            pool.bytes[off:off + 4] = np.frombuffer(val.tobytes(), np.uint8)
            assert oracle[layer, k, b, t, 0, 0] == val
        # scatter/gather over a block table in any order, starting mid-block
        blocks = [5, 0, 3]
        x = rng.standard_normal((9, L.n_kv_heads, L.head_dim)).astype(np.float32)
        pool.scatter(2, 1, blocks, x, start=2)
        np.testing.assert_array_equal(pool.gather(2, 1, blocks, 11)[2:], x)
        np.testing.assert_array_equal(oracle[2, 1, 5, 2:], x[:2])
        np.testing.assert_array_equal(oracle[2, 1, 0], x[2:6])
        with pytest.raises(ValueError):
            pool.scatter(2, 1, blocks, x, start=4)  # 13 tokens do not fit in 3 blocks of 4
        with pytest.raises(ValueError):
            pool.scatter(2, 1, blocks, x.astype(np.float16))
        pool.close()
    finally:
        e.finalize()


def test_layout_validation_and_sizes():
    L = kv.KVLayout(30, 3, 64, "bfloat16", 16)
    assert (L.token_bytes, L.block_bytes, L.blocks_for(17), L.np_dtype) == (384, 6144, 2, np.dtype("uint16"))
    assert L.kv_bytes(10) == 30 * 2 * 10 * 384 and L.kv_bytes(10, (0, 15)) == 15 * 2 * 10 * 384
    for bad in ({"n_layers": 0}, {"head_dim": -1}, {"dtype": "complex64"}, {"block_tokens": True}):
        args = dict(n_layers=2, n_kv_heads=1, head_dim=4) | bad
        with pytest.raises(ValueError):
            kv.KVLayout(**args)
    assert kv.KVLayout(2, 1, 4).fingerprint() != kv.KVLayout(2, 1, 4, block_tokens=8).fingerprint()


# ------------------------------------------------------------------------------------ every transport
def test_layer_by_layer_push_lands_every_byte_and_the_aux(rig):
    rx, tx = rig.receiver(), rig.sender()
    rng = np.random.default_rng(7)
    for n_tokens in (1, 4, 13):  # one token, a full block, a partial last block
        rid = f"req-{n_tokens}"
        data = _kv(rng, n_tokens)
        g = rx.allocate(rid, n_tokens, extra_tokens=5, prefill=tx.engine.local_engine)
        assert len(g.blocks) == LAYOUT.blocks_for(n_tokens + 5)
        tx.allocate(rid, n_tokens)
        tx.add_target(rid, g.to_dict())  # as it would travel: plain JSON-able dict
        _push_all(tx, rid, data, aux=struct.pack("<iI", 4242, n_tokens))
        t_flag = rx.wait(rid, 60)
        assert t_flag <= time.monotonic()
        _check(rx, rid, data)
        assert struct.unpack_from("<iI", rx.aux(rid)) == (4242, n_tokens)
        assert rx.warm(rid) == tx.checksum(rid)
        tx.flush(rid, 60)
        st = tx.stats(rid)
        assert st["flagged"] and st["errors"] == [] and st["inflight"] == 0
        assert st["bytes"] == LAYOUT.kv_bytes(n_tokens) + 8
        assert st["transfers"] == LAYOUT.n_layers and st["busy_s"] > 0
        tx.release(rid)
        rx.free(rid)
    assert rx.free_blocks == 64


def test_the_three_ways_to_wait(rig):
    rx, tx = rig.receiver(), rig.sender()
    rng = np.random.default_rng(3)
    rids = ["poll", "block", "fd"]
    data = {r: _kv(rng, 6) for r in rids}
    for r in rids:
        tx.allocate(r, 6)
        tx.add_target(r, rx.allocate(r, 6))
    # timeout: nothing pushed yet
    t0 = time.monotonic()
    with pytest.raises(kv.KVTimeout):
        rx.wait("block", 0.2)
    assert time.monotonic() - t0 >= 0.15
    assert rx.poll() == [] and rx.wait_any(0.05) == []
    # polling
    _push_all(tx, "poll", data["poll"])
    deadline = time.monotonic() + 60
    got = []
    while not got:
        got = rx.poll()
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert got == ["poll"] and rx.is_complete("poll")
    _check(rx, "poll", data["poll"])
    # blocking on the completion event, woken by a push from another thread
    threading.Timer(0.2, _push_all, (tx, "block", data["block"])).start()
    rx.wait("block", None, warm=True)
    _check(rx, "block", data["block"])
    # the fd: readable once the flag is pending
    fd = rx.fileno()
    assert select.select([fd], [], [], 0)[0] == []
    _push_all(tx, "fd", data["fd"], chunk=3)
    assert select.select([fd], [], [], 60)[0] == [fd]
    assert rx.poll() == ["fd"]
    _check(rx, "fd", data["fd"])


def test_fan_out_replicated_and_layer_sharded(rig):
    rng = np.random.default_rng(11)
    tx = rig.sender()
    d = [rig.receiver() for _ in range(3)]
    data = _kv(rng, 9)
    # replicated to d0 and d1; sharded: d2 gets layers 2..5 only
    tx.allocate("r", 9)
    tx.add_target("r", d[0].allocate("r", 9))
    tx.add_target("r", d[1].allocate("r", 9))
    tx.add_target("r", d[2].allocate("r", 9, layers=(2, 6)))
    with pytest.raises(kv.KVError, match="overlapping"):
        tx.add_target("r", d[2].allocate("r2", 9, layers=(5, 6)).to_dict() | {"request_id": "r"})
    for layer, (k, v) in enumerate(data):
        tx.store("r", layer, k, v)
    tx.push("r", [0, 1])
    assert d[2].poll() == [] and not d[0].is_complete("r")
    tx.push("r", range(2, 6), aux=b"x")
    for r in d:
        r.wait("r", 60)
    _check(d[0], "r", data)
    _check(d[1], "r", data)
    _check(d[2], "r", data, layers=(2, 6))
    assert d[2].warm("r") == tx.checksum("r", (2, 6))
    # d2's pool holds nothing of layers 0..1 (only its own layers were written)
    g = d[2].grant("r")
    assert not d[2].pool.gather(0, 0, g.blocks, 9).any()
    with pytest.raises(ValueError):
        d[2].kv("r", 1)
    tx.flush("r", 60)


def test_two_prefills_into_one_decode_never_overwrite_each_other(rig):
    """Two prefill engines push concurrently, request after request, into one decode pool: every
    byte of every request verified, block sets of live slots pairwise disjoint."""
    rx = rig.receiver(num_blocks=40)
    senders = [rig.sender(), rig.sender()]
    errors = []

    def prefill(i, tx):
        rng = np.random.default_rng(100 + i)
        try:
            for n in range(12):
                rid = f"p{i}-{n}"
                n_tokens = int(rng.integers(1, 30))
                data = _kv(rng, n_tokens)
                g = rx.allocate(rid, n_tokens, prefill=tx.engine.local_engine, timeout=60)
                tx.allocate(rid, n_tokens)
                tx.add_target(rid, g)
                _push_all(tx, rid, data, chunk=int(rng.integers(1, 4)))
                rx.wait(rid, 60)
                _check(rx, rid, data)
                tx.release(rid, 60)
                rx.free(rid)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    live_overlap = []

    def watch():
        while any(t.is_alive() for t in threads):
            with rx._cv:
                owned = [set(s.grant.blocks) for s in rx._slots.values()]
            for a in range(len(owned)):
                for b in range(a + 1, len(owned)):
                    if owned[a] & owned[b]:
                        live_overlap.append((owned[a], owned[b]))
            time.sleep(0.002)

    threads = [threading.Thread(target=prefill, args=(i, s)) for i, s in enumerate(senders)]
    for t in threads:
        t.start()
    w = threading.Thread(target=watch)
    w.start()
    for t in threads:
        t.join(300)
    w.join(10)
    assert not errors, errors
    assert not live_overlap
    assert rx.free_blocks == 40


def test_pool_exhausted_is_an_error_or_a_bounded_wait(rig):
    rx = rig.receiver(num_blocks=8, max_requests=4)
    rx.allocate("a", 20)  # 5 blocks
    with pytest.raises(kv.PoolExhausted, match="4 blocks requested, 3 of 8 free"):
        rx.allocate("b", 16)
    t0 = time.monotonic()
    with pytest.raises(kv.PoolExhausted):
        rx.allocate("b", 16, timeout=0.2)
    assert time.monotonic() - t0 >= 0.15
    with pytest.raises(kv.PoolExhausted, match="in all"):
        rx.allocate("huge", 1000, timeout=None)  # can never fit: refused, not a wait forever
    # a wait that succeeds once another request frees its slot ("a" never got a flag: reclaim it)
    rx.free("a")
    threading.Timer(0.2, rx.reclaim, ("a",)).start()
    g = rx.allocate("b", 16, timeout=30)
    assert len(g.blocks) == 4
    with pytest.raises(kv.KVError, match="already has a slot"):
        rx.allocate("b", 1)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            rx.allocate("c", bad)


def test_a_slot_freed_before_its_flag_is_quarantined_until_the_flag(rig):
    """The decoder gives up on a request, but the prefill is still writing: its blocks must not go
    to the next request until the late writer's flag arrived."""
    rx, tx = rig.receiver(num_blocks=4), rig.sender()
    rng = np.random.default_rng(5)
    data = _kv(rng, 16)
    g = rx.allocate("slow", 16)  # the whole pool
    tx.allocate("slow", 16)
    tx.add_target("slow", g)
    for layer in range(3):
        tx.store("slow", layer, *data[layer])
        tx.push("slow", layer)
    rx.free("slow")
    with pytest.raises(kv.PoolExhausted):
        rx.allocate("next", 1)  # quarantined, not reusable
    for layer in range(3, LAYOUT.n_layers):
        tx.store("slow", layer, *data[layer])
    tx.push("slow", range(3, LAYOUT.n_layers))
    g2 = rx.allocate("next", 16, timeout=60)  # the late flag released the blocks
    assert sorted(g2.blocks) == sorted(g.blocks)
    assert rx.poll() == []  # the freed request is not reported as complete
    tx.flush("slow", 60)


def test_flags_from_the_wrong_prefill_or_stale_tickets_are_ignored(rig):
    rx, tx, other = rig.receiver(), rig.sender(), rig.sender()
    data = _kv(np.random.default_rng(2), 4)
    g = rx.allocate("r", 4, prefill=tx.engine.local_engine)
    # another engine completes the ticket: ignored
    other.allocate("r", 4)
    other.add_target("r", g)
    _push_all(other, "r", data)
    other.flush("r", 60)
    with pytest.raises(kv.KVTimeout):
        rx.wait("r", 0.3)
    assert rx.ignored_flags == 1
    # a raw flag with a ticket nobody holds: ignored as well
    src = np.zeros(8, np.uint8)
    assert other.engine.register_mem(hixl.MemDesc(src.ctypes.data, 8))[0] == SUCCESS
    desc = [TransferOpDesc(src.ctypes.data, g.pool_addr, 8)]
    assert other.engine.transfer_sync(g.decode, WRITE, desc, 10000, flag=g.ticket + 999) == SUCCESS
    with pytest.raises(kv.KVTimeout):
        rx.wait("r", 0.3)
    assert rx.ignored_flags == 2
    # the right prefill completes it
    tx.allocate("r", 4)
    tx.add_target("r", g)
    _push_all(tx, "r", data)
    rx.wait("r", 60)
    _check(rx, "r", data)


def test_backpressure_bounds_inflight_and_loses_nothing(rig):
    layout = kv.KVLayout(n_layers=64, n_kv_heads=2, head_dim=32, dtype="float16", block_tokens=8)
    rx, tx = rig.receiver(layout=layout, num_blocks=16), rig.sender(layout=layout, num_blocks=16, max_inflight=2)
    rng = np.random.default_rng(9)
    shape = (100, 2, 32)
    data = [(rng.standard_normal(shape).astype(np.float16), rng.standard_normal(shape).astype(np.float16))
            for _ in range(64)]
    tx.allocate("r", 100)
    tx.add_target("r", rx.allocate("r", 100))
    peak = 0
    for layer, (k, v) in enumerate(data):
        tx.store("r", layer, k, v)
        tx.push("r", layer)
        peak = max(peak, tx._inflight)
    assert peak <= 2
    rx.wait("r", 120)
    for layer in range(64):
        k, v = rx.kv("r", layer)
        np.testing.assert_array_equal(k, data[layer][0])
        np.testing.assert_array_equal(v, data[layer][1])
    tx.flush("r", 60)
    assert tx.stats("r")["transfers"] == 64


def test_a_decoder_that_goes_away_fails_the_push_not_hangs(rig):
    rx, tx = rig.receiver(), rig.sender(timeout=20)
    data = _kv(np.random.default_rng(4), 8)
    tx.allocate("r", 8)
    tx.add_target("r", rx.allocate("r", 8))
    tx.store("r", 0, *data[0])
    tx.push("r", 0)
    tx.flush("r", 60)
    decoder = rx.engine.local_engine
    rx.engine.finalize()  # the decoder process is gone, as far as the link goes
    # The sender learns it when its progress thread reads the closed control connection. Until then a
    # push over shm lands in memory that is still mapped here (the decoder is this process), so wait
    # for that, bounded, instead of racing it with pushes faster than a thread switch.
    _until(lambda: tx.engine.get_transport(decoder)[0] != SUCCESS, 10, "the sender to see the decoder's link close")
    t0 = time.monotonic()
    with pytest.raises(kv.TransferFailed):
        for layer in range(1, LAYOUT.n_layers):
            tx.store("r", layer, *data[layer])
            tx.push("r", layer)
        tx.flush("r", 60)
    assert time.monotonic() - t0 < 30


def test_bad_grants_are_refused_before_anything_moves(rig):
    rx, tx = rig.receiver(), rig.sender()
    g = rx.allocate("r", 8)
    tx.allocate("r", 8)
    other = kv.KVLayout(6, 3, 8, "float16", 4)
    for bad, what in ((g.to_dict() | {"layout": dataclasses.asdict(other)}, "layout"),
                      (g.to_dict() | {"n_tokens": 9}, "tokens"),
                      (g.to_dict() | {"request_id": "q"}, "is for request"),
                      (g.to_dict() | {"blocks": [0]}, "malformed"),
                      (g.to_dict() | {"blocks": [0, 10 ** 6]}, "outside")):
        with pytest.raises(kv.KVError, match=what):
            tx.add_target("r", bad)
    with pytest.raises(kv.KVError, match="no target"):
        tx.push("r", 0)
    with pytest.raises(kv.KVError, match="not allocated"):
        tx.push("nope", 0)
    tx.add_target("r", g)
    with pytest.raises(ValueError):
        tx.push("r", 6)
    with pytest.raises(ValueError):
        tx.push("r", 0, aux=bytes(10 ** 4))


def test_complete_later_and_each_target_keeps_its_own_aux(rig):
    """complete=False: every layer travels, no flag; complete() then sends aux + flag. Two shards
    completed at different times with different aux bytes each get their own."""
    rng = np.random.default_rng(21)
    tx = rig.sender()
    d0, d1, d2 = rig.receiver(), rig.receiver(), rig.receiver()
    data = _kv(rng, 7)
    tx.allocate("r", 7)
    tx.add_target("r", d0.allocate("r", 7, layers=(0, 3)))
    tx.add_target("r", d1.allocate("r", 7, layers=(3, 6)))
    for layer, (k, v) in enumerate(data):
        tx.store("r", layer, k, v)
    tx.push("r", [0, 1, 2], aux=b"first shard")  # completes d0 with its aux
    tx.push("r", [3, 4, 5], aux=b"second")       # completes d1; must not change what d0 got
    for r in (d0, d1):
        r.wait("r", 60)
    assert d0.aux("r")[:11] == b"first shard" and d1.aux("r")[:7] == b"second\0"
    _check(d0, "r", data, (0, 3))
    _check(d1, "r", data, (3, 6))
    tx.flush("r", 60)
    tx.release("r")
    # complete=False, then complete(aux=...)
    tx.allocate("q", 7)
    tx.add_target("q", d2.allocate("q", 7))
    for layer, (k, v) in enumerate(data):
        tx.store("q", layer, k, v)
        tx.push("q", layer, complete=False)
        if layer == 2:
            with pytest.raises(kv.KVError, match="not pushed yet"):
                tx.complete("q")
    tx.flush("q", 60)
    with pytest.raises(kv.KVTimeout):
        d2.wait("q", 0.2)  # every byte is there, but no flag yet
    tx.complete("q", aux=struct.pack("<i", 77))
    d2.wait("q", 60)
    assert struct.unpack_from("<i", d2.aux("q")) == (77,)
    _check(d2, "q", data)
    tx.flush("q", 60)
    assert tx.stats("q")["flagged"] and tx.complete("q") == 0  # nothing left to flag
