"""The send window on an engine's link (HixlRdmaSendWindowBytes, opt-in): asynchronous requests move on
while nobody waits for them, because the link's thread posts what waits for the window as completions
come back; bytes land whole, in order; the other end keeps its own setting. rdma only (rxe0 in the CI VM)."""
from __future__ import annotations

import numpy as np
import pytest

from hixl import SUCCESS, WRITE, MemDesc, TransferOpDesc, TransferStatus

from .helpers import engine as _engine, linked as _linked, until as _until

pytestmark = pytest.mark.rdma

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("qps", [1, 4])
def test_async_requests_move_through_the_window_with_nobody_waiting(qps):
    window, wr = 8 * KiB, 4 * KiB
    a = _engine("rdma", HixlRdmaSendWindowBytes=window, HixlRdmaMaxWrBytes=wr, HixlRdmaQpsPerLink=qps)
    b = _engine("rdma", HixlRdmaQpsPerLink=qps, HixlRdmaSendWindowBytes=16 * KiB)
    n, size = 8, MiB + 4 * KiB  # 257 work requests on one queue pair; on 4, 4 stripes of 65 (64.25 KiB each)
    src = np.random.default_rng(11).integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros(n * size, np.uint8)
    try:
        assert a.register_mem(MemDesc(src.ctypes.data, src.nbytes))[0] == SUCCESS, a.last_error()
        assert b.register_mem(MemDesc(dst.ctypes.data, dst.nbytes))[0] == SUCCESS, b.last_error()
        assert a.connect(b.local_engine, 20000) == SUCCESS, a.last_error()
        _until(lambda: _linked(b, a.local_engine), 10, "b's end of the link")
        rc, info = a.get_link_info(b.local_engine)
        assert rc == SUCCESS and info["qps"] == qps, info
        assert (info["rdma_send_window_bytes"], info["rdma_max_wr_bytes"]) == (window, wr), info
        posted = info["posted_wrs"]
        reqs = []
        for i in range(n):
            rc, req = a.transfer_async(b.local_engine, WRITE, [TransferOpDesc(
                src.ctypes.data + i * size, dst.ctypes.data + i * size, size)])
            assert rc == SUCCESS, a.last_error()
            reqs.append(req)
        stripes = min(qps, -(-size // (64 * KiB)))  # transport/data_path.h: stripes of at least 64 KiB
        per = -(-size // stripes)
        want = n * sum(-(-part // wr) for part in [per] * (stripes - 1) + [size - per * (stripes - 1)])
        # Nobody asks for a status meanwhile: get_link_info only reads the counters.
        _until(lambda: a.get_link_info(b.local_engine)[1]["posted_wrs"] - posted == want, 120,
               "the link's thread to post all %d work requests" % want)
        for req in reqs:
            rc, st = a.transfer_wait(req, 60000)
            assert (rc, st) == (SUCCESS, TransferStatus.COMPLETED), (rc, st, a.last_error())
        np.testing.assert_array_equal(dst, src)
        # b's end keeps its own.
        rb, ib = b.get_link_info(a.local_engine)
        assert rb == SUCCESS and ib["rdma_send_window_bytes"] == 16 * KiB, ib
    finally:
        a.finalize()
        b.finalize()


def test_a_completion_flag_behind_a_windowed_request_follows_every_byte_of_it():
    """With the device's other defaults (Soft-RoCE: 8 queue pairs, 16 KiB work requests) and a 64 KiB window,
    an async 4 MiB WRITE with a completion flag: when the peer has the flag, it has every byte."""
    a = _engine("rdma", HixlRdmaSendWindowBytes=64 * KiB)
    b = _engine("rdma")
    n = 4 * MiB
    src = np.random.default_rng(12).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    try:
        assert a.register_mem(MemDesc(src.ctypes.data, n))[0] == SUCCESS, a.last_error()
        assert b.register_mem(MemDesc(dst.ctypes.data, n))[0] == SUCCESS, b.last_error()
        assert a.connect(b.local_engine, 20000) == SUCCESS, a.last_error()
        assert a.get_link_info(b.local_engine)[1]["rdma_send_window_bytes"] == 64 * KiB
        rc, req = a.transfer_async(b.local_engine, WRITE, [TransferOpDesc(src.ctypes.data, dst.ctypes.data, n)],
                                   flag=7)
        assert rc == SUCCESS, a.last_error()
        assert b.wait_flags(60000) == (SUCCESS, [(a.local_engine, 7)])
        np.testing.assert_array_equal(dst, src)
        rc, st = a.transfer_wait(req, 60000)
        assert (rc, st) == (SUCCESS, TransferStatus.COMPLETED), (rc, st, a.last_error())
    finally:
        a.finalize()
        b.finalize()
