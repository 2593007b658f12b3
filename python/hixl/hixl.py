"""``hixl.hixl``: where CANN's Python binding lives (its ``hixl/__init__.py`` does
``from hixl.hixl import ...``), so that code importing from it runs unchanged.

It re-exports exactly the names CANN's binding exports; everything else of this package is in
:mod:`hixl` (and :mod:`hixl.types`).
"""
from __future__ import annotations

from .engine import Hixl
from .types import (
    ALREADY_CONNECTED,
    AUTO_CONNECT,
    CLIENT_SERVER_COMM,
    CONNECT_FAILED,
    CONNECT_PENDING,
    CONNECTED,
    CONNECTING,
    DISCONNECT_PENDING,
    DISCONNECTING,
    FAILED,
    FEATURE_NOT_SUPPORTED,
    FEATURE_SUPPORTED,
    MEM_DEVICE,
    MEM_HOST,
    NOT_CONNECT,
    NOT_CONNECTED,
    NOTIFY_FAILED,
    OPTION_AUTO_CONNECT,
    OPTION_BUFFER_POOL,
    OPTION_ENABLE_USE_FABRIC_MEM,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LOCAL_COMM_RES,
    OPTION_RDMA_SERVICE_LEVEL,
    OPTION_RDMA_TRAFFIC_CLASS,
    PARAM_INVALID,
    READ,
    RESOURCE_EXHAUSTED,
    SUCCESS,
    TIMEOUT,
    UNSUPPORTED,
    WRITE,
    AsyncConnectStatus,
    FeatureType,
    GetTransferStatusArgs,
    MemDesc,
    MemType,
    NotifyDesc,
    TransferArgs,
    TransferOp,
    TransferOpDesc,
    TransferResult,
    TransferStatus,
    get_capability,
)

# In the order of CANN's hixl/__init__.py.
__all__ = [
    "SUCCESS", "PARAM_INVALID", "TIMEOUT", "NOT_CONNECTED", "ALREADY_CONNECTED", "NOTIFY_FAILED",
    "UNSUPPORTED", "FAILED", "RESOURCE_EXHAUSTED",
    "OPTION_ENABLE_USE_FABRIC_MEM", "OPTION_RDMA_TRAFFIC_CLASS", "OPTION_RDMA_SERVICE_LEVEL",
    "OPTION_BUFFER_POOL", "OPTION_GLOBAL_RESOURCE_CONFIG", "OPTION_AUTO_CONNECT", "OPTION_LOCAL_COMM_RES",
    "FEATURE_SUPPORTED", "FEATURE_NOT_SUPPORTED",
    "MemType", "MEM_DEVICE", "MEM_HOST", "TransferOp", "READ", "WRITE", "TransferStatus",
    "AsyncConnectStatus", "NOT_CONNECT", "CONNECT_PENDING", "CONNECTING", "CONNECTED", "CONNECT_FAILED",
    "DISCONNECT_PENDING", "DISCONNECTING", "FeatureType", "AUTO_CONNECT", "CLIENT_SERVER_COMM",
    "MemDesc", "TransferOpDesc", "TransferArgs", "GetTransferStatusArgs", "TransferResult", "NotifyDesc",
    "Hixl", "get_capability",
]
