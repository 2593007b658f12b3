"""Descriptors without a Python object each: numpy descriptor arrays and prepared lists.

Every test runs once per transport (rdma in the CI VM, shm and tcp on the host), between two
engines of this process; every transfer is checked byte for byte, and every refusal leaves the
target's bytes as they were (nothing was posted).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import hixl
from hixl import DESC_DTYPE, PARAM_INVALID, READ, SUCCESS, WRITE, MemDesc, MemType, TransferStatus

TRANSPORTS = [pytest.param("rdma", marks=pytest.mark.rdma), "shm", "tcp"]
SIZE = 1 << 20
BLOCK = 4096


def _engine(transport: str) -> hixl.Hixl:
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0", {"HixlTransport": transport}) == SUCCESS, e.last_error()
    return e


class Pair:
    """`tgt` owns `tbuf` (the remote side); `ini` owns `ibuf` (random bytes) and connects to `tgt`."""

    def __init__(self, transport: str):
        self.tgt, self.ini = _engine(transport), _engine(transport)
        self.tbuf = np.zeros(SIZE, np.uint8)
        self.ibuf = np.random.default_rng(17).integers(0, 256, SIZE, dtype=np.uint8)
        self.ta, self.ia = self.tbuf.ctypes.data, self.ibuf.ctypes.data
        rc, self.th = self.tgt.register_mem(MemDesc(self.ta, SIZE), MemType.MEM_HOST)
        assert rc == SUCCESS, self.tgt.last_error()
        rc, self.ih = self.ini.register_mem(MemDesc(self.ia, SIZE), MemType.MEM_HOST)
        assert rc == SUCCESS, self.ini.last_error()
        self.peer = self.tgt.local_engine
        assert self.ini.connect(self.peer, 10000) == SUCCESS, self.ini.last_error()

    def close(self) -> None:
        self.ini.finalize()
        self.tgt.finalize()

    def wait(self, req: int) -> TransferStatus:
        rc, st = self.ini.transfer_wait(req, 60000)
        assert rc == SUCCESS, self.ini.last_error()
        return st


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    p = Pair(request.param)
    yield p
    p.close()


def _blocks(base: int, n: int, block: int = BLOCK) -> np.ndarray:
    return base + np.arange(n, dtype=np.uint64) * np.uint64(block)


# ------------------------------------------------------------------------------- descriptor arrays
@pytest.mark.parametrize("form", ["u64", "i64", "structured"])
def test_descriptor_array_write_and_read_back(pair, form):
    n, size = 64, 1000  # odd lengths at scattered offsets
    lo = np.arange(n, dtype=np.uint64) * np.uint64(3 * size)
    ro = (np.arange(n, dtype=np.uint64)[::-1]) * np.uint64(2 * size + 8)
    d = np.stack([pair.ia + lo, pair.ta + ro, np.full(n, size, np.uint64)], axis=1)
    if form == "i64":
        d = d.astype(np.int64)
    elif form == "structured":
        s = np.zeros(n, DESC_DTYPE)
        s["local_addr"], s["remote_addr"], s["len"] = d[:, 0], d[:, 1], d[:, 2]
        d = s
    assert pair.ini.transfer_sync(pair.peer, WRITE, d, 10000) == SUCCESS, pair.ini.last_error()
    expect = np.zeros(SIZE, np.uint8)
    for k in range(n):
        expect[int(ro[k]):int(ro[k]) + size] = pair.ibuf[int(lo[k]):int(lo[k]) + size]
    assert np.array_equal(pair.tbuf, expect)
    # Read it back into another part of our buffer, asynchronously.
    back = np.stack([pair.ia + np.uint64(SIZE // 2) + lo // np.uint64(3), pair.ta + ro, np.full(n, size, np.uint64)],
                    axis=1)
    rc, req = pair.ini.transfer_async(pair.peer, READ, back)
    assert rc == SUCCESS, pair.ini.last_error()
    assert pair.wait(req) == TransferStatus.COMPLETED
    for k in range(n):
        o = SIZE // 2 + int(lo[k]) // 3
        assert np.array_equal(pair.ibuf[o:o + size], expect[int(ro[k]):int(ro[k]) + size])


@pytest.mark.parametrize("bad", ["shape", "float", "negative", "empty", "zero_len", "remote_out", "local_out",
                                 "wraps"])
def test_bad_descriptor_arrays_are_refused_before_anything_moves(pair, bad):
    d = np.array([[pair.ia, pair.ta, 64], [pair.ia + 64, pair.ta + 64, 64]], np.uint64)
    if bad == "shape":
        d = d.reshape(3, 2)
    elif bad == "float":
        d = d.astype(np.float64)
    elif bad == "negative":
        d = d.astype(np.int64)
        d[1, 2] = -1
    elif bad == "empty":
        d = d[:0]
    elif bad == "zero_len":
        d[1, 2] = 0
    elif bad == "remote_out":
        d[1, 1] = pair.ta + SIZE - 32
    elif bad == "local_out":
        d[1, 0] = pair.ia + SIZE
    elif bad == "wraps":
        d[1, 1] = np.uint64(2 ** 64 - 16)
    assert pair.ini.transfer_sync(pair.peer, WRITE, d, 5000) == PARAM_INVALID
    assert pair.ini.last_error()
    rc, req = pair.ini.transfer_async(pair.peer, WRITE, d)
    assert (rc, req) == (PARAM_INVALID, 0)
    assert not pair.tbuf.any(), "a refused transfer wrote bytes"


# --------------------------------------------------------------------------------- prepared lists
def _prep(pair, blocks: int = SIZE // BLOCK):
    rc, lh = pair.ini.prep_descs(_blocks(pair.ia, blocks), BLOCK)
    assert rc == SUCCESS, pair.ini.last_error()
    rc, rh = pair.ini.prep_descs(_blocks(pair.ta, blocks), [BLOCK] * blocks, remote_engine=pair.peer)
    assert rc == SUCCESS, pair.ini.last_error()
    return lh, rh


def test_prepared_lists_move_blocks_by_index(pair):
    lh, rh = _prep(pair)
    rng = np.random.default_rng(3)
    li = rng.permutation(SIZE // BLOCK)[:100]
    ri = rng.permutation(SIZE // BLOCK)[:100]
    rc, req = pair.ini.transfer_prepped_async(WRITE, lh, li, rh, ri, user_data=9)
    assert rc == SUCCESS, pair.ini.last_error()
    assert pair.wait(req) == TransferStatus.COMPLETED
    expect = np.zeros(SIZE, np.uint8)
    for a, b in zip(li, ri):
        expect[b * BLOCK:(b + 1) * BLOCK] = pair.ibuf[a * BLOCK:(a + 1) * BLOCK]
    assert np.array_equal(pair.tbuf, expect)
    dst = list(range(150, 250))  # READ back (sync, plain lists of ints) into blocks 150.. of ours
    assert pair.ini.transfer_prepped_sync(READ, lh, dst, rh, ri.tolist(), 10000) == SUCCESS, pair.ini.last_error()
    for a, b in zip(dst, ri):
        assert np.array_equal(pair.ibuf[a * BLOCK:(a + 1) * BLOCK], expect[b * BLOCK:(b + 1) * BLOCK])
    assert pair.ini.release_descs(lh) == SUCCESS and pair.ini.release_descs(rh) == SUCCESS
    assert pair.ini.release_descs(lh) == PARAM_INVALID
    assert pair.ini.transfer_prepped_sync(WRITE, lh, [0], rh, [0]) == PARAM_INVALID
    assert "not a prepared list" in pair.ini.last_error()


def test_a_hundred_thousand_descriptors_in_one_prepared_transfer(pair):
    n, block = 100_000, 8
    rc, lh = pair.ini.prep_descs(_blocks(pair.ia, n, block), block)
    assert rc == SUCCESS, pair.ini.last_error()
    rc, rh = pair.ini.prep_descs(_blocks(pair.ta, n, block), block, remote_engine=pair.peer)
    assert rc == SUCCESS, pair.ini.last_error()
    idx = np.arange(n, dtype=np.uint64)
    rev = idx[::-1].copy()
    assert pair.ini.transfer_prepped_sync(WRITE, lh, idx, rh, rev, 60000) == SUCCESS, pair.ini.last_error()
    src = pair.ibuf[:n * block].reshape(n, block)
    assert np.array_equal(pair.tbuf[:n * block].reshape(n, block), src[::-1])


@pytest.mark.parametrize("bad", ["index", "length", "swapped", "mismatch", "negative", "float"])
def test_bad_prepared_transfers_are_refused_naming_the_pair(pair, bad):
    lh, rh = _prep(pair, 16)
    rc, short = pair.ini.prep_descs([pair.ia], [BLOCK // 2])
    assert rc == SUCCESS
    li, ri, L, R = [0, 1, 2], [3, 4, 5], lh, rh
    if bad == "index":
        ri = [3, 4, 16]
    elif bad == "length":
        L, li = short, [0, 0, 0]
    elif bad == "swapped":
        L, R = rh, lh
    elif bad == "mismatch":
        ri = [3, 4]
    elif bad == "negative":
        li = [0, -1, 2]
    elif bad == "float":
        li = np.array([0.0, 1.0, 2.0])
    assert pair.ini.transfer_prepped_sync(WRITE, L, li, R, ri, 5000) == PARAM_INVALID
    err = pair.ini.last_error()
    if bad == "index":
        assert "desc=2" in err and "out of range" in err, err
    if bad == "length":
        assert "desc=0" in err and "length" in err, err
    assert not pair.tbuf.any()


def test_prep_refuses_blocks_outside_registered_memory(pair):
    rc, h = pair.ini.prep_descs([pair.ia, pair.ia + SIZE - 8], [64, 64])
    assert (rc, h) == (PARAM_INVALID, 0) and "block=1" in pair.ini.last_error()
    rc, h = pair.ini.prep_descs([pair.ta + SIZE], [8], remote_engine=pair.peer)
    assert (rc, h) == (PARAM_INVALID, 0) and "block=0" in pair.ini.last_error()
    assert pair.ini.prep_descs([], [])[0] == PARAM_INVALID
    assert pair.ini.prep_descs([pair.ia, pair.ia + 64], [64])[0] == PARAM_INVALID  # lengths differ in count


def test_read_only_region_refuses_prepared_writes_but_serves_reads(pair):
    ro = np.arange(BLOCK * 4, dtype=np.uint8)
    rc, h = pair.tgt.register_mem(MemDesc(ro.ctypes.data, ro.nbytes), MemType.MEM_HOST, access="ro")
    assert rc == SUCCESS
    lh, _ = _prep(pair, 4)
    rc, rh = pair.ini.prep_descs(_blocks(ro.ctypes.data, 4), BLOCK, remote_engine=pair.peer)
    assert rc == SUCCESS, pair.ini.last_error()
    assert pair.ini.transfer_prepped_sync(WRITE, lh, [0], rh, [1], 5000) == PARAM_INVALID
    assert "remote write" in pair.ini.last_error()
    assert np.array_equal(ro, np.arange(BLOCK * 4, dtype=np.uint8))
    assert pair.ini.transfer_prepped_sync(READ, lh, [0], rh, [1], 5000) == SUCCESS, pair.ini.last_error()
    assert np.array_equal(pair.ibuf[:BLOCK], ro[BLOCK:2 * BLOCK])


def test_lists_are_resolved_again_after_deregistration_on_either_side(pair):
    # A second local region holds blocks of its own; deregistering it must refuse only those blocks.
    extra = np.full(BLOCK * 2, 5, np.uint8)
    rc, eh = pair.ini.register_mem(MemDesc(extra.ctypes.data, extra.nbytes), MemType.MEM_HOST)
    assert rc == SUCCESS
    rc, lh = pair.ini.prep_descs([pair.ia, extra.ctypes.data], BLOCK)
    assert rc == SUCCESS, pair.ini.last_error()
    _, rh = _prep(pair, 8)
    assert pair.ini.transfer_prepped_sync(WRITE, lh, [1], rh, [0], 5000) == SUCCESS
    assert pair.ini.deregister_mem(eh) == SUCCESS
    assert pair.ini.transfer_prepped_sync(WRITE, lh, [1], rh, [1], 5000) == PARAM_INVALID
    assert "local block" in pair.ini.last_error()
    assert pair.ini.transfer_prepped_sync(WRITE, lh, [0], rh, [2], 5000) == SUCCESS, pair.ini.last_error()
    assert not pair.tbuf[BLOCK:2 * BLOCK].any()
    # The peer deregisters the region behind the remote list: once its new region list arrived, the
    # list is resolved again and refused.
    assert pair.tgt.deregister_mem(pair.th) == SUCCESS
    deadline = time.monotonic() + 30
    while pair.ini.get_link_info(pair.peer)[1].get("remote_regions") != 0:
        assert time.monotonic() < deadline, "the peer's new region list did not arrive"
        time.sleep(0.01)
    assert pair.ini.transfer_prepped_sync(WRITE, lh, [0], rh, [3], 5000) == PARAM_INVALID
    assert "remote block" in pair.ini.last_error()


def test_remote_list_follows_a_new_link(pair):
    lh, rh = _prep(pair, 8)
    assert pair.ini.disconnect(pair.peer, 5000) == SUCCESS
    assert pair.ini.transfer_prepped_sync(WRITE, lh, [0], rh, [0], 5000) != SUCCESS  # no link, no auto-connect
    assert pair.ini.connect(pair.peer, 10000) == SUCCESS, pair.ini.last_error()
    assert pair.ini.transfer_prepped_sync(WRITE, lh, [2], rh, [5], 5000) == SUCCESS, pair.ini.last_error()
    assert np.array_equal(pair.tbuf[5 * BLOCK:6 * BLOCK], pair.ibuf[2 * BLOCK:3 * BLOCK])


def test_prepared_flag_arrives_after_the_bytes(pair):
    lh, rh = _prep(pair, 8)
    rc, req = pair.ini.transfer_prepped_async(WRITE, lh, np.arange(8), rh, np.arange(8)[::-1], flag=77)
    assert rc == SUCCESS, pair.ini.last_error()
    assert pair.wait(req) == TransferStatus.COMPLETED
    rc, flags = pair.tgt.wait_flags(10000)
    assert rc == SUCCESS and flags == [(pair.ini.local_engine, 77)]
    assert np.array_equal(pair.tbuf[:BLOCK], pair.ibuf[7 * BLOCK:8 * BLOCK])
    assert pair.ini.transfer_prepped_sync(READ, lh, [0], rh, [0], flag=1) == PARAM_INVALID  # flags need WRITE


def test_the_one_descriptor_fast_path_refuses_what_the_full_path_refuses(pair):
    """transfer_async's shortcut for one TransferOpDesc (no options) checks as much as the full path."""
    from hixl import TransferOpDesc
    good = [TransferOpDesc(pair.ia, pair.ta, 64)]
    rc, req = pair.ini.transfer_async(pair.peer, WRITE, good)
    assert rc == SUCCESS and pair.wait(req) == TransferStatus.COMPLETED
    for remote, descs in (([pair.peer], good), (pair.peer, [TransferOpDesc(pair.ia, pair.ta, 0)]),
                          (pair.peer, [TransferOpDesc(pair.ia, pair.ta, True)]),
                          (pair.peer, [TransferOpDesc(pair.ia, 2 ** 64 - 8, 64)]),
                          (pair.peer, [TransferOpDesc(pair.ia, pair.ta + SIZE, 64)])):
        assert pair.ini.transfer_async(remote, WRITE, descs) == (PARAM_INVALID, 0), (remote, descs)
        assert pair.ini.last_error()
    assert np.array_equal(pair.tbuf[:64], pair.ibuf[:64]) and not pair.tbuf[64:].any()


