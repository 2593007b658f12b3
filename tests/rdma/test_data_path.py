"""Tier 2 (`rdma`): real bytes over an RC QP on an RDMA device (rxe0 inside the CI VM)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import hixl
from hixl import Op, TransferStatus

from .conftest import connected_pair

pytestmark = pytest.mark.rdma

MiB = 1 << 20
SIZES = [1, 7, 63, 4095, 4097, 65537, MiB + 3, 4 * MiB + 1, 9 * MiB + 5, 64 * MiB]


def _bufs(size, rng, pad=64):
    src = rng.integers(0, 256, size + pad, dtype=np.uint8)
    dst = np.zeros(size + pad, np.uint8)
    return src, dst


@pytest.mark.parametrize("size", SIZES)
def test_write_read_imm_at_unaligned_offsets(pair, rng, size):
    a, b = pair
    src, dst = _bufs(size, rng)
    ma, mb = a.register(src), b.register(dst)
    soff, doff = 3, 17  # deliberately unaligned on both sides

    a.wait_ok(a.write([(ma.addr + soff, mb.addr + doff, size)], mb.rkey), 120000)
    np.testing.assert_array_equal(dst[doff:doff + size], src[soff:soff + size])
    assert not dst[:doff].any() and not dst[doff + size:].any(), "bytes outside the range were touched"

    # READ back into a fresh local buffer from the peer's region.
    back = np.zeros(size + 64, np.uint8)
    mback = a.register(back)
    a.wait_ok(a.read([(mback.addr + 5, mb.addr + doff, size)], mb.rkey), 120000)
    np.testing.assert_array_equal(back[5:5 + size], src[soff:soff + size])

    # WRITE_WITH_IMM: bytes land, the immediate arrives as a receive completion on the peer.
    src2 = rng.integers(0, 256, size + 64, dtype=np.uint8)
    m2 = a.register(src2)
    imm = 0xC0DE0000 | (size & 0xFFFF)
    a.wait_ok(a.write_imm([(m2.addr + 1, mb.addr + doff, size)], mb.rkey, imm), 120000)
    assert b.wait_imm(5000) == imm
    np.testing.assert_array_equal(dst[doff:doff + size], src2[1:1 + size])
    if size > a.slice_bytes:
        assert a.stats()["posted_wrs"] > 3, "large transfers must be sliced into several work requests"


def test_zero_length_write_with_imm_is_a_pure_flag(pair):
    a, b = pair
    a.wait_ok(a.write_imm([], 0, 0xFEEDBEEF))
    assert b.wait_imm(5000) == 0xFEEDBEEF


def test_ten_thousand_descriptors_in_one_call(pair, rng):
    a, b = pair
    n, chunk = 10_000, 61
    src = rng.integers(0, 256, n * chunk, dtype=np.uint8)
    dst = np.zeros(n * 64, np.uint8)
    ma, mb = a.register(src), b.register(dst)
    perm = rng.permutation(n)
    descs = [(ma.addr + i * chunk, mb.addr + int(perm[i]) * 64, chunk) for i in range(n)]
    before = a.stats()
    a.wait_ok(a.write(descs, mb.rkey), 300000)
    view = dst.reshape(n, 64)
    np.testing.assert_array_equal(view[perm, :chunk], src.reshape(n, chunk))
    after = a.stats()
    assert after["posted_wrs"] - before["posted_wrs"] == n
    # Doorbell batching: far fewer ibv_post_send calls than work requests.
    assert after["doorbells"] - before["doorbells"] <= n // 16
    # Selective signaling: most work requests are unsignaled.
    assert after["signaled"] - before["signaled"] < n // 2


def test_ten_times_queue_depth_outstanding_never_fails(rng):
    a, b = connected_pair(sq_depth=32)
    try:
        depth = a.sq_depth
        assert depth <= 64
        size = 256
        total = 10 * depth
        src = rng.integers(0, 256, total * size, dtype=np.uint8)
        dst = np.zeros_like(src)
        ma, mb = a.register(src), b.register(dst)
        reqs = [a.write([(ma.addr + i * size, mb.addr + i * size, size)], mb.rkey) for i in range(total)]
        assert a.stats()["backpressure_waits"] > 0, "the caller should have been made to wait for room"
        for r in reqs:
            a.wait_ok(r, 60000)
        np.testing.assert_array_equal(dst, src)
        # One request with 10x depth descriptors, too.
        dst[:] = 0
        a.wait_ok(a.write([(ma.addr + i * size, mb.addr + i * size, size) for i in range(total)], mb.rkey), 60000)
        np.testing.assert_array_equal(dst, src)
        assert a.outstanding == 0
    finally:
        a.close()
        b.close()


def test_many_immediates_replenish_receives(rng):
    """20x the receive queue depth of immediates: receives are re-posted as they are consumed."""
    a, b = connected_pair(rq_depth=16)
    try:
        vals = [int(v) for v in rng.integers(0, 2**32, 320, dtype=np.uint64)]
        got = []

        def consume():
            deadline = time.monotonic() + 120
            while len(got) < len(vals) and time.monotonic() < deadline:
                v = b.wait_imm(1000)
                if v is not None:
                    got.append(v)
                    got.extend(b.poll_imm(64))

        t = threading.Thread(target=consume)
        t.start()
        for v in vals:
            a.write_imm([], 0, v)  # never waits for the receiver: RNR flow control + backpressure
        t.join()
        assert got == vals
        assert b.stats()["imm_received"] == len(vals)
    finally:
        a.close()
        b.close()


def test_blocking_wait_really_times_out(pair):
    a, b = pair
    t0 = time.monotonic()
    assert b.wait_imm(300) is None
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.29, f"returned after {elapsed:.3f}s, before its timeout"
    assert elapsed < 10, "the timeout did not end the wait"


def test_blocking_wait_releases_the_gil(pair):
    a, b = pair
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    b.wait_imm(500)
    stop.set()
    t.join()
    assert len(ticks) > 20, "another Python thread could not run during a blocking wait"


def test_request_deadline_reports_timeout_state(pair, rng):
    a, b = pair
    src, dst = _bufs(8 * MiB, rng)
    ma, mb = a.register(src), b.register(dst)
    req = a.write([(ma.addr, mb.addr, 8 * MiB)], mb.rkey, timeout_ms=0)
    st = a.wait(req, 60000)
    assert st in (TransferStatus.TIMEOUT, TransferStatus.COMPLETED)
    # A request id is forgotten once its terminal state was reported: unknown ids report FAILED.
    assert a.status(req) == TransferStatus.FAILED


def test_local_range_outside_registration_is_refused_before_posting(pair, rng):
    a, b = pair
    src, dst = _bufs(4096, rng)
    ma, mb = a.register(src), b.register(dst)
    posted = a.stats()["posted_wrs"]
    with pytest.raises(hixl.HixlError, match="not inside a region registered"):
        a.write([(ma.addr, mb.addr, 8192)], mb.rkey)
    with pytest.raises(hixl.HixlError, match="not inside a region registered"):
        a.write([(ma.addr, mb.addr, 16), (ma.addr + 100000, mb.addr, 16)], mb.rkey)
    assert a.stats()["posted_wrs"] == posted
    assert not a.dead


def test_bad_rkey_fails_with_wc_status_string(pair, rng):
    a, b = pair
    src, dst = _bufs(4096, rng)
    ma, mb = a.register(src), b.register(dst)
    req = a.write([(ma.addr, mb.addr, 4096)], mb.rkey ^ 0x5A5A5A)
    st, err = a.wait_result(req, 30000)
    assert st == TransferStatus.FAILED
    assert "remote access error" in err.lower() or "REM_ACCESS" in err.upper(), err
    assert "qp_num" in err and "opcode" in err
    assert a.dead
    with pytest.raises(hixl.HixlError, match="error state"):
        a.write([(ma.addr, mb.addr, 1)], mb.rkey)


def test_read_only_region_refuses_remote_writes(pair, rng):
    a, b = pair
    src, dst = _bufs(4096, rng)
    ma = a.register(src)
    mb = b.register(dst, access=hixl.ACCESS_RO | hixl.endpoint.ACCESS_LOCAL_WRITE)
    st, err = a.wait_result(a.write([(ma.addr, mb.addr, 4096)], mb.rkey), 30000)
    assert st == TransferStatus.FAILED and "remote" in err.lower()
    assert not dst.any(), "a read-only region was modified"


def test_register_variants_and_errors(pair):
    a, _ = pair
    ba = bytearray(b"x" * 4096)
    m1 = a.register(ba)
    assert m1.length == 4096 and m1.owner is ba
    mv = memoryview(bytearray(8192))[4096:]
    m2 = a.register(mv)
    assert m2.length == 4096
    arr = np.zeros(1 << 16, np.uint8)
    m3 = a.register(arr.ctypes.data, arr.nbytes)
    assert m3.addr == arr.ctypes.data
    with pytest.raises(hixl.HixlError, match="length is required"):
        a.register(arr.ctypes.data)
    with pytest.raises(hixl.HixlError, match="must be > 0"):
        a.register(arr.ctypes.data, 0)
    with pytest.raises(hixl.HixlError, match="C-contiguous"):
        a.register(np.zeros((64, 64), np.uint8)[:, ::2])
    with pytest.raises(hixl.HixlError, match="buffer protocol"):
        a.register("not a buffer")
    with pytest.raises(hixl.HixlError, match=r"ibv_reg_mr\(address=0x1000, length=4096"):
        a.register(0x1000, 4096)  # unmapped: the verbs error names the call and its arguments
    with pytest.raises(hixl.HixlError, match="unknown handle"):
        a.deregister(123456)
    for m in (m1, m2, m3):
        a.deregister(m)


def test_connect_validates_peer_info():
    a = hixl.Endpoint()
    try:
        with pytest.raises(hixl.HixlError, match="missing key 'qpn'"):
            a.connect({"psn": 1, "gid": "::1"})
        with pytest.raises(hixl.HixlError, match="MTU must be"):
            a.connect({**a.info(), "mtu": 1500})
        with pytest.raises(hixl.HixlError, match="not connected"):
            a.write([], 0)
    finally:
        a.close()


def test_oob_tcp_handshake_exchanges_regions(rng):
    srv, cli = hixl.Endpoint(), hixl.Endpoint()
    try:
        dst = np.zeros(1 << 16, np.uint8)
        md = srv.register(dst)
        port = srv.listen("127.0.0.1", 0)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("peer", srv.accept(20000)))
        t.start()
        peer = cli.connect_tcp("127.0.0.1", port, 20000)
        t.join()
        assert out["peer"]["qpn"] == cli.info()["qpn"]
        [region] = peer["regions"]
        assert (region["addr"], region["len"], region["rkey"]) == (md.addr, md.length, md.rkey)
        src = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
        ms = cli.register(src)
        cli.wait_ok(cli.write([(ms.addr, region["addr"], 1 << 16)], region["rkey"]))
        np.testing.assert_array_equal(dst, src)
    finally:
        cli.close()
        srv.close()


def test_accept_and_connect_time_out_cleanly():
    ep = hixl.Endpoint()
    try:
        ep.listen("127.0.0.1", 0)
        t0 = time.monotonic()
        with pytest.raises(hixl.HixlError, match="no peer connected"):
            ep.accept(200)
        assert time.monotonic() - t0 < 10
        with pytest.raises(hixl.HixlError, match=r"connect\(host=127.0.0.1, port=1"):
            hixl.Endpoint().connect_tcp("127.0.0.1", 1, 500)
    finally:
        ep.close()


def test_transfer_to_exited_peer_fails_clearly(rng):
    """The peer process registers memory, connects, then exits; our write must FAIL, not hang."""
    peer = subprocess.Popen([sys.executable, str(Path(__file__).with_name("peer_proc.py"))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ep = hixl.Endpoint(timeout=12, retry_cnt=3)
    try:
        info = json.loads(peer.stdout.readline())
        ep.connect(info)
        peer.stdin.write(json.dumps(ep.info()) + "\n")
        peer.stdin.flush()
        assert peer.stdout.readline().strip() == "connected"
        src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        ms = ep.register(src)
        [region] = info["regions"]
        ep.wait_ok(ep.write([(ms.addr, region["addr"], 4096)], region["rkey"]), 30000)  # works while alive
        peer.stdin.close()
        assert peer.wait(30) == 0
        t0 = time.monotonic()
        st, err = ep.wait_result(ep.write([(ms.addr, region["addr"], 1 << 20)], region["rkey"]), 120000)
        assert st == TransferStatus.FAILED, (st, err)
        assert "retry" in err.lower() and "peer" in err.lower(), err
        assert time.monotonic() - t0 < 120, "the failure took too long to surface"
        with pytest.raises(hixl.HixlError, match="error state"):
            ep.write([(ms.addr, region["addr"], 1)], region["rkey"])
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
        for f in (peer.stdin, peer.stdout):
            if f and not f.closed:
                f.close()
        ep.close()


def test_acl_device_memory_is_registrable_and_transfers(pair, rng):
    """Memory from the aclrtMalloc shim (every policy that works here) pins and carries RDMA traffic."""
    from hixl import acl
    a, b = pair
    size = 3 * MiB + 5
    for policy in (acl.ACL_MEM_MALLOC_HUGE_FIRST, acl.ACL_MEM_MALLOC_NORMAL_ONLY):
        ret, src_addr = acl.aclrtMalloc(size, policy)
        assert ret == acl.ACL_SUCCESS, acl.last_error()
        ret, dst_addr = acl.aclrtMalloc(size, policy)
        assert ret == acl.ACL_SUCCESS, acl.last_error()
        try:
            data = rng.integers(0, 256, size, dtype=np.uint8)
            assert acl.aclrtMemcpy(src_addr, size, data.ctypes.data, size, acl.ACL_MEMCPY_HOST_TO_DEVICE) == 0
            ms, md = a.register(src_addr, size), b.register(dst_addr, size)
            a.wait_ok(a.write([(ms.addr, md.addr, size)], md.rkey), 120000)
            out = np.zeros(size, np.uint8)
            assert acl.aclrtMemcpy(out.ctypes.data, size, dst_addr, size, acl.ACL_MEMCPY_DEVICE_TO_HOST) == 0
            np.testing.assert_array_equal(out, data)
            a.deregister(ms)
            b.deregister(md)
        finally:
            assert acl.aclrtFree(src_addr) == 0 and acl.aclrtFree(dst_addr) == 0


def _gid_type(dev, port, index):
    p = Path(f"/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/types/{index}")
    return p.read_text().strip() if p.exists() else ""


def test_gid_auto_selection_prefers_rocev2_ipv4_mapped(monkeypatch):
    monkeypatch.delenv("HIXL_GID_INDEX", raising=False)
    ep = hixl.Endpoint()
    try:
        info = ep.info()
        if info["link_layer"] != "Ethernet":
            pytest.skip("InfiniBand port: GID index 0 is used")
        assert info["gid"].startswith("::ffff:"), info
        assert "v2" in _gid_type(info["device"], info["port"], info["gid_index"])
    finally:
        ep.close()


def test_gid_index_override_and_its_errors(monkeypatch):
    monkeypatch.setenv("HIXL_GID_INDEX", "0")
    ep = hixl.Endpoint()
    assert ep.info()["gid_index"] == 0
    ep.close()
    ep = hixl.Endpoint(gid_index=1)  # the explicit argument wins over the environment
    assert ep.info()["gid_index"] == 1
    ep.close()
    monkeypatch.setenv("HIXL_GID_INDEX", "250")
    with pytest.raises(hixl.HixlError, match="beyond gid_tbl_len|GID entry is empty"):
        hixl.Endpoint()
    monkeypatch.setenv("HIXL_GID_INDEX", "4096")
    with pytest.raises(hixl.HixlError, match='HIXL_GID_INDEX="4096": not a GID index'):
        hixl.Endpoint()
    with pytest.raises(hixl.HixlError, match=r"index=4096\): index beyond gid_tbl_len"):
        hixl.Endpoint(gid_index=4096)
    monkeypatch.setenv("HIXL_GID_INDEX", "one")
    with pytest.raises(hixl.HixlError, match='HIXL_GID_INDEX="one"'):
        hixl.Endpoint()


def test_device_selection_by_name(monkeypatch):
    name = hixl.list_devices()[0]["name"]
    monkeypatch.setenv("HIXL_DEVICE", name)
    ep = hixl.Endpoint()
    assert ep.info()["device"] == name
    ep.close()
    monkeypatch.setenv("HIXL_DEVICE", "no-such-hca")
    with pytest.raises(hixl.HixlError, match=r'RDMA device "no-such-hca" not found \(devices: '):
        hixl.Endpoint()


def test_path_mtu_is_the_minimum_of_both_ends(rng):
    a, b = hixl.Endpoint(), hixl.Endpoint()
    try:
        # Each end advertises 256 (as a peer on a 256-MTU port would); both must settle on min = 256.
        assert a.info()["mtu"] > 256
        a.connect({**b.info(), "mtu": 256})
        b.connect({**a.info(), "mtu": 256})
        assert a.path_mtu == 256 and b.path_mtu == 256
        src = rng.integers(0, 256, 10_000, dtype=np.uint8)
        dst = np.zeros_like(src)
        ms, md = a.register(src), b.register(dst)
        a.wait_ok(a.write([(ms.addr, md.addr, src.nbytes)], md.rkey))  # 40 packets of 256 B
        np.testing.assert_array_equal(dst, src)
    finally:
        a.close()
        b.close()


def test_registered_bytearray_cannot_be_resized_under_the_nic(pair):
    a, _ = pair
    ba = bytearray(4096)
    m = a.register(ba)
    with pytest.raises(BufferError):
        ba.extend(b"x" * 4096)  # would reallocate the memory the NIC may be writing
    a.deregister(m)
    ba.extend(b"x")  # fine once deregistered
    assert len(ba) == 4097


def test_read_into_region_without_local_write_is_refused_before_posting(pair, rng):
    a, b = pair
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    mb = b.register(src)
    local = np.zeros(4096, np.uint8)
    ml = a.register(local, access=hixl.endpoint.ACCESS_REMOTE_READ)  # no LOCAL_WRITE
    with pytest.raises(hixl.HixlError, match="without LOCAL_WRITE"):
        a.read([(ml.addr, mb.addr, 4096)], mb.rkey)
    assert not a.dead


def test_submit_deadline_bounds_a_backpressure_stall():
    """Receiver never consumes immediates: after its receives run out the sender is RNR-stalled and
    the send queue fills. A submit with a deadline must come back TIMEOUT instead of blocking forever."""
    a, b = connected_pair(sq_depth=8, rq_depth=4)
    try:
        t0 = time.monotonic()
        timed_out_at = None
        for i in range(200):
            r = a.write_imm([], 0, i, timeout_ms=1500)
            if a.status(r) == TransferStatus.TIMEOUT:
                timed_out_at = i
                break
        assert timed_out_at is not None and timed_out_at >= 4, timed_out_at
        assert time.monotonic() - t0 < 60
        # Once the receiver consumes, the stalled work drains and the endpoint is still usable.
        got = []
        deadline = time.monotonic() + 60
        while len(got) < timed_out_at and time.monotonic() < deadline:
            v = b.wait_imm(1000)
            if v is not None:
                got.append(v)
        assert got[:4] == [0, 1, 2, 3]
        a.wait_ok(a.write_imm([], 0, 999), 60000)
    finally:
        a.close()
        b.close()


def test_huge_timeouts_mean_forever_not_overflow(pair, rng):
    a, b = pair
    src, dst = _bufs(4096, rng)
    ma, mb = a.register(src), b.register(dst)
    req = a.write([(ma.addr, mb.addr, 4096)], mb.rkey, timeout_ms=2**62)
    assert a.wait(req, 2**62) == TransferStatus.COMPLETED
    assert b.wait_imm(0) is None


def test_concurrent_waiters_on_one_endpoint(pair, rng):
    """Eight threads submit and wait on one endpoint; none may lose a wakeup or see another's status."""
    a, b = pair
    n, size = 8, 1 << 16
    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    dst = np.zeros_like(src)
    ma, mb = a.register(src), b.register(dst)
    errors = []

    def worker(k):
        try:
            for rep in range(20):
                off = k * size
                a.wait_ok(a.write([(ma.addr + off, mb.addr + off, size)], mb.rkey), 60000)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and all(not t.is_alive() for t in threads)
    np.testing.assert_array_equal(dst, src)
    assert time.monotonic() - t0 < 300
