"""What a worker knows of its peer workers: each one's description (its KV cache groups' memory maps,
layouts, block interiors and KV heads, TP rank and size, registration epoch), learned over the hixl link with the
``describe``/``described`` messages of :mod:`hixl.vllm.messages` once per peer and cached, so that
per-request parameters need not carry it.

:meth:`PeerBook.get` runs on the jobs thread (it may wait for the answer; the forward thread never
calls it); the answer arrives on the inbox thread (:meth:`PeerBook.on_described`). A cached entry is
dropped (:meth:`PeerBook.forget`) when the link to the peer was re-established (the peer may have
restarted and registered its KV cache elsewhere) or a read from it failed; the next transfer asks again.
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any, Dict, Optional, Tuple

from .links import Links

_log = logging.getLogger("hixl.vllm")

FIELDS = ("engine", "groups", "rank", "tp", "epoch")


class PeerBook:
    def __init__(self, links: Links, local: str, timeout_s: float):
        self.links, self.local, self.timeout_s = links, local, float(timeout_s)
        self._lock = threading.Lock()
        self._known: Dict[str, Dict[str, Any]] = {}
        self._epochs: Dict[str, str] = {}  # the last epoch seen per peer (to log a re-registration)
        self._asked: Dict[str, Tuple[threading.Event, Dict[str, Any]]] = {}  # nonce -> (answered, answer)
        self._n = 0
        self.asked = 0  # describes sent (what the cache saves shows here)

    def cached(self, peer: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            return self._known.get(peer)

    def forget(self, peer: str) -> None:
        with self._lock:
            self._known.pop(peer, None)

    def get(self, peer: str) -> Dict[str, Any]:
        """``peer``'s description: cached, or asked for over the link (jobs thread only: it connects
        and waits up to ``timeout_s``). Raises ConnectionError (no answer) or ValueError (a malformed one)."""
        fresh = not self.links.linked(peer)
        self.links.ensure_link(peer)
        with self._lock:
            if fresh:  # a new link: whatever we knew of the peer may be stale
                self._known.pop(peer, None)
            d = self._known.get(peer)
            if d is not None:
                return d
            self._n += 1
            nonce = f"q{self._n}"
            waiter: Tuple[threading.Event, Dict[str, Any]] = (threading.Event(), {})
            self._asked[nonce] = waiter
        try:
            self.asked += 1
            self.links.send(peer, "describe", nonce, json.dumps({"from": self.local}))
            if not waiter[0].wait(self.timeout_s):
                raise ConnectionError(f"describe of {peer}: no answer within {self.timeout_s:g} s")
        finally:
            with self._lock:
                self._asked.pop(nonce, None)
        d = waiter[1]
        if "error" in d:
            raise ValueError(f"describe of {peer}: the peer answered {d['error']}")
        missing = [k for k in FIELDS if k not in d]
        if missing or d.get("engine") != peer:
            raise ValueError(f"describe of {peer}: a malformed answer (missing {missing}, engine {d.get('engine')!r})")
        with self._lock:
            old = self._epochs.get(peer)
            if old is not None and old != d["epoch"]:
                _log.info("hixl.vllm: the peer %s registered its KV cache anew (epoch %s -> %s)", peer, old, d["epoch"])
            self._epochs[peer] = d["epoch"]
            self._known[peer] = d
        return d

    def on_described(self, nonce: str, d: Dict[str, Any]) -> None:
        """Inbox thread: the answer to the describe ``nonce``."""
        with self._lock:
            waiter = self._asked.get(nonce)
        if waiter is None:
            _log.info("hixl.vllm: an answer to describe %s nobody waits for: ignored", nonce)
            return
        waiter[1].update(d)
        waiter[0].set()
