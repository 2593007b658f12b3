"""Tier 2 (`rdma`): the send window (EndpointOptions::window_bytes, the engine's HixlRdmaSendWindowBytes).

A queue pair keeps at most window_bytes of work requests posted and not yet completed (at least one);
what does not fit waits in the endpoint, in submission order, and is posted as completions come back.
Here one endpoint has no driver thread (the engine's links have one: tests/test_send_window_engine.py),
so whoever polls or waits posts. Every request still lands whole and in order, a completion flag
(WRITE_WITH_IMM) still follows every byte before it, and a request that waits for the window still
ends by its deadline, or FAILED when the endpoint closes.
"""
from __future__ import annotations

import numpy as np
import pytest

from hixl import TransferStatus

from .conftest import connected_pair

pytestmark = pytest.mark.rdma

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def windowed():
    a, b = connected_pair(window_bytes=16 * KiB, slice_bytes=4 * KiB)
    yield a, b
    a.close()
    b.close()


def test_the_window_bounds_what_is_posted_and_every_request_lands_whole_in_order(windowed, rng):
    a, b = windowed
    assert a.window_bytes == 16 * KiB
    n, size = 8, 256 * KiB + 3
    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros(n * size + 64, np.uint8)
    ma, mb = a.register(src), b.register(dst)
    reqs = [a.write([(ma.addr + i * size, mb.addr + i * size, size)], mb.rkey) for i in range(n)]
    # submit() returned at once for all of them: the window holds 16 KiB (4 work requests of 4 KiB), the
    # send queue 256, so most of it waits in the endpoint, not in the submitter.
    assert a.outstanding <= 4, a.outstanding
    # A flag behind them arrives after every byte of every one of them.
    imm_req = a.write_imm([], 0, 0xABCD)
    for r in reqs:
        a.wait_ok(r, 60000)
    a.wait_ok(imm_req, 60000)
    assert b.wait_imm(5000) == 0xABCD
    np.testing.assert_array_equal(dst[:n * size], src)
    assert not dst[n * size:].any()
    st = a.stats()
    assert st["posted_wrs"] == n * -(-size // (4 * KiB)) + 1, st
    assert a.outstanding == 0


def test_many_small_descriptors_go_through_the_window(windowed, rng):
    a, b = windowed
    n, chunk = 3000, 100
    src = rng.integers(0, 256, n * chunk, dtype=np.uint8)
    dst = np.zeros(n * 128, np.uint8)
    ma, mb = a.register(src), b.register(dst)
    perm = rng.permutation(n)
    a.wait_ok(a.write([(ma.addr + i * chunk, mb.addr + int(perm[i]) * 128, chunk) for i in range(n)], mb.rkey),
              120000)
    np.testing.assert_array_equal(dst.reshape(n, 128)[perm, :chunk], src.reshape(n, chunk))
    # READ back through the window too.
    back = np.zeros_like(src)
    mback = a.register(back)
    a.wait_ok(a.read([(mback.addr + i * chunk, mb.addr + int(perm[i]) * 128, chunk) for i in range(n)], mb.rkey),
              120000)
    np.testing.assert_array_equal(back, src)


@pytest.fixture
def stop_and_wait(rng):
    """One work request in flight at a time (a window smaller than one): 16 MiB takes 4096 of them.
    (a, b, src region, dst array, dst region)."""
    a, b = connected_pair(window_bytes=1, slice_bytes=4 * KiB)
    size = 16 * MiB
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    yield a, b, a.register(src), dst, b.register(dst)
    a.close()
    b.close()


def test_a_request_waiting_for_the_window_ends_by_its_deadline_and_the_next_ones_go(stop_and_wait, rng):
    a, b, ma, dst, mb = stop_and_wait
    req = a.write([(ma.addr, mb.addr, 16 * MiB)], mb.rkey, timeout_ms=0)
    st, err = a.wait_result(req, 30000)
    assert st == TransferStatus.TIMEOUT, (st, err)
    assert "deadline" in err and "send window" in err, err
    assert not a.dead, a.dead_reason
    # What was posted of it flies on; what was not is dropped; the link goes on.
    small = rng.integers(0, 256, 4096, dtype=np.uint8)
    ms = a.register(small)
    a.wait_ok(a.write([(ms.addr, mb.addr + 8192, 4096)], mb.rkey), 30000)
    np.testing.assert_array_equal(dst[8192:12288], small)


def test_close_fails_the_requests_still_waiting_for_the_window(stop_and_wait):
    a, b, ma, dst, mb = stop_and_wait
    reqs = [a.write([(ma.addr, mb.addr, 16 * MiB)], mb.rkey) for _ in range(3)]
    raw = a.raw
    a.close()
    for r in reqs:
        st, err = raw.status(r)
        assert TransferStatus(st) == TransferStatus.FAILED, (st, err)
        assert "closed" in err, err
