"""Descriptors without a Python object each: numpy descriptor arrays and the arrays of prepared lists.

Beyond CANN's ``TransferOpDesc`` lists (kept for CANN code), :class:`hixl.Hixl` takes:

* a **descriptor array** wherever it takes ``op_descs``: shape ``(N, 3)`` of unsigned (or
  non-negative signed) 64-bit ints, columns ``local_addr, remote_addr, len``; or a 1-D structured
  array of :data:`DESC_DTYPE` (fields ``local_addr``, ``remote_addr``, ``len``);
* **prepared descriptor lists** (:meth:`hixl.Hixl.prep_descs`): block addresses and lengths,
  validated and resolved once; a transfer is then a pair of index arrays into a local and a remote
  list (:meth:`hixl.Hixl.transfer_prepped_async` / ``_sync``), as NIXL's ``prep_xfer_dlist`` /
  ``make_prepped_xfer`` and CANN's block-based pull/push.

The helpers here turn what the caller passed into C-contiguous ``uint64`` arrays (a view when it
already is one), or ``None`` when it cannot be one (the caller returns PARAM_INVALID). The C++
binding copies them once, with the GIL held, before it releases the GIL: another thread changing
the array afterwards cannot change what was checked.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

DESC_DTYPE = np.dtype([("local_addr", "<u8"), ("remote_addr", "<u8"), ("len", "<u8")])
_FIELDS = ("local_addr", "remote_addr", "len")


def _u64(a: np.ndarray) -> Optional[np.ndarray]:
    """``a`` (an int array) as C-contiguous uint64, or None (another dtype, a negative value)."""
    if a.dtype.kind == "u":
        return np.ascontiguousarray(a, dtype=np.uint64)
    if a.dtype.kind == "i":
        if a.size and int(a.min()) < 0:
            return None
        return np.ascontiguousarray(a, dtype=np.uint64)
    return None


def as_desc_array(x: Any) -> Optional[np.ndarray]:
    """A non-empty ``(N, 3)`` uint64 array from a descriptor array, or None when ``x`` is not one."""
    if not isinstance(x, np.ndarray) or x.size == 0:
        return None
    if x.dtype.names is not None:
        if x.ndim != 1 or not all(f in x.dtype.names for f in _FIELDS):
            return None
        cols = [_u64(np.asarray(x[f])) for f in _FIELDS]
        if any(c is None for c in cols):
            return None
        return np.stack(cols, axis=1)  # type: ignore[arg-type]
    if x.ndim != 2 or x.shape[1] != 3:
        return None
    return _u64(x)


def as_u64_vector(x: Any, n: Optional[int] = None) -> Optional[np.ndarray]:
    """A 1-D uint64 array from a sequence or array of non-negative ints; with ``n``, a single int is
    repeated n times. None when ``x`` is none of these (or empty)."""
    if n is not None and isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        return np.full(n, int(x), dtype=np.uint64) if 0 <= int(x) < 2 ** 64 else None
    try:
        a = x if isinstance(x, np.ndarray) else np.asarray(x)
    except (ValueError, TypeError, OverflowError):
        return None
    if a.ndim != 1 or a.size == 0 or a.dtype.kind == "b":
        return None
    return _u64(a)


__all__ = ["DESC_DTYPE", "as_desc_array", "as_u64_vector"]
