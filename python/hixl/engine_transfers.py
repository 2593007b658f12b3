"""The former module of :class:`hixl.Hixl`'s transfer methods, kept importable: ``Transfers`` is
:class:`hixl.Hixl` itself, whose class attributes are the Python methods behind the engine's C
per-request calls."""
from __future__ import annotations

from .engine import Hixl as Transfers

__all__ = ["Transfers"]
