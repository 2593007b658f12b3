"""A decoder scheduler's lookups of prefill bootstrap endpoints (``GET <remote_bootstrap_addr>/query``,
see :mod:`hixl.vllm.bootstrap`), for requests described by Mooncake's contract whose engine id does not
name the hixl engines itself.

vLLM's scheduler loop never waits on one: :meth:`BootstrapLookups.get` answers from the cache at once,
or starts the lookup on a daemon thread (one per address at a time, bounded by ``timeout_s``) and
answers "not yet"; the scheduler asks again at its next step. Answers are cached per address; an
answer that lacks the engine asked for is fetched again (the prefill restarted), at most once a
``refresh_s``. A failure is cached for ``retry_after_s`` (the requests of a burst fail together, a
later one tries again).
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["BootstrapLookups", "query_url"]


def query_url(addr: str) -> str:
    """The ``/query`` URL of a bootstrap address (``host:port`` or ``http://host:port``)."""
    base = addr if addr.startswith(("http://", "https://")) else "http://" + addr
    return base.rstrip("/") + "/query"


def _fetch(url: str, timeout_s: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:  # noqa: S310 -- an http(s) URL by query_url
        return json.loads(r.read(1 << 20))


class BootstrapLookups:
    def __init__(self, timeout_s: float, retry_after_s: float = 1.0, refresh_s: float = 1.0,
                 fetch: Optional[Callable[[str, float], Any]] = None):
        self.timeout_s, self.retry_after_s, self.refresh_s = timeout_s, retry_after_s, refresh_s
        self._fetch = fetch or _fetch
        self._lock = threading.Lock()
        self._answers: Dict[str, Tuple[float, Any]] = {}   # addr -> (when, the /query answer)
        self._errors: Dict[str, Tuple[float, str]] = {}    # addr -> (when, why)
        self._asking: Dict[str, threading.Thread] = {}

    def get(self, addr: str, has: Optional[Callable[[Any], bool]] = None) -> Tuple[Optional[Any], Optional[str]]:
        """``(answer, None)`` when known (and ``has(answer)``, if given, holds or it was fetched within
        ``refresh_s``); ``(None, why)`` when the last lookup failed within ``retry_after_s``; ``(None,
        None)`` while a lookup is under way (started here when none was). Never blocks."""
        now = time.monotonic()
        with self._lock:
            got = self._answers.get(addr)
            if got is not None and (has is None or has(got[1]) or now - got[0] < self.refresh_s):
                return got[1], None
            err = self._errors.get(addr)
            if err is not None and now - err[0] < self.retry_after_s:
                return None, err[1]
            if addr not in self._asking:
                th = threading.Thread(target=self._ask, args=(addr,), name="hixl-vllm-bootstrap-query", daemon=True)
                self._asking[addr] = th
                th.start()
            return None, None

    def pending(self) -> bool:
        with self._lock:
            return bool(self._asking)

    def _ask(self, addr: str) -> None:
        url = query_url(addr)
        try:
            answer, why = self._fetch(url, self.timeout_s), None
        except Exception as e:  # noqa: BLE001 -- any failure fails the requests waiting, with its reason
            answer, why = None, f"GET {url} failed within {self.timeout_s:g} s: {type(e).__name__}: {e}"
        with self._lock:
            now = time.monotonic()
            if why is None:
                self._answers[addr] = (now, answer)
                self._errors.pop(addr, None)
            else:
                self._errors[addr] = (now, why)
                self._answers.pop(addr, None)
            self._asking.pop(addr, None)
