"""The rdma defaults follow the device: on Soft-RoCE (rxe, vendor id 0xffffff) a link has 8 queue
pairs unless told otherwise, on hardware 1; the ACK timeout is 14 (67 ms) on both; work requests carry at
most 16 KiB on Soft-RoCE (more when a queue pair's share of a request would take more than 16 of them and
the queue pair has no send window), 4 MiB on hardware; a 64 KiB send window per queue pair on Soft-RoCE
where the end stripes its links (more than one queue pair), none elsewhere (engine/types.h).

rxe runs over ordinary Ethernet, which loses packets, and waits out a full ACK timeout for a lost packet
no NAK reports: on the two-host link (tests/twohost/test_faults.py) one queue pair kept 0.21x-0.28x of its
clean bandwidth at 1 % loss, 4 queue pairs 0.35x-0.51x, 8 with the window 0.63x-0.80x. Hardware
retransmits by itself on fabrics that rarely drop.

Whether the device is Soft-RoCE is read independently of hixl: from ``ibv_devinfo`` (rdma-core).
rdma only (rxe0 in the CI VM).
"""
from __future__ import annotations

import os
import subprocess
import time

import numpy as np
import pytest

import hixl
from hixl import SUCCESS, WRITE, MemDesc, TransferOpDesc

from .helpers import engine as _engine, linked as _linked, until as _until

pytestmark = pytest.mark.rdma


def _soft_roce(device: str) -> bool:
    out = subprocess.run(["ibv_devinfo", "-d", device], capture_output=True, text=True, check=True).stdout
    return any(line.split() == ["vendor_id:", "0xffffff"] for line in out.splitlines())


@pytest.mark.parametrize("a_opts,b_opts,qps,timeout_a", [
    ({}, {}, None, None),                                             # the device's defaults on both ends
    ({"HixlRdmaQpsPerLink": 1, "HixlRdmaTimeout": 12}, {}, 1, 12),    # told otherwise on one end
    ({}, {"HixlRdmaQpsPerLink": 2}, 2, None),                         # the smaller count of the two ends
])
def test_a_link_takes_the_devices_defaults_unless_told_otherwise(a_opts, b_opts, qps, timeout_a):
    """qps, timeout_a: what a_opts/b_opts ask for (None: nothing); b's ACK timeout is always the default."""
    a, b = _engine("rdma", **a_opts), _engine("rdma", **b_opts)
    n = 4 << 20
    src, dst = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8), np.zeros(n, np.uint8)
    try:
        assert a.register_mem(MemDesc(src.ctypes.data, n))[0] == SUCCESS, a.last_error()
        assert b.register_mem(MemDesc(dst.ctypes.data, n))[0] == SUCCESS, b.last_error()
        assert a.connect(b.local_engine, 20000) == SUCCESS, a.last_error()
        _until(lambda: _linked(b, a.local_engine), 10, "b's end of the link")
        (ra, ia), (rb, ib) = a.get_link_info(b.local_engine), b.get_link_info(a.local_engine)
        assert ra == SUCCESS and rb == SUCCESS, (a.last_error(), b.last_error())
        qps_d, timeout_d = (8, 14) if _soft_roce(ia["device"]) else (1, 14)
        want = qps_d if qps is None else min(qps, qps_d)
        assert (ia["qps"], ib["qps"]) == (want, want), (ia, ib)
        assert len(set(ia["qpns"])) == want and len(set(ib["qpns"])) == want, (ia, ib)
        # The ACK timeout is each end's own (its queue pairs' retransmit timer).
        assert ia["rdma_timeout"] == (timeout_d if timeout_a is None else timeout_a), ia
        assert ib["rdma_timeout"] == timeout_d, ib
        # Work requests of at most 16 KiB on Soft-RoCE (4 MiB on hardware), each end its own; without a send
        # window a queue pair's share of a request takes at most 16 of them (larger ones past 256 KiB).
        soft = _soft_roce(ia["device"])
        assert ia["rdma_max_wr_bytes"] == ib["rdma_max_wr_bytes"] == (16 * 1024 if soft else 4 << 20), (ia, ib)
        # A 64 KiB send window per queue pair on Soft-RoCE where the end stripes its links (its own setting,
        # default 8), none with one queue pair or on hardware. Each end its own.
        for opts, info in ((a_opts, ia), (b_opts, ib)):
            windowed = soft and int(opts.get("HixlRdmaQpsPerLink", qps_d)) > 1
            assert info["rdma_send_window_bytes"] == (64 * 1024 if windowed else 0), (opts, info)
        a_window = ia["rdma_send_window_bytes"] > 0
        # The link moves bytes across all its queue pairs (stripes of at least 64 KiB each).
        for size, stripes in ((256 * 1024, min(4, want)), (n, want)):
            posted = a.get_link_info(b.local_engine)[1]["posted_wrs"]
            dst[:] = 0
            assert a.transfer_sync(b.local_engine, WRITE, [TransferOpDesc(src.ctypes.data, dst.ctypes.data, size)],
                                   60000) == SUCCESS, a.last_error()
            np.testing.assert_array_equal(dst[:size], src[:size])
            per = size // stripes  # bytes per queue pair
            if a_window:  # work requests keep their 16 KiB
                wrs = -(-per // (16 * 1024))
            else:
                wrs = -(-per // max(16 * 1024, -(-per // 16))) if soft else -(-per // (4 << 20))
            assert a.get_link_info(b.local_engine)[1]["posted_wrs"] - posted == stripes * wrs, (size, stripes, wrs)
    finally:
        a.finalize()
        b.finalize()


def _threads() -> int:
    """This process's thread count, the least of a few looks (a handshake's helper may be on its way out)."""
    n = []
    for _ in range(5):
        n.append(len(os.listdir("/proc/self/task")))
        time.sleep(0.05)
    return min(n)


def test_a_striped_link_costs_no_more_threads_than_a_single_queue_pair():
    """With 4 queue pairs per link (8: the Soft-RoCE default) one thread per link end still receives the
    completion flags of all of them (one poll() on their channels), not one thread per queue pair."""
    grew = {}
    for qps in (1, 4):
        a, b = _engine("rdma", HixlRdmaQpsPerLink=qps), _engine("rdma", HixlRdmaQpsPerLink=qps)
        try:
            before = _threads()
            assert a.connect(b.local_engine, 20000) == SUCCESS, a.last_error()
            _until(lambda: _linked(b, a.local_engine), 10, "b's end of the link")
            assert a.get_link_info(b.local_engine)[1]["qps"] == qps
            time.sleep(0.2)  # every thread the link starts is started
            grew[qps] = _threads() - before
        finally:
            a.finalize()
            b.finalize()
    assert grew[4] == grew[1], grew
