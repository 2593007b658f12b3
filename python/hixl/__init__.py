"""hixl: one-sided RDMA KV-cache transfer for disaggregated LLM inference."""
from __future__ import annotations

from . import _core
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

__all__ = [
    "ACCESS_RO", "ACCESS_RW", "Endpoint", "HixlError", "MemoryRegion", "NotSupportedError", "Op",
    "RequestFailed", "TransferStatus", "has_active_device", "list_devices", "__version__",
]
