"""The parts of ``hixl.Hixl`` beyond CANN's API that signal rather than move data: completion
flags, flag failures and metrics. A mixin of :class:`hixl.Hixl` (its state and helpers: ``_engine``,
``_finalized``, ``_refuse``, ``_done``, ``_failed``, ``_remote``, ``_timeout``, ``_wait_ms``), kept in
its own file so that ``engine.py`` stays the CANN surface; the argument helpers both use live here.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from . import metrics as _metrics
from .types import FAILED, _as_u64

_INT32_MAX = 2 ** 31 - 1
_U64_MAX = 2 ** 64 - 1
_U64_LIMIT = 2 ** 64
_DEFAULT_TIMEOUT_MS = 1000


def _int(v: Any, lo: int, hi: int) -> Optional[int]:
    """``v`` as an int in [lo, hi] (0 <= lo), else None; bools (numpy's too) refused as in hixl.types."""
    # ints and IntEnums are the common case (bool is an int subclass: refused like numpy's bools)
    n = int(v) if isinstance(v, int) and not isinstance(v, bool) else _as_u64(v)
    return n if n is not None and lo <= n <= hi else None


_ENUM_VALUES: Dict[Any, frozenset] = {}


def _enum(v: Any, cls: Any) -> Optional[int]:
    """``v`` as the int value of a member of IntEnum ``cls``, else None."""
    values = _ENUM_VALUES.get(cls)
    if values is None:
        values = _ENUM_VALUES[cls] = frozenset(int(m) for m in cls)
    n = _int(v, 0, 255)
    return n if n is not None and n in values else None


class Signals:
    """Completion flags, flag failures and metrics of a :class:`hixl.Hixl` (see the module)."""

    _engine: Any
    _finalized: bool
    _forked: str
    _pid: int
    _metrics_server: Optional[_metrics.Server]

    def poll_flags(self, max_count: int = 4096) -> Tuple[int, List[Tuple[str, int]]]:
        """Completion flags received so far (``(peer, value)``, oldest first); never blocks."""
        try:
            if self._finalized:
                return FAILED, []
            m = _int(max_count, 1, _U64_MAX)
            if m is None:
                return self._refuse("poll_flags: max_count must be a positive int"), []
            rc, rows = self._engine.poll_flags(m)
            return self._done(rc), list(rows)
        except Exception as e:
            return self._failed("poll_flags", e), []

    def wait_flags(self, timeout_in_millis: Optional[int] = None,
                   max_count: int = 4096) -> Tuple[int, List[Tuple[str, int]]]:
        """Blocks (GIL released) until at least one completion flag is there or the timeout
        (None: no limit) passes (then ``(SUCCESS, [])``). Once :meth:`poll_flag_failures` was called,
        a flag failure pending also ends the wait, with the flags there are (possibly none)."""
        try:
            if self._finalized:
                return FAILED, []
            t, m = self._wait_ms(timeout_in_millis), _int(max_count, 1, _U64_MAX)
            if t is None or m is None:
                return self._refuse("wait_flags: timeout None or 0..2**31-1 ms, max_count a positive int"), []
            rc, rows = self._engine.wait_flags(m, t)
            return self._done(rc), list(rows)
        except Exception as e:
            return self._failed("wait_flags", e), []

    def fail_flag(self, remote_engine: str, flag: int, reason: str,
                  timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> int:
        """Tells a connected peer that completion flag ``flag`` (u32) will not come, and why: its
        :meth:`poll_flag_failures` returns ``(our name, flag, reason)`` at once (and its flag waiters
        wake), so it need not wait for its own timeout. ``reason``: at most 4096 bytes of UTF-8 are
        sent. NOT_CONNECTED without a link (the peer then learns from the link's end instead)."""
        try:
            if self._finalized:
                return FAILED
            if self._remote(remote_engine) is None:
                return self._refuse("fail_flag: bad remote_engine %r" % (remote_engine,))
            f, t = _int(flag, 0, 2 ** 32 - 1), self._timeout(timeout_in_millis)
            if f is None or t is None or not isinstance(reason, str):
                return self._refuse("fail_flag: flag a u32, reason a str, timeout_in_millis in 1..2**31-1")
            return self._done(self._engine.fail_flag(remote_engine, f, reason, t))
        except Exception as e:
            return self._failed("fail_flag", e)

    def poll_flag_failures(self, max_count: int = 4096) -> Tuple[int, List[Tuple[str, int, str]]]:
        """Flags that will not come, oldest first; never blocks: ``(peer, flag, reason)`` for a
        peer's :meth:`fail_flag`, and ``(peer, -1, reason)`` when the link to ``peer`` closed (none of
        its flags not yet seen will come over it; reason names why: heartbeat, peer closed, abort,
        transfer error, ...). Opt-in: the first call subscribes; failures are kept from then on, and
        :meth:`wait_flags` and :meth:`flag_fd` then wake for them too (a user who never calls this
        sees flags exactly as before)."""
        try:
            if self._finalized:
                return FAILED, []
            m = _int(max_count, 1, _U64_MAX)
            if m is None:
                return self._refuse("poll_flag_failures: max_count must be a positive int"), []
            rc, rows = self._engine.poll_flag_failures(m)
            return self._done(rc), list(rows)
        except Exception as e:
            return self._failed("poll_flag_failures", e), []

    def flag_fd(self) -> int:
        """An eventfd that is readable while completion flags (and, once :meth:`poll_flag_failures`
        was called, flag failures) are pending, for select/poll/asyncio: wait on it, then poll them;
        -1 when not initialized."""
        try:
            return -1 if self._finalized else int(self._engine.flag_fd)
        except Exception:
            return -1

    def _read_metrics(self) -> Optional[Dict[str, Any]]:
        return None if self._finalized or self._forked else self._engine.metrics()

    def metrics(self) -> Dict[str, List[Dict[str, Any]]]:
        """The engine's counters, as ``/metrics`` serves them (:mod:`hixl.metrics` lists each):
        ``{metric name: [{"name": sample name, "labels": {...}, "value": float}, ...]}``; ``{}``
        when not initialized. Reading them takes no lock of the data path."""
        try:
            raw = self._read_metrics() if self._pid else None
            return {} if raw is None else _metrics.as_dict(raw)
        except Exception as e:
            self._failed("metrics", e)
            return {}

    @property
    def metrics_address(self) -> str:
        """``"host:port"`` where ``/metrics`` is served (``HixlMetricsPort``), else ``""``."""
        server = self._metrics_server
        return server.address if server is not None else ""
