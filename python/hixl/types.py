"""Module-level API surface of hixl, mirroring CANN's ``hixl`` Python module.

CANN's hixl (Ascend) exposes status codes, enums (``MemType``, ``TransferOp``,
``TransferStatus``, ``AsyncConnectStatus``, ``FeatureType``), option keys, plain
descriptor classes (``MemDesc``, ``TransferOpDesc``, ...) and ``get_capability``
at module level.  This module provides the same names and values
so that code written against CANN runs unchanged on this RDMA implementation.

Everything here follows the CANN convention of *returning* a status code
instead of raising: validators return an ``int`` status, parsers return a tuple
whose first element is the status.

``TransferStatus`` members are deliberately *not* exported as module constants:
``TIMEOUT`` and ``FAILED`` at module level are the status codes.

The status codes are defined in :mod:`hixl.status`, the option keys and their parser
(:func:`parse_options`) and :func:`parse_engine_address` in :mod:`hixl.options`; this module
re-exports them, so that every name of the CANN surface is importable from here.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .options import (
    ADXL_PREFIX,
    CANN_OPTIONS,
    CONNECT_POOL_CAPACITY,
    CONNECT_POOL_THREADS,
    ENV_AUTH_TOKEN,
    ENV_METRICS_PORT,
    ENV_RDMA_SL,
    ENV_RDMA_TC,
    ENV_TRANSPORT,
    GLOBAL_RESOURCE_FIELDS,
    HIXL_OPTIONS,
    MAX_AUTH_TOKEN_BYTES,
    OPTION_AUTO_CONNECT,
    OPTION_BUFFER_POOL,
    OPTION_ENABLE_USE_FABRIC_MEM,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_HIXL_ASYNC_TIMEOUT_MS,
    OPTION_HIXL_AUTH_TOKEN,
    OPTION_HIXL_DEVICE,
    OPTION_HIXL_GID_INDEX,
    OPTION_HIXL_HEARTBEAT_MISSES,
    OPTION_HIXL_HEARTBEAT_MS,
    OPTION_HIXL_METRICS_PORT,
    OPTION_HIXL_RDMA_MAX_WR_BYTES,
    OPTION_HIXL_RDMA_QPS_PER_LINK,
    OPTION_HIXL_RDMA_RETRY_COUNT,
    OPTION_HIXL_RDMA_SEND_WINDOW_BYTES,
    OPTION_HIXL_RDMA_TIMEOUT,
    OPTION_HIXL_TRANSPORT,
    OPTION_LOCAL_COMM_RES,
    OPTION_RDMA_SERVICE_LEVEL,
    OPTION_RDMA_TRAFFIC_CLASS,
    TRANSPORTS,
    ParsedOptions,
    parse_engine_address,
    parse_options,
)
from .status import (
    ALREADY_CONNECTED,
    FAILED,
    NOT_CONNECTED,
    NOTIFY_FAILED,
    PARAM_INVALID,
    RESOURCE_EXHAUSTED,
    SUCCESS,
    TIMEOUT,
    UNSUPPORTED,
    status_name,
)


# ----------------------------------------------------------------------- enums
class _CannEnum(enum.IntEnum):
    """An IntEnum that prints as CANN's (pybind11) enums do: ``str()`` and ``format()`` give
    ``"TransferStatus.COMPLETED"``, ``repr()`` ``"<TransferStatus.COMPLETED: 1>"`` (a format spec such as
    ``"d"`` formats the value)."""

    def __str__(self) -> str:
        return "%s.%s" % (type(self).__name__, self.name)

    def __repr__(self) -> str:
        return "<%s.%s: %d>" % (type(self).__name__, self.name, int(self))

    def __format__(self, spec: str) -> str:
        return str(self) if not spec else format(int(self), spec)


class MemType(_CannEnum):
    MEM_DEVICE = 0
    MEM_HOST = 1


class TransferOp(_CannEnum):
    READ = 0
    WRITE = 1


class TransferStatus(_CannEnum):
    WAITING = 0
    COMPLETED = 1
    TIMEOUT = 2
    FAILED = 3


class AsyncConnectStatus(_CannEnum):
    NOT_CONNECT = 0
    CONNECT_PENDING = 1
    CONNECTING = 2
    CONNECTED = 3
    CONNECT_FAILED = 4
    DISCONNECT_PENDING = 5
    DISCONNECTING = 6


class FeatureType(_CannEnum):
    AUTO_CONNECT = 0
    CLIENT_SERVER_COMM = 1


MEM_DEVICE, MEM_HOST = MemType
READ, WRITE = TransferOp
(NOT_CONNECT, CONNECT_PENDING, CONNECTING, CONNECTED, CONNECT_FAILED, DISCONNECT_PENDING,
 DISCONNECTING) = AsyncConnectStatus
AUTO_CONNECT, CLIENT_SERVER_COMM = FeatureType

FEATURE_SUPPORTED = 1
FEATURE_NOT_SUPPORTED = 0

MAX_NOTIFY_LEN = 1024
MAX_UNREAD_NOTIFIES = 4096

_U64_LIMIT = 2 ** 64


# ---------------------------------------------------------------- data classes
@dataclass
class MemDesc:
    addr: int = 0
    len: int = 0


@dataclass
class TransferOpDesc:
    local_addr: int = 0
    remote_addr: int = 0
    len: int = 0


@dataclass
class TransferArgs:
    user_data: int = 0


@dataclass
class GetTransferStatusArgs:
    max_query_count: int = 2 ** 32 - 1
    skip_waiting: bool = False


@dataclass
class TransferResult:
    req: int = 0
    user_data: int = 0
    status: TransferStatus = TransferStatus.WAITING


@dataclass
class NotifyDesc:
    name: str = ""
    notify_msg: str = ""


# ------------------------------------------------------------------ validation
_MISSING = object()


def _as_u64(v: Any) -> Optional[int]:
    """``v`` as an int in [0, 2**64), or None.  Accepts numpy ints; rejects bools."""
    if isinstance(v, bool) or type(v).__name__ in ("bool", "bool_"):  # also numpy bools
        return None
    try:
        n = operator.index(v)
    except Exception:
        return None
    return n if 0 <= n < _U64_LIMIT else None


def _range_ok(addr: Any, length: Any) -> bool:
    a, n = _as_u64(addr), _as_u64(length)
    return a is not None and n is not None and n > 0 and a + n <= _U64_LIMIT


def validate_mem_desc(d: Any) -> int:
    """SUCCESS if ``d.addr``/``d.len`` describe a non-empty, non-wrapping u64 range."""
    addr, length = getattr(d, "addr", _MISSING), getattr(d, "len", _MISSING)
    if addr is _MISSING or length is _MISSING:
        return PARAM_INVALID
    return SUCCESS if _range_ok(addr, length) else PARAM_INVALID


def validate_op_desc(d: Any) -> int:
    """SUCCESS if both ``[local_addr, +len)`` and ``[remote_addr, +len)`` are valid ranges."""
    la = getattr(d, "local_addr", _MISSING)
    ra = getattr(d, "remote_addr", _MISSING)
    length = getattr(d, "len", _MISSING)
    if _MISSING in (la, ra, length):
        return PARAM_INVALID
    return SUCCESS if _range_ok(la, length) and _range_ok(ra, length) else PARAM_INVALID


def validate_notify(d: Any) -> int:
    """SUCCESS if ``d.name`` and ``d.notify_msg`` are str of at most MAX_NOTIFY_LEN bytes of UTF-8 (as in
    CANN: 400 CJK characters are 1200 bytes, refused)."""
    for attr in ("name", "notify_msg"):
        v = getattr(d, attr, _MISSING)
        if not isinstance(v, str) or len(v) > MAX_NOTIFY_LEN:
            return PARAM_INVALID
        try:
            if len(v.encode("utf-8")) > MAX_NOTIFY_LEN:
                return PARAM_INVALID
        except UnicodeError:  # a lone surrogate
            return PARAM_INVALID
    return SUCCESS


# ------------------------------------------------------------------ capability
def get_capability(feature: Any) -> Tuple[int, int]:
    """``(SUCCESS, FEATURE_SUPPORTED)`` for a known FeatureType, else PARAM_INVALID."""
    if isinstance(feature, int) and not isinstance(feature, bool) \
            and int(feature) in (FeatureType.AUTO_CONNECT, FeatureType.CLIENT_SERVER_COMM):
        return SUCCESS, FEATURE_SUPPORTED
    return PARAM_INVALID, FEATURE_NOT_SUPPORTED


__all__ = [
    "SUCCESS", "PARAM_INVALID", "TIMEOUT", "NOT_CONNECTED", "ALREADY_CONNECTED",
    "NOTIFY_FAILED", "UNSUPPORTED", "RESOURCE_EXHAUSTED", "FAILED", "status_name",
    "MemType", "TransferOp", "TransferStatus", "AsyncConnectStatus", "FeatureType",
    "MEM_DEVICE", "MEM_HOST", "READ", "WRITE",
    "NOT_CONNECT", "CONNECT_PENDING", "CONNECTING", "CONNECTED", "CONNECT_FAILED",
    "DISCONNECT_PENDING", "DISCONNECTING", "AUTO_CONNECT", "CLIENT_SERVER_COMM",
    "FEATURE_SUPPORTED", "FEATURE_NOT_SUPPORTED", "MAX_NOTIFY_LEN", "MAX_UNREAD_NOTIFIES",
    "MemDesc", "TransferOpDesc", "TransferArgs", "GetTransferStatusArgs", "TransferResult",
    "NotifyDesc", "validate_mem_desc", "validate_op_desc", "validate_notify",
    "OPTION_ENABLE_USE_FABRIC_MEM", "OPTION_RDMA_TRAFFIC_CLASS", "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_BUFFER_POOL", "OPTION_GLOBAL_RESOURCE_CONFIG", "OPTION_AUTO_CONNECT",
    "OPTION_LOCAL_COMM_RES", "OPTION_HIXL_TRANSPORT", "OPTION_HIXL_DEVICE",
    "OPTION_HIXL_GID_INDEX", "OPTION_HIXL_AUTH_TOKEN", "OPTION_HIXL_ASYNC_TIMEOUT_MS", "OPTION_HIXL_HEARTBEAT_MS",
    "OPTION_HIXL_HEARTBEAT_MISSES", "OPTION_HIXL_METRICS_PORT", "OPTION_HIXL_RDMA_TIMEOUT", "OPTION_HIXL_RDMA_RETRY_COUNT",
    "OPTION_HIXL_RDMA_QPS_PER_LINK", "OPTION_HIXL_RDMA_MAX_WR_BYTES", "OPTION_HIXL_RDMA_SEND_WINDOW_BYTES",
    "TRANSPORTS", "ENV_TRANSPORT", "ENV_AUTH_TOKEN",
    "ENV_METRICS_PORT",
    "MAX_AUTH_TOKEN_BYTES", "ParsedOptions", "parse_options", "CANN_OPTIONS", "HIXL_OPTIONS", "ENV_RDMA_TC",
    "ENV_RDMA_SL", "GLOBAL_RESOURCE_FIELDS", "ADXL_PREFIX", "CONNECT_POOL_THREADS", "CONNECT_POOL_CAPACITY",
    "get_capability", "parse_engine_address",
]
