"""The JSON the proxy reads and writes: a client's request body, a backend's answer (a prefill's
``kv_transfer_params``, ``/v1/models``), and the OpenAI-style error document it answers with.

Every reader raises :class:`BodyError` saying in words what is wrong; the server turns that into an HTTP
400 (a client's body) or a 502 naming the instance (a backend's answer). A document may nest at most
:data:`MAX_DEPTH` levels: deeper ones are refused before anything walks them recursively (``copy``,
``json.dumps``).
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

MAX_DEPTH = 128  # levels of nested objects and arrays in a document the proxy accepts
MODES = ("push", "pull")


class BodyError(ValueError):
    """A JSON document that is not what the proxy needs; the message says why."""


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    for t, name in ((dict, "object"), (list, "array"), (str, "string"), (int, "number"), (float, "number")):
        if isinstance(v, t):
            return name
    return "null" if v is None else type(v).__name__


def _deeper_than(doc: Any, limit: int) -> bool:
    """Whether doc nests objects and arrays more than limit levels (without recursion)."""
    stack = [(doc, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_object(raw: bytes, what: str) -> Dict[str, Any]:
    """raw (bytes of JSON) as a JSON object; BodyError naming `what` when it is not JSON, nests more
    than MAX_DEPTH levels or is not an object."""
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise BodyError(f"{what} nests more than {MAX_DEPTH} levels") from None
    except ValueError as e:  # UnicodeDecodeError included
        raise BodyError(f"{what} is not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise BodyError(f"{what} is a JSON {_kind(doc)}, not an object")
    if _deeper_than(doc, MAX_DEPTH):
        raise BodyError(f"{what} nests more than {MAX_DEPTH} levels")
    return doc


def check_request(body: Dict[str, Any]) -> None:
    """The fields of a client's request that the proxy itself reads: ``n`` and ``best_of``, each an
    integer (or null) and 1, since one request is one prefill and one decode."""
    for key in ("n", "best_of"):
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise BodyError(f"'{key}' must be an integer, not a JSON {_kind(v)}")
    if body.get("n", 1) not in (1, None) or body.get("best_of", 1) not in (1, None):
        raise BodyError("n > 1 and best_of > 1 are not supported through the PD proxy")


def engine_and_mode(params: Any, tid: Optional[str] = None) -> Tuple[str, str]:
    """A prefill's hixl engine and transfer mode from the ``kv_transfer_params`` it answered (for a
    request when tid is given, else for discovery); BodyError when they are missing or ill-typed."""
    if not isinstance(params, dict):
        raise BodyError(f"kv_transfer_params is a JSON {_kind(params)}, not an object: {params!r:.300}")
    if tid is not None and params.get("transfer_id") != tid:
        raise BodyError(f"kv_transfer_params name transfer {params.get('transfer_id')!r:.100}, not {tid}")
    engine, mode = params.get("remote_engine"), params.get("mode")
    if not isinstance(engine, str) or not engine:
        raise BodyError(f"kv_transfer_params hold no hixl engine (remote_engine {engine!r:.100})")
    if mode is not None and mode not in MODES:
        raise BodyError(f"kv_transfer_params name mode {mode!r:.100}, not push or pull")
    return engine, mode or "push"


def engines_of(params: Dict[str, Any]) -> List[str]:
    """A hixl prefill's engines by TP rank (``remote_engines``; ``[remote_engine]`` when it names none)."""
    many = params.get("remote_engines")
    if isinstance(many, list) and many and all(isinstance(e, str) and e for e in many):
        return list(many)
    return [params["remote_engine"]]


def nixl_only(params: Any) -> bool:
    """Whether a prefill's ``kv_transfer_params`` are NIXL's alone (NixlConnector's answer: no hixl
    engine, a ``remote_engine_id``): a decoder of the same connector takes them as they are."""
    return isinstance(params, dict) and "remote_engine" not in params and "remote_engines" not in params \
        and isinstance(params.get("remote_engine_id"), str) and bool(params.get("do_remote_prefill"))


def bootstrap_engine_id(doc: Dict[str, Any]) -> str:
    """The engine id of a bootstrap endpoint's ``/query`` answer (``{dp_rank: {engine_id, worker_addr}}``,
    vLLM's ``MooncakeBootstrapServer``); BodyError when it names none."""
    for entry in doc.values():
        if isinstance(entry, dict) and isinstance(entry.get("engine_id"), str) and entry.get("worker_addr"):
            return entry["engine_id"]
    raise BodyError(f"it names no engine with workers: {json.dumps(doc)[:300]}")


def first_model(doc: Dict[str, Any]) -> str:
    """The first model id of a ``/v1/models`` answer; BodyError when there is none or it is ill-typed."""
    data = doc.get("data")
    if not isinstance(data, list):
        raise BodyError(f"its 'data' is a JSON {_kind(data)}, not an array")
    if not data:
        raise BodyError("it serves no model")
    first = data[0]
    if not isinstance(first, dict) or not isinstance(first.get("id"), str):
        raise BodyError(f"its first model has no string 'id': {first!r:.300}")
    return first["id"]


def error_doc(status: int, message: str, kind: str, instance: Optional[str] = None) -> Dict[str, Any]:
    """The error document OpenAI-compatible servers (vLLM's among them) answer with, and send as the
    last event of a stream that fails."""
    err: Dict[str, Any] = {"message": message, "type": kind, "param": None, "code": status}
    if instance:
        err["instance"] = instance
    return {"error": err}
