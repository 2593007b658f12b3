"""Errors of :mod:`hixl.kv`."""
from __future__ import annotations

from typing import Optional


class KVError(Exception):
    """Base class. ``code`` is the hixl status code of the engine call that failed, if one did."""

    def __init__(self, msg: str, code: Optional[int] = None):
        super().__init__(msg)
        self.code = code


class PoolExhausted(KVError):
    """Not enough free blocks (or request slots) within the timeout."""


class KVTimeout(KVError):
    """A wait or a transfer did not finish within its timeout."""


class TransferFailed(KVError):
    """A transfer of a request failed (peer gone, link torn down, range refused)."""
