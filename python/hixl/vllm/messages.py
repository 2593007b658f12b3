"""What the connectors of a prefill and a decode instance say to each other: hixl notifies on the link
between their engines (ordered, acknowledged, after every transfer that completed before them).

A notify's name says what it is and for which transfer: ``hixl.vllm/<kind>/<transfer id>[/<i>/<n>]``;
its message (at most 1024 characters) is the payload. A grant (the decoder's blocks, a
:class:`hixl.kv.Grant` as JSON) can be longer: it travels in ``n`` parts, reassembled here.

kinds:
* ``grant`` (decode -> prefill): write this request's KV into these blocks, then flag this ticket;
* ``cancel`` (decode -> prefill): the decoder gave up on the request (timeout, abort);
* ``cancelled`` (prefill -> decode): none of that request's writes can land any more;
* ``abort`` (prefill -> decode): the prefill will not deliver (its request failed, was aborted, expired,
  or the grant did not fit); the message says why;
* ``release`` (decode -> prefill, pull mode): the decoder read the blocks; the prefill may free them
  (also sent to a prefill TP rank none of whose heads a decoder needs: it frees them at once);
* ``relay`` (decode rank -> another rank of the same decoder): the part of this request's KV that the
  other rank copies from us (the MLA latent, which crosses the network once) has landed here
  (``{"ok": true}``: read it now) or will not (``{"ok": false, "why": ...}``);
* ``describe`` (any -> a peer worker; the transfer id is a nonce): tell me your memory map; the
  message is ``{"from": <asker's engine>}``;
* ``described`` (the answer, same nonce, in parts like a grant): the worker's engine, its KV cache
  groups (each: kind, block size, window, block interior, layout, memory map
  (:class:`hixl.kv.BlockMemory`) and KV heads (:class:`hixl.kv.HeadSlice`)), TP rank and size, and its
  registration ``epoch`` (new each time the worker registers its KV cache).
  A worker asks each peer once and caches the answer; it asks again when its link to the peer was
  re-established (the peer may have restarted) or a read from it failed.
"""
from __future__ import annotations

import json
import re
import time
from typing import Dict, List, Optional, Tuple

PREFIX = "hixl.vllm/"
KINDS = ("grant", "cancel", "cancelled", "abort", "release", "relay", "describe", "described")
PARTED = ("grant", "described")  # kinds whose payload may span several notifies
MAX_MSG = 1024
MAX_PARTS = 256
_TID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

__all__ = ["PREFIX", "KINDS", "PARTED", "valid_tid", "encode", "decode_name", "Reassembler"]


def valid_tid(tid: object) -> bool:
    return isinstance(tid, str) and bool(_TID.match(tid))


def encode(kind: str, tid: str, payload: str = "") -> List[Tuple[str, str]]:
    """``(name, message)`` notifies carrying ``payload`` (split into parts when it is longer than a
    notify holds; only the kinds in PARTED may be)."""
    if kind not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}")
    if not valid_tid(tid):
        raise ValueError(f"transfer id {tid!r} is not 1-128 characters of [A-Za-z0-9._:-]")
    if kind not in PARTED:
        return [(f"{PREFIX}{kind}/{tid}", payload[:MAX_MSG])]
    parts = [payload[i:i + MAX_MSG] for i in range(0, len(payload), MAX_MSG)] or [""]
    if len(parts) > MAX_PARTS:
        raise ValueError(f"{kind} of {len(payload)} characters is over {MAX_PARTS} notifies")
    return [(f"{PREFIX}{kind}/{tid}/{i}/{len(parts)}", p) for i, p in enumerate(parts)]


def decode_name(name: str) -> Optional[Tuple[str, str, int, int]]:
    """``(kind, tid, part, parts)`` of a notify of ours, else None."""
    if not name.startswith(PREFIX):
        return None
    bits = name[len(PREFIX):].split("/")
    if len(bits) == 2 and bits[0] in KINDS and bits[0] not in PARTED and valid_tid(bits[1]):
        return bits[0], bits[1], 0, 1
    if len(bits) == 4 and bits[0] in PARTED and valid_tid(bits[1]) and bits[2].isdigit() and bits[3].isdigit():
        i, n = int(bits[2]), int(bits[3])
        if 0 <= i < n <= MAX_PARTS:
            return bits[0], bits[1], i, n
    return None


class Reassembler:
    """Grants (and the other PARTED messages: key them by kind and id) arriving in parts: bounded (at
    most ``max_pending`` incomplete ones, each dropped ``ttl_s`` after its first part)."""

    def __init__(self, max_pending: int = 4096, ttl_s: float = 60.0):
        self._parts: Dict[str, Tuple[float, int, Dict[int, str]]] = {}
        self.max_pending, self.ttl_s = max_pending, ttl_s
        self.dropped = 0

    def add(self, tid: str, i: int, n: int, msg: str, now: Optional[float] = None) -> Optional[dict]:
        """The whole grant (parsed JSON) once its last part arrived; None before. Raises ValueError for
        a malformed grant."""
        now = time.monotonic() if now is None else now
        if n == 1:
            return self._parse(tid, msg)
        t0, n0, got = self._parts.get(tid, (now, n, {}))
        if n0 != n:
            del self._parts[tid]
            raise ValueError(f"grant {tid}: parts announced as {n0} and {n}")
        got[i] = msg
        if len(got) < n:
            self._parts[tid] = (t0, n, got)
            self._expire(now)
            return None
        self._parts.pop(tid, None)
        return self._parse(tid, "".join(got[k] for k in range(n)))

    def _expire(self, now: float) -> None:
        old = [t for t, (t0, _, _) in self._parts.items() if now - t0 > self.ttl_s]
        while len(self._parts) - len(old) > self.max_pending:
            old.append(next(t for t in self._parts if t not in old))
        for t in old:
            del self._parts[t]
            self.dropped += 1

    @staticmethod
    def _parse(tid: str, text: str) -> dict:
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"grant {tid}: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"grant {tid}: not a JSON object")
        return d
