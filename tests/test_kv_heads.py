"""Head-sliced descriptors (hixl.kv.heads) against a numpy reference, for every KV cache layout vLLM
uses: the CPU backend's packed ``[blocks, heads, tokens, 2 * head]``, the GPU NHD
``[2, blocks, tokens, heads, head]`` and the HND ``[2, blocks, heads, tokens, head]`` and
``[blocks, 2, heads, tokens, head]``. Each side's cache holds its TP rank's heads of one model-wide
cache; the descriptors are applied as byte copies and the result compared with numpy slicing of the
head axis. Tier 1: no engine, no vLLM."""
from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from hixl import kv
from hixl.kv.heads import HeadSlice, head_fanin, head_range, head_runs, head_sources, sliced_desc_array

L, NB, BS, HD = 3, 6, 4, 8
ISZ = 4  # float32

# layout name -> (shape of one side's cache for h heads, head axis, K|V part axis or None, block axis, order)
LAYOUTS = {
    "cpu-packed": (lambda h: (L, NB, h, BS, 2 * HD), 2, None, 1, "head"),
    "nhd-kv-outer": (lambda h: (L, 2, NB, BS, h, HD), 4, 1, 2, "token"),
    "hnd-kv-outer": (lambda h: (L, 2, NB, h, BS, HD), 3, 1, 2, "head"),
    "hnd-kv-inner": (lambda h: (L, NB, 2, h, BS, HD), 3, 2, 1, "head"),
}


class Side:
    """One TP rank's cache in a layout: a numpy array, its BlockMemory and its HeadSlice."""

    def __init__(self, name: str, lo: int, hi: int, data: np.ndarray = None):
        shape_of, self.head_axis, part_axis, block_axis, order = LAYOUTS[name]
        self.a = np.full(shape_of(hi - lo), -1.0, np.float32) if data is None else np.ascontiguousarray(data)
        st = self.a.strides
        row = (2 * HD if part_axis is None else HD) * ISZ
        unit = (hi - lo) * BS * row
        self.memory = kv.BlockMemory(layer_addrs=tuple(self.a[i].ctypes.data for i in range(L)), num_blocks=NB,
                                     block_stride=st[block_axis], unit_bytes=unit,
                                     parts=1 if part_axis is None else 2,
                                     part_stride=0 if part_axis is None else st[part_axis], token_major=False)
        self.heads = HeadSlice(lo=lo, hi=hi, order=order, tokens=BS, row=row)


def _take(arr: np.ndarray, axis: int, idx) -> np.ndarray:
    return np.take(arr, idx, axis=axis)


def _apply(descs: np.ndarray, direction: str) -> int:
    """Byte copies: pull reads remote into local, push writes local into remote."""
    n = 0
    for loc, rem, ln in descs.tolist():
        src, dst = (rem, loc) if direction == "pull" else (loc, rem)
        ctypes.memmove(dst, src, ln)
        n += ln
    return n


def _model_cache(name: str, total: int, rng) -> np.ndarray:
    shape_of = LAYOUTS[name][0]
    return rng.standard_normal(shape_of(total)).astype(np.float32)


def _move(name, total, tp_src, tp_dst, direction, rng):
    """Every destination rank takes its heads from the source ranks holding them; returns the model
    cache, the destination sides and the blocks moved (src ids, dst ids)."""
    head_axis, block_axis = LAYOUTS[name][1], LAYOUTS[name][3]
    g = _model_cache(name, total, rng)
    srcs = []
    for q in range(tp_src):
        lo, hi = head_range(q, tp_src, total)
        srcs.append(Side(name, lo, hi, _take(g, head_axis, range(lo, hi))))
    src_blocks, dst_blocks = [3, 1, 4], [0, 5, 2]
    dsts = []
    for r in range(tp_dst):
        lo, hi = head_range(r, tp_dst, total)
        d = Side(name, lo, hi)
        moved = 0
        for q, a, b in head_sources(lo, hi, tp_src, total, prefer=r):
            s = srcs[q]
            if direction == "pull":  # the decoder builds them: local = destination
                descs = sliced_desc_array(d.memory, d.heads, dst_blocks, s.memory, s.heads, src_blocks, range(L),
                                          range(3), want=(a, b))
            else:  # the prefill builds them: local = source
                descs = sliced_desc_array(s.memory, s.heads, src_blocks, d.memory, d.heads, dst_blocks, range(L),
                                          range(3), want=(a, b))
            moved += _apply(descs, direction)
        assert moved == (hi - lo) * L * 3 * BS * 2 * HD * ISZ  # exactly its heads, K and V, once
        dsts.append(d)
    return g, dsts, src_blocks, dst_blocks, head_axis, block_axis


