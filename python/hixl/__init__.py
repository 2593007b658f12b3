"""hixl: one-sided RDMA KV-cache transfer for disaggregated LLM inference."""
from __future__ import annotations

from . import _core, types
from . import hixl  # CANN's binding is the module hixl.hixl: the same names there
# CANN hixl module surface: status codes, enums (and their module constants), option keys, data classes.
from .types import *  # noqa: F401,F403
from .descs import DESC_DTYPE
from .engine import Hixl
from .endpoint import (
    ACCESS_RO,
    ACCESS_RW,
    Endpoint,
    HixlError,
    MemoryRegion,
    NotSupportedError,
    Op,
    RequestFailed,
    TransferStatus,
    has_active_device,
    list_devices,
)

__version__ = "0.1.0"

__all__ = list(types.__all__) + [
    "Hixl", "ACCESS_RO", "ACCESS_RW", "Endpoint", "HixlError", "MemoryRegion", "NotSupportedError", "Op",
    "RequestFailed", "TransferStatus", "has_active_device", "list_devices", "__version__", "DESC_DTYPE",
]
