"""hixl.acl: the aclrtMalloc-style shim. Tier (a): no device needed, always runs."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from hixl import acl

PAGE = mmap.PAGESIZE
MiB = 1 << 20
POOL = Path("/sys/kernel/mm/hugepages/hugepages-2048kB")
THP = Path("/sys/kernel/mm/transparent_hugepage")


def view(addr: int, n: int) -> np.ndarray:
    """A numpy uint8 view of n bytes at addr (valid only while the allocation lives)."""
    return np.frombuffer((ctypes.c_char * n).from_address(addr), dtype=np.uint8)


def read_int(path: Path) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def thp_mode(name: str) -> str:
    """The selected value of a THP control ("[madvise]" -> "madvise"), honouring per-size overrides."""

    def selected(path: Path) -> str:
        try:
            text = path.read_text()
        except OSError:
            return ""
        return text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()

    per = selected(THP / "hugepages-2048kB" / name)
    return selected(THP / name) if per in ("", "inherit") else per


@pytest.fixture
def alloc():
    """alloc(size, policy) -> addr; everything still live is freed at teardown."""
    live: list[int] = []

    def make(size: int, policy: int = acl.ACL_MEM_MALLOC_NORMAL_ONLY) -> int:
        ret, addr = acl.aclrtMalloc(size, policy)
        assert ret == acl.ACL_SUCCESS, acl.last_error()
        live.append(addr)
        return addr

    yield make
    for addr in live:
        acl.aclrtFree(addr)  # INVALID_PARAM for ones a test already freed; that's fine


def test_constants_match_cann():
    assert (acl.ACL_SUCCESS, acl.ACL_ERROR_INVALID_PARAM, acl.ACL_ERROR_BAD_ALLOC) == (0, 100000, 200000)
    assert (acl.ACL_ERROR_API_NOT_SUPPORT, acl.ACL_ERROR_MEMORY_ADDRESS_UNALIGNED) == (200001, 200003)
    assert (acl.ACL_ERROR_FEATURE_UNSUPPORTED, acl.ACL_ERROR_INTERNAL_ERROR) == (200006, 500000)
    assert (acl.ACL_MEM_MALLOC_HUGE_FIRST, acl.ACL_MEM_MALLOC_HUGE_ONLY, acl.ACL_MEM_MALLOC_NORMAL_ONLY) == (0, 1, 2)
    assert (acl.ACL_MEM_TYPE_LOW_BAND_WIDTH, acl.ACL_MEM_TYPE_HIGH_BAND_WIDTH) == (0x100, 0x1000)
    kinds = (acl.ACL_MEMCPY_HOST_TO_HOST, acl.ACL_MEMCPY_HOST_TO_DEVICE, acl.ACL_MEMCPY_DEVICE_TO_HOST)
    assert kinds + (acl.ACL_MEMCPY_DEVICE_TO_DEVICE, acl.ACL_MEMCPY_DEFAULT) == (0, 1, 2, 3, 4)
    assert (acl.ACL_DDR_MEM, acl.ACL_HBM_MEM, acl.ACL_HBM_MEM_HUGE, acl.ACL_HBM_MEM_P2P_NORMAL) == (0, 1, 4, 9)
    core = {name for name in dir(acl._acl) if name.startswith("ACL_")}
    assert core <= set(acl.__all__) and all(hasattr(acl, name) for name in acl.__all__)


def test_malloc_write_read_through_numpy(alloc):
    n = 3 * PAGE + 5
    addr = alloc(n)
    assert addr % PAGE == 0
    assert acl.last_error() == ""
    mem = view(addr, n)
    pattern = (np.arange(n) % 251).astype(np.uint8)
    mem[:] = pattern
    back = np.zeros(n, dtype=np.uint8)
    assert acl.aclrtMemcpy(back.ctypes.data, n, addr, n, acl.ACL_MEMCPY_DEVICE_TO_HOST) == acl.ACL_SUCCESS
    np.testing.assert_array_equal(back, pattern)
    info = acl.describe(addr + 17)
    assert info is not None
    assert (info["base"], info["size"], info["offset"]) == (addr, n, 17)
    assert info["mapped_size"] == 4 * PAGE and info["page_size"] == PAGE
    assert (info["kind"], info["memory"], info["shareable"]) == ("normal", "device", True) and info["fd"] >= 0
    assert acl.describe(addr + n) is None  # past the requested size
    assert acl.aclrtFree(addr) == acl.ACL_SUCCESS
    assert acl.describe(addr) is None


def test_memcpy_round_trip_and_overlap(alloc):
    n = 1 * MiB
    d1, d2 = alloc(n), alloc(n)
    src = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    back = np.zeros(n, dtype=np.uint8)
    assert acl.aclrtMemcpy(d1, n, src.ctypes.data, n, acl.ACL_MEMCPY_HOST_TO_DEVICE) == acl.ACL_SUCCESS
    assert acl.aclrtMemcpy(d2, n, d1, n, acl.ACL_MEMCPY_DEVICE_TO_DEVICE) == acl.ACL_SUCCESS
    assert acl.aclrtMemcpy(back.ctypes.data, n, d2, n, acl.ACL_MEMCPY_DEVICE_TO_HOST) == acl.ACL_SUCCESS
    np.testing.assert_array_equal(back, src)
    # Overlapping ranges behave like memmove.
    assert acl.aclrtMemcpy(d1 + 1, n - 1, d1, n - 1, acl.ACL_MEMCPY_DEVICE_TO_DEVICE) == acl.ACL_SUCCESS
    np.testing.assert_array_equal(view(d1, n)[1:], src[:-1])
    # DEFAULT infers the direction; HOST_TO_HOST checks nothing.
    assert acl.aclrtMemcpy(d2, n, src.ctypes.data, 64, acl.ACL_MEMCPY_DEFAULT) == acl.ACL_SUCCESS
    a, b = np.arange(16, dtype=np.uint8), np.zeros(16, dtype=np.uint8)
    assert acl.aclrtMemcpy(b.ctypes.data, 16, a.ctypes.data, 16, acl.ACL_MEMCPY_HOST_TO_HOST) == acl.ACL_SUCCESS
    np.testing.assert_array_equal(a, b)


def test_memcpy_refusals(alloc):
    n = 64 * 1024
    dev = alloc(n)
    host = np.zeros(n, dtype=np.uint8)
    h = host.ctypes.data
    H2D, D2H, D2D = acl.ACL_MEMCPY_HOST_TO_DEVICE, acl.ACL_MEMCPY_DEVICE_TO_HOST, acl.ACL_MEMCPY_DEVICE_TO_DEVICE
    cases = [
        ((dev, 10, h, 11, H2D), "count exceeds destMax"),
        ((0, n, h, 1, H2D), "non-null"),
        ((dev, n, 0, 1, H2D), "non-null"),
        ((dev, n, h, 1, 99), "unknown aclrtMemcpyKind"),
        ((dev + n - 10, 20, h, 20, H2D), "overruns allocation"),
        ((h, 20, dev + n - 10, 20, D2H), "overruns allocation"),
        ((h, n, h, 16, D2H), "not inside any live"),  # host memory passed as device src
        ((0x1000, 16, h, 16, H2D), "not inside any live"),  # wild pointer: refused, no segfault
        ((dev, n, dev + n, 1, D2D), "not inside any live"),
        ((dev + n - 4, 8, h, 8, acl.ACL_MEMCPY_DEFAULT), "overruns allocation"),
        ((dev, n, h, -1, H2D), "ints in [0, 2**64)"),
        ((dev, n, h, 1.0, H2D), "ints in [0, 2**64)"),
        (("0x10", n, h, 1, H2D), "int addresses"),
        ((dev, n, h, 1, 2**40), "32-bit int"),
        ((dev, n, None, 1, H2D), "int addresses"),
    ]
    for args, message in cases:
        assert acl.aclrtMemcpy(*args) == acl.ACL_ERROR_INVALID_PARAM, args
        err = acl.last_error()
        assert err.startswith("aclrtMemcpy(") and message in err, (args, err)
    assert acl.aclrtMemcpy(dev, n, h, 0, H2D) == acl.ACL_SUCCESS and acl.last_error() == ""


def test_memset(alloc):
    n = 10000
    dev = alloc(n)
    view(dev, n)[:] = 1
    assert acl.aclrtMemset(dev + 100, n - 100, 0x1AB, n - 100) == acl.ACL_SUCCESS  # low byte of value
    mem = view(dev, n)
    assert (mem[:100] == 1).all() and (mem[100:] == 0xAB).all()
    assert acl.aclrtMemset(dev + n - 4, 8, 0, 8) == acl.ACL_ERROR_INVALID_PARAM
    assert "overruns allocation" in acl.last_error()
    assert acl.aclrtMemset(dev, 4, 0, 8) == acl.ACL_ERROR_INVALID_PARAM
    assert "count exceeds maxCount" in acl.last_error()
    stack = np.zeros(8, dtype=np.uint8)
    assert acl.aclrtMemset(stack.ctypes.data, 8, 0, 8) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.aclrtMemset(0, 8, 0, 8) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.aclrtMemset(dev, n, 2**31, 1) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.aclrtMemset(dev, n, "x", 1) == acl.ACL_ERROR_INVALID_PARAM


@pytest.mark.parametrize(
    "size, policy, code, message",
    [
        (0, acl.ACL_MEM_MALLOC_HUGE_FIRST, acl.ACL_ERROR_INVALID_PARAM, "aclrtMalloc(size=0, policy=0): size must be > 0"),
        (4096, 99, acl.ACL_ERROR_INVALID_PARAM, "unknown aclrtMemMallocPolicy"),
        (4096, -1, acl.ACL_ERROR_INVALID_PARAM, "unknown aclrtMemMallocPolicy"),
        (4096, 2**40, acl.ACL_ERROR_INVALID_PARAM, "policy must be a 32-bit int"),
        (4096, acl.ACL_MEM_MALLOC_HUGE1G_ONLY, acl.ACL_ERROR_FEATURE_UNSUPPORTED, "1 GiB"),
        (1 << 62, acl.ACL_MEM_MALLOC_NORMAL_ONLY, acl.ACL_ERROR_INVALID_PARAM, "exceeds the limit"),
        (2**64 - 1, acl.ACL_MEM_MALLOC_HUGE_FIRST, acl.ACL_ERROR_INVALID_PARAM, "exceeds the limit"),
        (2**64, 0, acl.ACL_ERROR_INVALID_PARAM, "size must be an int"),
        (-1, 0, acl.ACL_ERROR_INVALID_PARAM, "size must be an int"),
        (1.5, 0, acl.ACL_ERROR_INVALID_PARAM, "size must be an int"),
        ("4096", 0, acl.ACL_ERROR_INVALID_PARAM, "size must be an int"),
        (None, 0, acl.ACL_ERROR_INVALID_PARAM, "size must be an int"),
        (True, 0, acl.ACL_ERROR_INVALID_PARAM, "size must be an int"),
    ],
)
def test_malloc_refusals(size, policy, code, message):
    assert acl.aclrtMalloc(size, policy) == (code, 0)
    err = acl.last_error()
    assert err.startswith("aclrtMalloc(") and message in err


def test_errors_are_logged_to_stderr(capfd):
    acl.set_log_enabled(True)
    assert acl.aclrtMalloc(0, 0)[0] == acl.ACL_ERROR_INVALID_PARAM
    err = capfd.readouterr().err
    assert "aclrtMalloc(size=0, policy=0): size must be > 0" in err and "ret=100000" in err


def test_bandwidth_bits_and_p2p_fold_onto_page_policy(alloc):
    a = alloc(4096, acl.ACL_MEM_MALLOC_NORMAL_ONLY | acl.ACL_MEM_TYPE_HIGH_BAND_WIDTH)
    b = alloc(4096, acl.ACL_MEM_MALLOC_NORMAL_ONLY_P2P)
    assert acl.describe(a)["kind"] == acl.describe(b)["kind"] == "normal"


def test_free_refusals(alloc):
    addr = alloc(8192)
    assert acl.aclrtFree(addr + 64) == acl.ACL_ERROR_INVALID_PARAM
    assert "not its base address" in acl.last_error()
    assert acl.aclrtFreeHost(addr) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.aclrtFree(addr) == acl.ACL_SUCCESS
    assert acl.aclrtFree(addr) == acl.ACL_ERROR_INVALID_PARAM  # double free
    assert "already freed" in acl.last_error()
    for bad in (0, 0x1000, -5, 2**64, "addr", None, 3.0):
        assert acl.aclrtFree(bad) == acl.ACL_ERROR_INVALID_PARAM, bad
        assert acl.last_error().startswith("aclrtFree(")


def test_malloc_host():
    ret, host = acl.aclrtMallocHost(100)
    assert ret == acl.ACL_SUCCESS and host % PAGE == 0
    info = acl.describe(host)
    assert info["memory"] == "host" and info["shareable"]
    assert acl.aclrtMemset(host, 100, 9, 100) == acl.ACL_SUCCESS and (view(host, 100) == 9).all()
    assert acl.aclrtFree(host) == acl.ACL_ERROR_INVALID_PARAM and "aclrtFreeHost" in acl.last_error()
    assert acl.aclrtFreeHost(host) == acl.ACL_SUCCESS
    assert acl.aclrtFreeHost(host) == acl.ACL_ERROR_INVALID_PARAM
    assert acl.aclrtMallocHost(0) == (acl.ACL_ERROR_INVALID_PARAM, 0)
    assert acl.aclrtMallocHost(-1) == (acl.ACL_ERROR_INVALID_PARAM, 0)


def test_huge_only_matches_the_hugetlb_pool():
    ret, addr = acl.aclrtMalloc(3 * MiB, acl.ACL_MEM_MALLOC_HUGE_ONLY)
    if read_int(POOL / "free_hugepages") < 2:  # e.g. nr_hugepages == 0, as on the dev machine
        assert (ret, addr) == (acl.ACL_ERROR_BAD_ALLOC, 0)
        err = acl.last_error()
        assert err.startswith("aclrtMalloc(size=3145728, policy=1)")
        assert f"nr_hugepages={read_int(POOL / 'nr_hugepages')}" in err
    else:
        assert ret == acl.ACL_SUCCESS, acl.last_error()
        info = acl.describe(addr)
        assert (info["kind"], info["page_size"], info["mapped_size"]) == ("hugetlb", 2 * MiB, 4 * MiB)
        assert info["fd"] >= 0 and addr % (2 * MiB) == 0
        assert acl.aclrtFree(addr) == acl.ACL_SUCCESS


def test_huge_first(alloc):
    small = alloc(1 * MiB, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    assert acl.describe(small)["kind"] == "normal"  # CANN: <= 1 MiB gets normal pages
    addr = alloc(3 * MiB, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    info = acl.describe(addr)
    view(addr, 3 * MiB)[:] = 1
    if read_int(POOL / "free_hugepages") >= 2:
        expected = ("hugetlb", True)
    elif read_int(THP / "hpage_pmd_size") != 2 * MiB:
        expected = ("normal", True)
    elif thp_mode("shmem_enabled") in ("always", "within_size", "advise", "force"):
        expected = ("thp", True)
    elif thp_mode("enabled") in ("always", "madvise"):
        expected = ("thp", False)  # anonymous THP fallback: fd == -1
    else:
        expected = ("normal", True)
    assert (info["kind"], info["shareable"]) == expected
    if info["kind"] != "normal":
        assert addr % (2 * MiB) == 0 and info["page_size"] == 2 * MiB and info["mapped_size"] == 4 * MiB


def test_require_shareable_keeps_an_fd(alloc):
    assert acl.require_shareable() is False
    acl.set_require_shareable(True)
    try:
        info = acl.describe(alloc(3 * MiB, acl.ACL_MEM_MALLOC_HUGE_FIRST))
        assert info["shareable"] and info["fd"] >= 0
    finally:
        acl.set_require_shareable(False)


def test_fd_maps_the_same_bytes(alloc):
    n = 4 * PAGE
    addr = alloc(n)
    info = acl.describe(addr + 5)
    assert info["fd"] >= 0 and info["offset"] == 5
    peer = mmap.mmap(info["fd"], info["mapped_size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        view(addr, n)[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
        assert peer[: n] == bytes(view(addr, n))
        peer[0:4] = b"peer"
        assert bytes(view(addr, 4)) == b"peer"
    finally:
        peer.close()
    # The fd stays valid (and owned by the allocator) until aclrtFree.
    os.fstat(info["fd"])


def test_get_mem_info(alloc):
    ret, free0, total = acl.aclrtGetMemInfo(acl.ACL_HBM_MEM)
    assert ret == acl.ACL_SUCCESS and 0 < free0 <= total
    addr = alloc(5 * PAGE)
    assert acl.aclrtGetMemInfo(acl.ACL_HBM_MEM) == (acl.ACL_SUCCESS, free0 - 5 * PAGE, total)
    acl.aclrtFree(addr)
    assert acl.aclrtGetMemInfo(acl.ACL_HBM_MEM)[1] == free0
    ret, free_huge, total_huge = acl.aclrtGetMemInfo(acl.ACL_HBM_MEM_HUGE)
    assert ret == acl.ACL_SUCCESS and total_huge == read_int(POOL / "nr_hugepages") * 2 * MiB
    assert acl.aclrtGetMemInfo(42) == (acl.ACL_ERROR_INVALID_PARAM, 0, 0)
    assert acl.aclrtGetMemInfo("x") == (acl.ACL_ERROR_INVALID_PARAM, 0, 0)


def test_describe_bad_input_returns_none():
    for bad in (0, -1, 2**64, "x", None, 1.5):
        assert acl.describe(bad) is None


def test_threads_malloc_free_concurrently():
    before = acl.stats()

    def worker(t: int) -> list[str]:
        problems = []
        for i in range(100):
            n = PAGE * (1 + (i + t) % 7)
            ret, addr = acl.aclrtMalloc(n, acl.ACL_MEM_MALLOC_NORMAL_ONLY)
            if ret != acl.ACL_SUCCESS:
                problems.append(acl.last_error())
                continue
            if acl.aclrtMemset(addr, n, t, n) != acl.ACL_SUCCESS or int(view(addr, n)[-1]) != t:
                problems.append(f"memset t={t} i={i}: {acl.last_error()}")
            # While this thread owns addr, an interior free is refused with a per-thread message.
            if acl.aclrtFree(addr + 1) != acl.ACL_ERROR_INVALID_PARAM or "not its base" not in acl.last_error():
                problems.append(f"interior free t={t} i={i}")
            if acl.aclrtFree(addr) != acl.ACL_SUCCESS or acl.last_error() != "":
                problems.append(f"free t={t} i={i}: {acl.last_error()}")
        return problems

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(worker, range(8)))
    assert [p for r in results for p in r] == []
    after = acl.stats()
    assert after["live_allocations"] == before["live_allocations"]
    assert after["total_allocs"] - before["total_allocs"] == 800


def test_large_memcpy_releases_the_gil(alloc):
    n = 256 * MiB
    src, dst = alloc(n), alloc(n)
    done = threading.Event()
    ticks = 0

    def copy():
        acl.aclrtMemcpy(dst, n, src, n, acl.ACL_MEMCPY_DEVICE_TO_DEVICE)  # first touch: tens of ms
        done.set()

    worker = threading.Thread(target=copy)
    worker.start()
    while not done.wait(0.0002):  # each wake-up needs the GIL, so it counts only while the copy runs without it
        ticks += 1
    worker.join()
    assert ticks >= 5