# ------------------------------------------------------------------ TransferOpDesc lists read in C++
def test_descs_from_list_takes_only_the_plain_valid_form():
    """hixl._core.descs_from_list reads a list (or tuple) of TransferOpDesc whose fields are Python ints
    into an (N, 3) uint64 array, with the Python path's checks; every other form gives None (the Python
    path then decides), never an exception."""
    from hixl import TransferOpDesc, _core
    ok = [TransferOpDesc(4096 + 64 * k, 8192 + 64 * k, 64) for k in range(5)]
    for seq in (ok, tuple(ok)):
        a = _core.descs_from_list(seq)
        assert a.dtype == np.uint64 and a.tolist() == [[d.local_addr, d.remote_addr, d.len] for d in ok]
    assert _core.descs_from_list([TransferOpDesc(2 ** 64 - 8, 2 ** 64 - 8, 8)]).tolist() == [[2 ** 64 - 8] * 2 + [8]]

    class NoLen:
        local_addr, remote_addr = 1, 2
    for bad in ([], [TransferOpDesc(0, 1, 1)], [TransferOpDesc(1, 0, 1)], [TransferOpDesc(1, 1, 0)],
                [TransferOpDesc(2 ** 64 - 8, 1, 9)], [TransferOpDesc(1, 2 ** 64 - 8, 9)],
                [TransferOpDesc(-1, 1, 1)], [TransferOpDesc(2 ** 64, 1, 1)], [TransferOpDesc(1, 1, 2 ** 70)],
                [TransferOpDesc(np.uint64(1), 1, 1)], [TransferOpDesc(1, 1, True)], [TransferOpDesc(1.0, 1, 1)],
                [NoLen()], [None], ok + [object()], "abc", np.zeros((2, 3), np.uint64), {1: 2},
                type("ListOfDescs", (list,), {})(ok)):  # a subclass may iterate its own way: Python's path
        assert _core.descs_from_list(bad) is None, bad


