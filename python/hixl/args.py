"""How :class:`hixl.Hixl` takes its arguments: the guard each of its methods runs in
(:func:`status_call`), the limits of its arguments, and the conversions that turn what a caller
passed into what the C++ engine takes, or ``None`` when it is not valid (the method then returns
PARAM_INVALID naming the argument). None of the conversions raises for a bad value.
"""
from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from . import _core
from .status import FAILED, SUCCESS
from .types import TransferOp, _as_u64, validate_op_desc

INT32_MAX = 2 ** 31 - 1
U32_MAX = 2 ** 32 - 1
U64_MAX = 2 ** 64 - 1
U64_LIMIT = 2 ** 64
DEFAULT_TIMEOUT_MS = 1000  # CANN's default timeout_in_millis

# register_mem's ``access`` -> wire::RegionAccess bits: remote read 1, remote write 2
ACCESS = {"rw": 3, "ro": 1, "wo": 2, "none": 0}


def status_call(*empty: Any, after_finalize: bool = False) -> Callable[[Callable], Callable]:
    """The guard of a :class:`hixl.Hixl` method (decorator): ``FAILED`` after finalize (unless
    ``after_finalize``), and an exception of its body turned into ``self._failed(name, e)`` (``FAILED``,
    logged, in :meth:`hixl.Hixl.last_error`) instead of raised.

    ``empty``: the result that comes with such a ``FAILED``, for a method returning ``(status,
    result)`` (a list or dict is a fresh one each time); none for a method returning a status. A
    call whose arguments do not fit the signature raises its TypeError, as a plain method does."""
    def result(rc: int) -> Any:
        if not empty:
            return rc
        e = empty[0]
        return rc, (e.copy() if isinstance(e, (list, dict)) else e)

    def wrap(fn: Callable) -> Callable:
        name, sig = fn.__name__, inspect.signature(fn)

        def misfit(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
            try:
                sig.bind(*args, **kwargs)
            except TypeError:
                return True
            return False

        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self._finalized and not after_finalize:
                if misfit((self,) + args, kwargs):
                    return fn(self, *args, **kwargs)  # raises the call's TypeError
                return result(FAILED)
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:
                if isinstance(e, TypeError) and misfit((self,) + args, kwargs):
                    raise
                return result(self._failed(name, e))
        return call
    return wrap


def as_int(v: Any, lo: int, hi: int) -> Optional[int]:
    """``v`` as an int in [lo, hi] (0 <= lo), else None; bools (numpy's too) refused as in hixl.types."""
    # ints and IntEnums are the common case (bool is an int subclass: refused like numpy's bools)
    n = int(v) if isinstance(v, int) and not isinstance(v, bool) else _as_u64(v)
    return n if n is not None and lo <= n <= hi else None


_ENUM_VALUES: Dict[Any, frozenset] = {}


def as_enum(v: Any, cls: Any) -> Optional[int]:
    """``v`` as the int value of a member of IntEnum ``cls``, else None."""
    values = _ENUM_VALUES.get(cls)
    if values is None:
        values = _ENUM_VALUES[cls] = frozenset(int(m) for m in cls)
    n = as_int(v, 0, 255)
    return n if n is not None and n in values else None


def as_timeout(v: Any) -> Optional[int]:
    """A timeout in ms, 1..2**31-1."""
    return as_int(v, 1, INT32_MAX)


def as_wait_ms(v: Any) -> Optional[int]:
    """None -> -1 (no limit); else 0..2**31-1 ms."""
    return -1 if v is None else as_int(v, 0, INT32_MAX)


def as_flag(v: Any, op: int) -> Optional[int]:
    """A completion flag: None -> -1 (no flag); a u32 with a WRITE -> itself; anything else None."""
    if v is None:
        return -1
    f = as_int(v, 0, U32_MAX)
    return f if f is not None and op == int(TransferOp.WRITE) else None


def as_desc_list(op_descs: Any) -> Union[np.ndarray, List[Tuple[int, int, int]], None]:
    """A list or tuple of TransferOpDesc as an (N, 3) uint64 array (fields that are plain ints, read
    in C++: no Python object per descriptor) or as (la, ra, len) tuples (numpy integers and the
    like), or None when it is not a valid one."""
    if not isinstance(op_descs, (list, tuple)) or not op_descs:
        return None
    if len(op_descs) > 1:
        arr = _core.descs_from_list(op_descs)
        if arr is not None:
            return arr
    out = []
    for d in op_descs:
        la, ra, n = (getattr(d, "local_addr", None), getattr(d, "remote_addr", None), getattr(d, "len", None))
        if type(la) is int and type(ra) is int and type(n) is int:  # the per-call fast path: plain ints
            if n <= 0 or la <= 0 or ra <= 0 or la + n > U64_LIMIT or ra + n > U64_LIMIT:
                return None
            out.append((la, ra, n))
        elif validate_op_desc(d) == SUCCESS and operator.index(la) and operator.index(ra):  # numpy ints etc.
            out.append((operator.index(la), operator.index(ra), operator.index(n)))
        else:
            return None
    return out
