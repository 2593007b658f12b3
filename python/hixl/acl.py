"""aclrtMalloc-style device-memory shim with CANN names and error codes.

Stands in for accelerator HBM on machines without one::

    from hixl import acl
    ret, addr = acl.aclrtMalloc(size, acl.ACL_MEM_MALLOC_HUGE_FIRST)
    if ret != acl.ACL_SUCCESS:
        print(acl.last_error())

Every function returns CANN-style ``int`` error codes and never raises on bad input: a wrong
type, a negative or oversized number, an unknown or freed address all give
``ACL_ERROR_INVALID_PARAM`` (or another code), a logged message naming the call and its
arguments, and ``last_error()`` on the calling thread. Addresses are plain ints.

Note the tuple order: ``(ret, value)``, unlike pyACL's ``acl.rt.malloc`` which returns
``(ptr, ret)``.

Memory is page-aligned and backed by a memfd mapped ``MAP_SHARED`` where possible, so a
same-host peer can map it through ``describe(addr)["fd"]``; every allocation can be registered
with ``ibv_reg_mr``. Policies:

* ``ACL_MEM_MALLOC_NORMAL_ONLY``: base pages (4 KiB on x86-64), memfd.
* ``ACL_MEM_MALLOC_HUGE_ONLY``: 2 MiB hugetlb pages (size rounded up to 2 MiB) or
  ``ACL_ERROR_BAD_ALLOC`` with a message giving ``nr_hugepages`` / ``free_hugepages``.
* ``ACL_MEM_MALLOC_HUGE_FIRST``: as CANN, requests of at most 1 MiB get base pages; larger ones
  try hugetlb, then transparent huge pages (a 2 MiB-aligned mapping advised
  ``MADV_HUGEPAGE``), then base pages. THP on a memfd needs
  ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` to allow it; when it does not, the THP
  step uses an anonymous ``MAP_PRIVATE`` mapping whose ``describe()["fd"]`` is ``-1`` (not
  shareable with a peer). ``set_require_shareable(True)`` skips that step so every allocation
  has an fd.

The ``*_P2P`` policies behave like their plain counterparts, the bandwidth bits
(``ACL_MEM_TYPE_*_BAND_WIDTH``) are accepted and ignored, and 1 GiB policies return
``ACL_ERROR_FEATURE_UNSUPPORTED``.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, Optional, Tuple

from hixl._core import acl as _acl

__all__ = [
    "aclrtMalloc",
    "aclrtFree",
    "aclrtMallocHost",
    "aclrtFreeHost",
    "aclrtMemcpy",
    "aclrtMemset",
    "aclrtGetMemInfo",
    "describe",
    "stats",
    "last_error",
    "set_log_enabled",
    "set_require_shareable",
    "require_shareable",
    "device_allocator_name",
]

# Values come from the C++ header (csrc/acl/allocator.h), which follows CANN.
# aclError (CANN acl_base.h)
ACL_SUCCESS: int = _acl.ACL_SUCCESS
ACL_ERROR_INVALID_PARAM: int = _acl.ACL_ERROR_INVALID_PARAM
ACL_ERROR_BAD_ALLOC: int = _acl.ACL_ERROR_BAD_ALLOC
ACL_ERROR_API_NOT_SUPPORT: int = _acl.ACL_ERROR_API_NOT_SUPPORT
ACL_ERROR_MEMORY_ADDRESS_UNALIGNED: int = _acl.ACL_ERROR_MEMORY_ADDRESS_UNALIGNED
ACL_ERROR_FEATURE_UNSUPPORTED: int = _acl.ACL_ERROR_FEATURE_UNSUPPORTED
ACL_ERROR_INTERNAL_ERROR: int = _acl.ACL_ERROR_INTERNAL_ERROR
# aclrtMemMallocPolicy (CANN acl_rt.h); bandwidth bits may be OR'ed onto a page policy
ACL_MEM_MALLOC_HUGE_FIRST: int = _acl.ACL_MEM_MALLOC_HUGE_FIRST
ACL_MEM_MALLOC_HUGE_ONLY: int = _acl.ACL_MEM_MALLOC_HUGE_ONLY
ACL_MEM_MALLOC_NORMAL_ONLY: int = _acl.ACL_MEM_MALLOC_NORMAL_ONLY
ACL_MEM_MALLOC_HUGE_FIRST_P2P: int = _acl.ACL_MEM_MALLOC_HUGE_FIRST_P2P
ACL_MEM_MALLOC_HUGE_ONLY_P2P: int = _acl.ACL_MEM_MALLOC_HUGE_ONLY_P2P
ACL_MEM_MALLOC_NORMAL_ONLY_P2P: int = _acl.ACL_MEM_MALLOC_NORMAL_ONLY_P2P
ACL_MEM_MALLOC_HUGE1G_ONLY: int = _acl.ACL_MEM_MALLOC_HUGE1G_ONLY
ACL_MEM_MALLOC_HUGE1G_ONLY_P2P: int = _acl.ACL_MEM_MALLOC_HUGE1G_ONLY_P2P
ACL_MEM_TYPE_LOW_BAND_WIDTH: int = _acl.ACL_MEM_TYPE_LOW_BAND_WIDTH
ACL_MEM_TYPE_HIGH_BAND_WIDTH: int = _acl.ACL_MEM_TYPE_HIGH_BAND_WIDTH
# aclrtMemcpyKind
ACL_MEMCPY_HOST_TO_HOST: int = _acl.ACL_MEMCPY_HOST_TO_HOST
ACL_MEMCPY_HOST_TO_DEVICE: int = _acl.ACL_MEMCPY_HOST_TO_DEVICE
ACL_MEMCPY_DEVICE_TO_HOST: int = _acl.ACL_MEMCPY_DEVICE_TO_HOST
ACL_MEMCPY_DEVICE_TO_DEVICE: int = _acl.ACL_MEMCPY_DEVICE_TO_DEVICE
ACL_MEMCPY_DEFAULT: int = _acl.ACL_MEMCPY_DEFAULT
# aclrtMemAttr, for aclrtGetMemInfo
ACL_DDR_MEM: int = _acl.ACL_DDR_MEM
ACL_HBM_MEM: int = _acl.ACL_HBM_MEM
ACL_DDR_MEM_HUGE: int = _acl.ACL_DDR_MEM_HUGE
ACL_DDR_MEM_NORMAL: int = _acl.ACL_DDR_MEM_NORMAL
ACL_HBM_MEM_HUGE: int = _acl.ACL_HBM_MEM_HUGE
ACL_HBM_MEM_NORMAL: int = _acl.ACL_HBM_MEM_NORMAL
ACL_DDR_MEM_P2P_HUGE: int = _acl.ACL_DDR_MEM_P2P_HUGE
ACL_DDR_MEM_P2P_NORMAL: int = _acl.ACL_DDR_MEM_P2P_NORMAL
ACL_HBM_MEM_P2P_HUGE: int = _acl.ACL_HBM_MEM_P2P_HUGE
ACL_HBM_MEM_P2P_NORMAL: int = _acl.ACL_HBM_MEM_P2P_NORMAL
# 2 MiB, the huge page size used by the shim
HUGE_PAGE_SIZE: int = _acl.HUGE_PAGE_SIZE

__all__ += [
    "ACL_SUCCESS", "ACL_ERROR_INVALID_PARAM", "ACL_ERROR_BAD_ALLOC", "ACL_ERROR_API_NOT_SUPPORT",
    "ACL_ERROR_MEMORY_ADDRESS_UNALIGNED", "ACL_ERROR_FEATURE_UNSUPPORTED",
    "ACL_ERROR_INTERNAL_ERROR", "ACL_MEM_MALLOC_HUGE_FIRST", "ACL_MEM_MALLOC_HUGE_ONLY",
    "ACL_MEM_MALLOC_NORMAL_ONLY", "ACL_MEM_MALLOC_HUGE_FIRST_P2P", "ACL_MEM_MALLOC_HUGE_ONLY_P2P",
    "ACL_MEM_MALLOC_NORMAL_ONLY_P2P", "ACL_MEM_MALLOC_HUGE1G_ONLY",
    "ACL_MEM_MALLOC_HUGE1G_ONLY_P2P", "ACL_MEM_TYPE_LOW_BAND_WIDTH", "ACL_MEM_TYPE_HIGH_BAND_WIDTH",
    "ACL_MEMCPY_HOST_TO_HOST", "ACL_MEMCPY_HOST_TO_DEVICE", "ACL_MEMCPY_DEVICE_TO_HOST",
    "ACL_MEMCPY_DEVICE_TO_DEVICE", "ACL_MEMCPY_DEFAULT", "ACL_DDR_MEM", "ACL_HBM_MEM",
    "ACL_DDR_MEM_HUGE", "ACL_DDR_MEM_NORMAL", "ACL_HBM_MEM_HUGE", "ACL_HBM_MEM_NORMAL",
    "ACL_DDR_MEM_P2P_HUGE", "ACL_DDR_MEM_P2P_NORMAL", "ACL_HBM_MEM_P2P_HUGE",
    "ACL_HBM_MEM_P2P_NORMAL", "HUGE_PAGE_SIZE",
]

_U64_MAX = (1 << 64) - 1
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1


def _show(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not make us raise
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: Any, lo: int, hi: int) -> Optional[int]:
    """value as an int in [lo, hi], or None (bool, float, str, None, out of range...)."""
    if isinstance(value, bool):
        return None
    try:
        number = operator.index(value)
    except Exception:
        return None
    return number if lo <= number <= hi else None


def _refuse(call: str, what: str, code: int = ACL_ERROR_INVALID_PARAM) -> int:
    return _acl.record_error(code, f"{call}: {what}")


def _call(name: str, **args: Any) -> str:
    return f"{name}(" + ", ".join(f"{key}={_show(val)}" for key, val in args.items()) + ")"


def aclrtMalloc(size: int, policy: int) -> Tuple[int, int]:
    """Allocate ``size`` bytes of shim device memory. Returns ``(ret, addr)``; addr is 0 on failure.

    ``policy`` is an ``aclrtMemMallocPolicy`` (``ACL_MEM_MALLOC_*``). Size 0, an unknown policy,
    or a size above the shim's capacity (physical memory) give ``ACL_ERROR_INVALID_PARAM``.
    """
    n, p = _int(size, 0, _U64_MAX), _int(policy, _I32_MIN, _I32_MAX)
    if n is None or p is None:
        bad = "size must be an int in [0, 2**64)" if n is None else "policy must be a 32-bit int"
        return _refuse(_call("aclrtMalloc", size=size, policy=policy), bad), 0
    ret, addr = _acl.aclrtMalloc(n, p)
    return ret, addr


def aclrtFree(addr: int) -> int:
    """Free memory from ``aclrtMalloc``. Unknown, already freed, interior or host addresses are
    refused with ``ACL_ERROR_INVALID_PARAM``."""
    a = _int(addr, 0, _U64_MAX)
    if a is None:
        return _refuse(_call("aclrtFree", devPtr=addr), "devPtr must be an int address")
    return _acl.aclrtFree(a)


def aclrtMallocHost(size: int) -> Tuple[int, int]:
    """Allocate ``size`` bytes of page-aligned host memory (memfd-backed). Returns ``(ret, addr)``."""
    n = _int(size, 0, _U64_MAX)
    if n is None:
        return _refuse(_call("aclrtMallocHost", size=size), "size must be an int in [0, 2**64)"), 0
    ret, addr = _acl.aclrtMallocHost(n)
    return ret, addr


def aclrtFreeHost(addr: int) -> int:
    """Free memory from ``aclrtMallocHost``; anything else is refused with ``ACL_ERROR_INVALID_PARAM``."""
    a = _int(addr, 0, _U64_MAX)
    if a is None:
        return _refuse(_call("aclrtFreeHost", hostPtr=addr), "hostPtr must be an int address")
    return _acl.aclrtFreeHost(a)


def aclrtMemcpy(dst: int, dst_max: int, src: int, count: int, kind: int) -> int:
    """Copy ``count`` bytes from ``src`` to ``dst`` (overlap allowed). Returns ``ret``.

    ``kind`` is an ``aclrtMemcpyKind``. Each device side must lie, with all ``count`` bytes,
    inside one live ``aclrtMalloc`` allocation; host sides are not checked
    (``ACL_MEMCPY_HOST_TO_HOST`` checks nothing). ``ACL_MEMCPY_DEFAULT`` bounds-checks whichever
    side lies inside a shim allocation. ``count > dst_max`` and null addresses are refused.
    """
    d, s = _int(dst, 0, _U64_MAX), _int(src, 0, _U64_MAX)
    m, n = _int(dst_max, 0, _U64_MAX), _int(count, 0, _U64_MAX)
    k = _int(kind, _I32_MIN, _I32_MAX)
    if None in (d, s, m, n, k):
        call = _call("aclrtMemcpy", dst=dst, destMax=dst_max, src=src, count=count, kind=kind)
        return _refuse(call, "dst/src must be int addresses, destMax/count ints in [0, 2**64), kind a 32-bit int")
    return _acl.aclrtMemcpy(d, m, s, n, k)


def aclrtMemset(addr: int, max_count: int, value: int, count: int) -> int:
    """Set ``count`` bytes at ``addr`` to ``value & 0xff``. Returns ``ret``.

    ``addr .. addr + count`` must lie inside one live allocation (``aclrtMalloc`` or
    ``aclrtMallocHost``) and ``count <= max_count``.
    """
    a, m = _int(addr, 0, _U64_MAX), _int(max_count, 0, _U64_MAX)
    v, n = _int(value, _I32_MIN, _I32_MAX), _int(count, 0, _U64_MAX)
    if None in (a, m, v, n):
        call = _call("aclrtMemset", devPtr=addr, maxCount=max_count, value=value, count=count)
        return _refuse(call, "devPtr must be an int address, maxCount/count ints in [0, 2**64), value a 32-bit int")
    return _acl.aclrtMemset(a, m, v, n)


def aclrtGetMemInfo(attr: int) -> Tuple[int, int, int]:
    """``(ret, free, total)`` in bytes for an ``aclrtMemAttr``.

    ``*_HUGE`` attributes report the 2 MiB hugetlb pool; the others report the shim capacity
    (physical memory) and that minus the bytes mapped by live ``aclrtMalloc`` allocations.
    """
    a = _int(attr, _I32_MIN, _I32_MAX)
    if a is None:
        return _refuse(_call("aclrtGetMemInfo", attr=attr), "attr must be a 32-bit int"), 0, 0
    ret, free, total = _acl.aclrtGetMemInfo(a)
    return ret, free, total


def describe(addr: int) -> Optional[Dict[str, Any]]:
    """Describe the live allocation containing ``addr`` (any byte of it), else ``None``.

    Keys: ``base``, ``size`` (requested), ``mapped_size``, ``fd`` (memfd mapping the allocation
    from offset 0, or -1), ``offset`` (``addr - base``), ``page_size``, ``kind`` (``"normal"``,
    ``"thp"`` or ``"hugetlb"``), ``memory`` (``"device"`` or ``"host"``), ``shareable``
    (``fd >= 0``). The fd belongs to the allocator and is closed by ``aclrtFree``: ``os.dup`` it
    (``mmap.mmap`` does so itself) to keep it.
    """
    a = _int(addr, 0, _U64_MAX)
    return None if a is None else _acl.describe(a)


def stats() -> Dict[str, int]:
    """Counters: live_allocations, live_device_bytes, live_mapped_bytes, peak_mapped_bytes,
    total_allocs, total_frees, live_normal, live_thp, live_hugetlb."""
    return _acl.stats()


def last_error() -> str:
    """Message of this thread's most recent ``aclrt*`` call if it failed, else ``""``."""
    return _acl.last_error()


def set_log_enabled(enabled: bool) -> None:
    """Log each error as one line on stderr (default) or not at all."""
    _acl.set_log_enabled(bool(enabled))


def set_require_shareable(require: bool) -> None:
    """When true, ``ACL_MEM_MALLOC_HUGE_FIRST`` never falls back to fd-less anonymous THP."""
    _acl.set_require_shareable(bool(require))


def require_shareable() -> bool:
    """Current ``set_require_shareable`` setting."""
    return _acl.require_shareable()


def device_allocator_name() -> str:
    """Name of the backend serving ``aclrtMalloc`` (``"host-memfd"`` by default)."""
    return _acl.device_allocator_name()