def test_descs_from_list_survives_a_property_that_changes_the_list():
    """An attribute can be a property running Python code: one that empties the list being read (or
    raises) must not make the reader touch freed memory; the answer is None."""
    from hixl import _core
    victims: list = []

    class Evil:
        remote_addr, len = 4096, 64

        @property
        def local_addr(self):
            victims.clear()
            return 4096

    class Raises:
        remote_addr, len = 4096, 64

        @property
        def local_addr(self):
            raise RuntimeError("boom")
    victims.extend([Evil()] + [Evil() for _ in range(100)])
    assert _core.descs_from_list(victims) is None
    assert _core.descs_from_list([Raises(), Raises()]) is None


def test_lists_of_many_descriptors_move_through_the_c_reader_and_the_python_path(pair):
    """Lists of TransferOpDesc, sync and async: plain ints take the C++ reader, numpy integers the Python
    path; both move the same blocks, byte for byte, and a bad element refuses the whole call."""
    from hixl import TransferOpDesc
    n = 200
    plain = [TransferOpDesc(pair.ia + BLOCK * k, pair.ta + BLOCK * (n - 1 - k), BLOCK) for k in range(n)]
    assert pair.ini.transfer_sync(pair.peer, WRITE, plain) == SUCCESS, pair.ini.last_error()
    for k in (0, 17, n - 1):
        assert np.array_equal(pair.tbuf[BLOCK * (n - 1 - k):BLOCK * (n - k)], pair.ibuf[BLOCK * k:BLOCK * (k + 1)])
    pair.tbuf[:] = 0
    numpy_ints = [TransferOpDesc(np.uint64(d.local_addr), np.int64(d.remote_addr), np.uint32(d.len)) for d in plain]
    rc, req = pair.ini.transfer_async(pair.peer, WRITE, numpy_ints)
    assert rc == SUCCESS and pair.wait(req) == TransferStatus.COMPLETED
    assert np.array_equal(pair.tbuf[:BLOCK * n], pair.ibuf[:BLOCK * n].reshape(n, BLOCK)[::-1].reshape(-1))
    pair.tbuf[:] = 0
    rc, req = pair.ini.transfer_async(pair.peer, WRITE, tuple(plain), hixl.TransferArgs(user_data=3))
    assert rc == SUCCESS and pair.wait(req) == TransferStatus.COMPLETED
    assert np.array_equal(pair.tbuf[:BLOCK * n], pair.ibuf[:BLOCK * n].reshape(n, BLOCK)[::-1].reshape(-1))
    pair.tbuf[:] = 0
    for bad in (plain[:-1] + [TransferOpDesc(pair.ia, pair.ta, 0)],
                plain[:-1] + [TransferOpDesc(pair.ia, pair.ta + SIZE, BLOCK)]):
        assert pair.ini.transfer_sync(pair.peer, WRITE, bad) == PARAM_INVALID
        assert pair.ini.transfer_async(pair.peer, WRITE, bad) == (PARAM_INVALID, 0)
        assert pair.ini.last_error()
    assert not pair.tbuf.any()  # nothing of a refused call was posted
    rc, req = pair.ini.transfer_async(pair.peer, READ, plain)  # READ back what the target holds (zeros)
    assert rc == SUCCESS and pair.wait(req) == TransferStatus.COMPLETED
    assert not pair.ibuf[:BLOCK * n].any()
