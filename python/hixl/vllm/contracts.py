"""The ``kv_transfer_params`` contracts that routers speak, read and written by the scheduler side.

A prefill's answer (:func:`prefill_answer`) carries NIXL's fields (what ``vllm-router --kv-connector
nixl`` and vLLM's toy proxies forward or rebuild) beside the connector's own; a decoder accepts a request
described by any of three contracts (:func:`describe_remote`):

* **ours**: ``transfer_id``, ``remote_engine`` (or ``remote_engines``, one per prefill TP rank) and
  ``mode``; pull also ``remote_blocks``;
* **NIXL's**: ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size``;
  pull also ``remote_block_ids`` (one list per KV cache group);
* **Mooncake's**: ``transfer_id``, ``remote_bootstrap_addr`` and ``remote_engine_id``.

The prefill's ``remote_engine_id`` is ``<vLLM engine id>@<hixl engine of rank 0>[,<rank 1>...]``
(:func:`encode_engine_id`): a router that rewrites ``remote_host`` with the HTTP host (production-stack
does) leaves it alone, so the hixl engines are still found. Both sides derive the transfer id with
:func:`transfer_id_of`, so a Mooncake router's ``transfer_id`` (sent to both) and NIXL's
``remote_request_id`` (the prefill's transfer id) name the same transfer.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Dict, List, Optional, Tuple

from . import messages

__all__ = ["transfer_id_of", "base_request_id", "prefill_transfer_id", "encode_engine_id", "decode_engine_id", "split_addr", "valid_addr",
           "prefill_answer", "describe_remote", "engines_from_query", "MODES"]

MODES = ("push", "pull")
_PORT = re.compile(r"^[0-9]{1,5}$")


def transfer_id_of(raw: Any) -> Optional[str]:
    """The transfer id both sides use for ``raw`` (a router's transfer id, vLLM's request id): itself
    when it is a valid transfer id, else a hash of it (the same on both sides); None when it is empty
    or not a string."""
    if not isinstance(raw, str) or not raw:
        return None
    if messages.valid_tid(raw):
        return raw
    return "h-" + hashlib.sha256(raw.encode("utf-8", "replace")).hexdigest()[:40]


_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


def base_request_id(request_id: str) -> str:
    """vLLM's request id without the random ``-<8 hex>`` it appends to the external one
    (``cmpl-<X-Request-Id>-0-1a2b3c4d`` -> ``cmpl-<X-Request-Id>-0``): what a prefill and a decoder
    given the same ``X-Request-Id`` by a router have in common (NIXL's push matches on it too)."""
    return _RANDOM_SUFFIX.sub("", request_id)


def prefill_transfer_id(p: Dict[str, Any], request_id: str) -> Optional[str]:
    """The prefill's transfer id for a request: the router's ``transfer_id`` (ours, Mooncake's), else
    vLLM's request id without its random suffix (:func:`base_request_id`)."""
    return transfer_id_of(p.get("transfer_id")) or transfer_id_of(base_request_id(request_id))


def _decoder_transfer_id(p: Dict[str, Any], request_id: Optional[str]) -> Optional[str]:
    """The transfer id a decoder's params name: ``transfer_id``; else NIXL's ``remote_request_id``,
    which is the prefill's transfer id when the prefill's answer was passed on, or the router's own
    request id when the router rebuilt the params (vllm-router does): then the decoder's request id
    (the router gave both instances that id) says which transfer it is."""
    tid = transfer_id_of(p.get("transfer_id"))
    if tid is not None:
        return tid
    rrid = p.get("remote_request_id")
    if not isinstance(rrid, str) or not rrid:
        return None
    if request_id:
        own = base_request_id(request_id)
        if own != rrid and (own.endswith(f"-{rrid}-0") or own == f"chatcmpl-{rrid}"):
            return transfer_id_of(own)
    return transfer_id_of(rrid)


def split_addr(addr: str) -> Tuple[str, int]:
    """``("host", port)`` of a hixl engine address ``host:port`` or ``[v6]:port``; ValueError if it is not one."""
    if not isinstance(addr, str):
        raise ValueError(f"engine address {addr!r} is not a string")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not _PORT.match(port) or not 0 < int(port) < 65536:
        raise ValueError(f"engine address {addr!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() or c in ",@/" for c in host) or (":" in host and not addr.startswith("[")):
        raise ValueError(f"engine address {addr!r} is not host:port")
    return host, int(port)


def valid_addr(addr: Any) -> bool:
    try:
        split_addr(addr)
        return True
    except ValueError:
        return False


def _join(host: Any, port: Any) -> Optional[str]:
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, (int, str)):
        return None
    addr = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    return addr if valid_addr(addr) else None


def encode_engine_id(vllm_engine_id: str, engines: List[str]) -> str:
    """NIXL's ``remote_engine_id`` of a prefill: vLLM's engine id, ``@``, its hixl engines by TP rank."""
    return f"{vllm_engine_id}@{','.join(engines)}"


def decode_engine_id(engine_id: Any) -> Optional[List[str]]:
    """The hixl engines an engine id of :func:`encode_engine_id` names; None for any other id."""
    if not isinstance(engine_id, str) or "@" not in engine_id:
        return None
    addrs = engine_id.rsplit("@", 1)[1].split(",")
    return addrs if addrs and all(valid_addr(a) for a in addrs) else None


def prefill_answer(tid: str, engines: List[str], vllm_engine_id: str, mode: str, n_tokens: int,
                   blocks: List[List[Optional[int]]]) -> Dict[str, Any]:
    """What a finished prefill request answers (``request_finished``): NIXL's fields and ours, and no
    memory map (a decoder learns that once per peer over the hixl link). ``blocks``: per KV cache group
    that moves, the prefill's blocks (None: vLLM's null block, which NIXL's field gives as 0);
    ``remote_blocks`` is one group's list, or a list per group when there are several."""
    host, port = split_addr(engines[0])
    ours = list(blocks[0]) if len(blocks) == 1 else [list(b) for b in blocks]
    return {"do_remote_prefill": True, "do_remote_decode": False,
            # NIXL's
            "remote_engine_id": encode_engine_id(vllm_engine_id, engines), "remote_request_id": tid,
            "remote_block_ids": [[0 if b is None else b for b in g] for g in blocks], "remote_host": host,
            "remote_port": port, "remote_num_tokens": n_tokens, "tp_size": len(engines), "pp_size": 1,
            "transfer_mode": mode,
            # ours
            "transfer_id": tid, "remote_engine": engines[0], "remote_engines": list(engines), "mode": mode,
            "num_tokens": n_tokens, "remote_blocks": ours}


def _block_lists(p: Dict[str, Any]) -> Optional[List[List[Optional[int]]]]:
    """The prefill's blocks per group that ``p`` names (ours: ``remote_blocks``, one group's list or one
    per group; NIXL's ``remote_block_ids``, one per group, 0 its null block); None when neither is."""
    def ids(x: Any, null_zero: bool) -> Optional[List[Optional[int]]]:
        if not isinstance(x, list) or not all(b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 0)
                                              for b in x):
            return None
        return [None if b is None or (null_zero and b == 0) else b for b in x]
    ours = p.get("remote_blocks")
    if isinstance(ours, list) and ours and all(isinstance(x, list) for x in ours):
        lists = [ids(x, False) for x in ours]
        return lists if all(x is not None for x in lists) else None
    one = ids(ours, False)
    if one is not None:
        return [one]
    nixl = p.get("remote_block_ids")
    if isinstance(nixl, list) and nixl and all(isinstance(x, list) for x in nixl):
        lists = [ids(x, True) for x in nixl]
        return lists if all(x is not None for x in lists) else None
    return None


def _engines(p: Dict[str, Any]) -> Tuple[Optional[List[str]], str]:
    """The prefill's hixl engines named in ``p`` itself, and by which field; (None, why) when none is."""
    many = p.get("remote_engines")
    if isinstance(many, list) and many and all(valid_addr(a) for a in many):
        return list(many), "remote_engines"
    by_id = decode_engine_id(p.get("remote_engine_id"))
    if by_id:
        return by_id, "remote_engine_id"
    one = p.get("remote_engine")
    if valid_addr(one):
        return [one], "remote_engine"
    if p.get("remote_bootstrap_addr"):
        return None, "bootstrap"
    joined = _join(p.get("remote_host"), p.get("remote_port"))
    if joined:
        return [joined], "remote_host"
    return None, "no hixl engine: none of remote_engines, remote_engine_id (host:port after '@'), remote_engine, " \
                 "remote_bootstrap_addr, remote_host + remote_port is usable"


def describe_remote(p: Dict[str, Any], default_mode: str, request_id: Optional[str] = None) -> Dict[str, Any]:
    """A decoder request's remote prefill, whichever contract described it: ``tid``, ``mode``,
    ``engines`` (None: ask ``bootstrap``, or ``why`` says what is missing), ``tp`` (the prefill's TP
    size when the params name it), ``blocks`` (the prefill's blocks per group, for pull), ``engine_id``,
    ``bootstrap`` and ``why`` (None when usable). ``request_id``: the decoder's own vLLM request id."""
    tid = _decoder_transfer_id(p, request_id)
    mode = p.get("mode") or default_mode
    blocks = _block_lists(p)
    tp = p.get("tp_size")
    tp = tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 0 else None
    engines, where = _engines(p)
    out = {"tid": tid, "mode": mode, "engines": engines, "tp": tp, "blocks": blocks, "via": where,
           "engine_id": p.get("remote_engine_id"), "bootstrap": p.get("remote_bootstrap_addr"), "why": None}
    if tid is None:
        out["why"] = "no transfer id: neither transfer_id nor remote_request_id is a non-empty string"
    elif mode not in MODES:
        out["why"] = f"mode {mode!r} is not push or pull"
    elif engines is None and where != "bootstrap":
        out["why"] = where
    elif engines is not None and tp is not None and tp != len(engines):
        out["why"] = f"tp_size {tp} but {len(engines)} hixl engine(s) known ({where}): the prefill's other " \
                     f"ranks cannot be found"
    elif where == "bootstrap" and not isinstance(out["bootstrap"], str):
        out["why"] = f"remote_bootstrap_addr {out['bootstrap']!r} is not a string"
    if out["why"] is None and mode == "pull" and blocks is None:
        out["mode"] = "push"  # the prefill's block ids are unknown: it pushes from the blocks it holds
    return out


def engines_from_query(answer: Any, engine_id: Any) -> List[str]:
    """The hixl engines by TP rank that a bootstrap ``/query`` answer (MooncakeBootstrapServer's shape:
    ``{dp_rank: {engine_id, worker_addr: {tp_rank: {pp_rank: addr}}}}``) gives for ``engine_id`` (the
    entry with that id, else the only entry); ValueError saying why none."""
    if not isinstance(answer, dict) or not answer:
        raise ValueError(f"the answer names no engine: {str(answer)[:200]}")
    entries = [e for e in answer.values() if isinstance(e, dict)]
    ours = [e for e in entries if e.get("engine_id") == engine_id]
    if not ours and len(entries) == 1:
        ours = entries
    if not ours:
        raise ValueError(f"no engine {engine_id!r} in the answer (it has {[e.get('engine_id') for e in entries]})")
    ranks = ours[0].get("worker_addr")
    if not isinstance(ranks, dict) or not ranks:
        raise ValueError(f"engine {ours[0].get('engine_id')!r} has no worker_addr")
    try:
        by_rank = {int(r): pp for r, pp in ranks.items()}
    except (TypeError, ValueError):
        raise ValueError(f"worker_addr keys {list(ranks)} are not TP ranks") from None
    if sorted(by_rank) != list(range(len(by_rank))):
        raise ValueError(f"worker_addr names TP ranks {sorted(by_rank)}, not 0..{len(by_rank) - 1}")
    engines = []
    for r in range(len(by_rank)):
        pp = by_rank[r]
        addr = pp.get("0", pp.get(0)) if isinstance(pp, dict) else None
        if not valid_addr(addr):
            raise ValueError(f"TP rank {r} has no hixl engine address for pipeline rank 0: {pp!r:.200}")
        engines.append(addr)
    return engines