CASES = [(name, total, tp_src, tp_dst, direction)
         for name in LAYOUTS for total in (4, 8) for tp_src, tp_dst in itertools.product((1, 2, 4), repeat=2)
         for direction in ("push", "pull")]


@pytest.mark.parametrize("name,total,tp_src,tp_dst,direction", CASES)
def test_each_destination_rank_gets_exactly_its_heads_in_place(name, total, tp_src, tp_dst, direction):
    g, dsts, sb, db, head_axis, block_axis = _move(name, total, tp_src, tp_dst, direction, np.random.default_rng(7))
    for r, d in enumerate(dsts):
        lo, hi = head_range(r, tp_dst, total)
        want = _take(_take(g, head_axis, range(lo, hi)), block_axis, sb)
        np.testing.assert_array_equal(_take(d.a, block_axis, db), want)
        others = [x for x in range(NB) if x not in db]
        assert (_take(d.a, block_axis, others) == -1.0).all()  # nothing outside the granted blocks


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("tp_src,tp_dst", [(4, 1), (1, 4), (4, 2), (2, 4), (4, 4)])
def test_replicated_gqa_heads_come_from_one_rank_that_holds_them(name, tp_src, tp_dst):
    # 2 KV heads over TP 4: each head lives on two ranks; a destination rank reads it from one
    g, dsts, sb, db, head_axis, block_axis = _move(name, 2, tp_src, tp_dst, "pull", np.random.default_rng(3))
    for r, d in enumerate(dsts):
        lo, hi = head_range(r, tp_dst, 2)
        np.testing.assert_array_equal(_take(d.a, block_axis, db),
                                      _take(_take(g, head_axis, range(lo, hi)), block_axis, sb))


def test_head_ranges_follow_vllm_sharding_and_refuse_what_does_not_divide():
    assert [head_range(r, 2, 8) for r in range(2)] == [(0, 4), (4, 8)]
    assert [head_range(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match="do not divide"):
        head_range(0, 2, 3)
    with pytest.raises(ValueError, match="not a multiple"):
        head_range(0, 4, 3)
    with pytest.raises(ValueError, match="rank"):
        head_range(2, 2, 4)


def test_sources_cover_each_head_once_and_spread_replicas():
    assert head_sources(0, 8, 2, 8) == [(0, 0, 4), (1, 4, 8)]
    assert head_sources(4, 6, 1, 8) == [(0, 4, 6)]
    assert head_sources(0, 2, 4, 2, prefer=0) == [(0, 0, 1), (2, 1, 2)]
    assert head_sources(0, 2, 4, 2, prefer=1) == [(1, 0, 1), (3, 1, 2)]
    # fan-in: how many peer ranks read from a rank
    assert [head_fanin(q, 2, 1, 8) for q in range(2)] == [1, 1]
    assert [head_fanin(q, 1, 2, 8) for q in range(1)] == [2]
    assert [head_fanin(q, 4, 1, 2) for q in range(4)] == [1, 0, 1, 0]  # replicas nobody needs


def test_runs_per_interior_and_refusals():
    h = HeadSlice(lo=0, hi=4, order="head", tokens=BS, row=64)
    q = HeadSlice(lo=2, hi=4, order="head", tokens=BS, row=64)
    assert head_runs(h, q).tolist() == [[2 * BS * 64, 0, 2 * BS * 64]]
    t = HeadSlice(lo=0, hi=4, order="token", tokens=BS, row=32)
    u = HeadSlice(lo=1, hi=2, order="token", tokens=BS, row=32)
    assert head_runs(t, u).tolist() == [[i * 128 + 32, i * 32, 32] for i in range(BS)]
    assert head_runs(h, HeadSlice(lo=4, hi=8, order="head", tokens=BS, row=64)).shape == (0, 3)
    with pytest.raises(ValueError, match="differ beyond their heads"):
        head_runs(h, t)
    with pytest.raises(ValueError, match="order"):
        HeadSlice(lo=0, hi=1, order="nhd", tokens=BS, row=1)
    assert HeadSlice.from_dict(h.to_dict()) == h
    with pytest.raises(ValueError):
        HeadSlice.from_dict({**h.to_dict(), "evil": 1})


def test_same_heads_merge_to_the_plain_block_descriptors():
    # TP equal on both sides: head-sliced descriptors are the whole-block ones
    s, d = Side("cpu-packed", 0, 4), Side("cpu-packed", 0, 4)
    layout = kv.KVLayout(n_layers=L, n_kv_heads=4, head_dim=HD, dtype="float32", block_tokens=BS)
    plain = kv.block_desc_array(layout, s.memory, [1, 2], d.memory, [3, 4], range(L), 2 * BS)
    sliced = sliced_desc_array(s.memory, s.heads, [1, 2], d.memory, d.heads, [3, 4], range(L), range(2))
    np.testing.assert_array_equal(plain, sliced)
