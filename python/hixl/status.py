"""CANN hixl's status codes: every ``hixl.Hixl`` call returns one (alone or first in a tuple).

Re-exported by :mod:`hixl.types` and :mod:`hixl`, where users import them from.
"""
from __future__ import annotations

from typing import Any

SUCCESS = 0
PARAM_INVALID = 103900
TIMEOUT = 103901
NOT_CONNECTED = 103902
ALREADY_CONNECTED = 103903
NOTIFY_FAILED = 103904
UNSUPPORTED = 103905
RESOURCE_EXHAUSTED = 203900
FAILED = 503900

_STATUS_NAMES = {globals()[n]: n for n in (
    "SUCCESS", "PARAM_INVALID", "TIMEOUT", "NOT_CONNECTED", "ALREADY_CONNECTED",
    "NOTIFY_FAILED", "UNSUPPORTED", "RESOURCE_EXHAUSTED", "FAILED")}


def status_name(code: Any) -> str:
    """Name of a status code, e.g. ``status_name(103900) == "PARAM_INVALID"``.

    Unknown codes give ``"UNKNOWN(<code>)"``; never raises.
    """
    if isinstance(code, int) and not isinstance(code, bool):
        name = _STATUS_NAMES.get(int(code))
        if name is not None:
            return name
    return "UNKNOWN(%r)" % (code,)


__all__ = ["SUCCESS", "PARAM_INVALID", "TIMEOUT", "NOT_CONNECTED", "ALREADY_CONNECTED",
           "NOTIFY_FAILED", "UNSUPPORTED", "RESOURCE_EXHAUSTED", "FAILED", "status_name"]
