"""The PD router: OpenAI ``/v1/completions`` and ``/v1/chat/completions`` (streaming too) in front of
prefill and decode ``vllm serve`` instances that run :class:`hixl.vllm.HixlConnector`.

Per request, a prefill and a decode instance are picked round-robin (an instance found down is skipped
for a few seconds, then tried again) and a transfer id ties the two halves together:

* **push** (what a prefill instance in push mode announces, or ``--mode push``): the request goes to both at once. The
  decoder allocates its blocks and grants them to the prefill over hixl, so the prefill writes each
  layer's KV into them while it computes the next layers. Known after a first request to that prefill
  (its response names its hixl engine and mode); before that, the two run one after the other and the
  prefill pushes the whole KV when the grant comes (the connector's fallback);
* **pull** (a prefill in pull mode, or ``--mode pull``): the prefill runs first (``max_tokens`` 1); its
  response says where its blocks are, and the decoder reads them.

The proxy learns each prefill's engine(s) (one per TP rank) and mode at start-up (and again after the
instance was down) with a one-token request the connector answers without holding blocks
(``hixl_discover``).

It also fronts prefill instances of other connectors, one request after the other, by the contract
their answers show (:mod:`hixl.vllm.contracts` names them): a prefill answering NIXL's fields alone
(NixlConnector) has them forwarded to the decoder unchanged; a prefill answering none, whose bootstrap
endpoint (``bootstrap_port``, ``--bootstrap-port``) names an engine (MooncakeConnector), has the decoder
told ``transfer_id``, ``remote_bootstrap_addr`` and ``remote_engine_id``.

The decoder's response is relayed as it is (status, headers, the SSE stream). An instance that cannot
be reached, or a prefill that fails or answers something malformed, gives the client an HTTP 502 whose
message names the instance; the decoder's own request is then aborted (its connector cancels the
transfer), unless ``--on-prefill-failure decode`` lets the decoder finish it by its
``kv_load_failure_policy`` ("recompute" answers from the prompt alone). A decoder that breaks off a
stream ends it with an error event (:mod:`hixl.proxy.relay`). A malformed request body gets an HTTP 400
(:mod:`hixl.proxy.messages`); every error body is OpenAI's ``{"error": {...}}``.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlparse

import aiohttp
from aiohttp import web

from .messages import (BodyError, bootstrap_engine_id, check_request, engine_and_mode, engines_of, error_doc,
                       first_model, nixl_only, parse_object)
from .relay import UPSTREAM_ERRORS, Relay

_log = logging.getLogger("hixl.proxy")
DOWN_FOR_S = 5.0  # an instance that could not be reached is skipped this long


@dataclass
class Instance:
    url: str
    role: str
    down_until: float = 0.0
    last_error: str = ""
    engine: Optional[str] = None   # a prefill's hixl engine (of its TP rank 0), from its responses
    mode: Optional[str] = None     # a prefill's transfer mode, from its responses
    engines: List[str] = field(default_factory=list)  # a prefill's hixl engines by TP rank
    contract: str = "hixl"         # hixl | nixl (NIXL's params only) | mooncake (a bootstrap endpoint, no params)
    bootstrap: Optional[str] = None  # mooncake: the prefill's bootstrap address and engine id
    engine_id: Optional[str] = None
    served: int = 0
    failed: int = 0
    discovery_errors: int = 0      # a prefill's answers to discovery that were no use (it was up)
    discovery_error: str = ""      # the last of them

    def mark_down(self, why: str) -> None:
        self.down_until, self.last_error = time.monotonic() + DOWN_FOR_S, why
        self.engine, self.engines, self.contract = None, [], "hixl"  # a restarted instance: learn it again
        self.failed += 1
        _log.warning("hixl proxy: %s instance %s is down: %s", self.role, self.url, why)


@dataclass
class Pool:
    role: str
    instances: List[Instance]
    _rr: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._rr = itertools.cycle(range(len(self.instances)))

    def pick(self) -> Instance:
        """The next instance not known to be down; when all are, the one that has been down longest
        (a request is a better probe than an error without trying)."""
        now = time.monotonic()
        for _ in range(len(self.instances)):
            inst = self.instances[next(self._rr)]
            if inst.down_until <= now:
                return inst
        return min(self.instances, key=lambda i: i.down_until)


class InstanceError(Exception):
    def __init__(self, inst: Instance, why: str, status: int = 502):
        super().__init__(f"{inst.role} instance {inst.url} {why}")
        self.inst, self.status = inst, status


def _error(status: int, message: str, kind: str = "proxy_error", instance: Optional[str] = None) -> web.Response:
    return web.json_response(error_doc(status, message, kind, instance), status=status)


def _text(raw: bytes) -> str:
    """The start of a backend's answer, for an error message."""
    return raw[:500].decode("utf-8", "replace")


class Proxy:
    def __init__(self, prefill: List[str], decode: List[str], *, timeout_s: float = 600.0,
                 on_prefill_failure: str = "error", mode: str = "auto", discover_every_s: float = 2.0,
                 bootstrap_port: int = 0):
        if not prefill or not decode:
            raise ValueError("hixl proxy needs at least one prefill and one decode instance")
        if on_prefill_failure not in ("error", "decode"):
            raise ValueError(f"on_prefill_failure must be 'error' or 'decode', not {on_prefill_failure!r}")
        if mode not in ("auto", "push", "pull"):
            raise ValueError(f"mode must be auto, push or pull, not {mode!r}")
        self.mode = mode
        self.prefill = Pool("prefill", [Instance(u.rstrip("/"), "prefill") for u in prefill])
        self.decode = Pool("decode", [Instance(u.rstrip("/"), "decode") for u in decode])
        self.timeout_s, self.on_prefill_failure = timeout_s, on_prefill_failure
        self.discover_every_s, self.bootstrap_port = discover_every_s, bootstrap_port
        self._session: Optional[aiohttp.ClientSession] = None
        self._discovery: Optional[asyncio.Future] = None
        # sequential: pull, or a first push; errors: requests that failed; discovery_errors: useless answers
        self.counts = {"requests": 0, "push": 0, "sequential": 0, "errors": 0, "discovery_errors": 0}

    # -- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2 ** 20)
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/proxy/status", self.status)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=5),
            connector=aiohttp.TCPConnector(limit=0, force_close=False))
        self._discovery = asyncio.ensure_future(self._discover_loop())

    async def _discover_loop(self) -> None:
        """Learns each prefill's hixl engine and mode (a one-token request with ``hixl_discover``, which
        the connector answers without holding any block), so that push requests can go to both
        instances at once from the first one; again whenever an instance was down. An instance that
        answers something of no use is logged and counted, and asked again in the next round."""
        while True:
            for inst in self.prefill.instances:
                if (inst.engine is None and inst.contract == "hixl") or inst.down_until:
                    await self._discover_one(inst)
            await asyncio.sleep(self.discover_every_s)

    async def _discover_one(self, inst: Instance) -> None:
        """One prefill asked once; what went wrong is logged (when it changed) and counted, never raised."""
        failed, bug = inst.failed, None
        try:
            await self._discover(inst)
            inst.discovery_error = ""
            return
        except asyncio.CancelledError:
            raise
        except InstanceError as e:
            why = str(e)
            if inst.failed != failed:  # it could not be reached: mark_down logged and counted that
                _log.info("hixl proxy: %s", why)
                return
        except Exception as e:  # noqa: BLE001 -- the loop outlives any answer; the traceback names the bug
            why, bug = f"{inst.role} instance {inst.url}: discovery failed ({type(e).__name__}: {e})", e
        inst.discovery_errors += 1
        self.counts["discovery_errors"] += 1
        if why != inst.discovery_error:
            _log.warning("hixl proxy: %s; asking again every %g s", why, self.discover_every_s, exc_info=bug)
        inst.discovery_error = why

    async def _discover(self, inst: Instance) -> None:
        try:
            async with self._session.get(inst.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                raw = await r.read()
        except UPSTREAM_ERRORS as e:
            inst.mark_down(f"{type(e).__name__}: {e}")
            raise InstanceError(inst, f"cannot be asked for its hixl engine ({type(e).__name__}: {e})") from None
        if r.status != 200:
            raise InstanceError(inst, f"answered HTTP {r.status} on /v1/models: {_text(raw)}")
        try:
            model = first_model(parse_object(raw, "its /v1/models answer"))
        except BodyError as e:
            raise InstanceError(inst, f"answered /v1/models with no model to use: {e}") from None
        out = await self._post_json(inst, "/v1/completions", {
            "model": model, "prompt": ".", "max_tokens": 1, "kv_transfer_params": {"hixl_discover": True}})
        params = out.get("kv_transfer_params")
        try:
            engine, mode = engine_and_mode(params)
        except BodyError as e:
            if params is None and self.bootstrap_port and await self._discover_bootstrap(inst):
                return
            raise InstanceError(inst, f"does not run HixlConnector: {e}") from None
        engines = engines_of(params)
        if (inst.engines, inst.mode) != (engines, mode):
            _log.info("hixl proxy: prefill %s: hixl engine(s) %s, %s mode", inst.url, ", ".join(engines), mode)
        inst.engine, inst.engines, inst.mode, inst.contract, inst.down_until = engine, engines, mode, "hixl", 0.0

    async def _discover_bootstrap(self, inst: Instance) -> bool:
        """A prefill that answers no kv_transfer_params may serve Mooncake's contract: its bootstrap
        endpoint (``GET http://HOST:bootstrap_port/query``) names its engine id. True when it does."""
        host = urlparse(inst.url).hostname or ""
        addr = f"http://[{host}]:{self.bootstrap_port}" if ":" in host else f"http://{host}:{self.bootstrap_port}"
        try:
            async with self._session.get(addr + "/query", timeout=aiohttp.ClientTimeout(total=5)) as r:
                raw = await r.read()
            if r.status != 200:
                return False
            engine_id = bootstrap_engine_id(parse_object(raw, f"the /query answer of {addr}"))
        except (BodyError, *UPSTREAM_ERRORS):
            return False
        if "@" in engine_id:  # a HixlConnector prefill's endpoint (it answers discovery itself): not this one
            return False
        if (inst.bootstrap, inst.engine_id) != (addr, engine_id):
            _log.info("hixl proxy: prefill %s: Mooncake's contract, bootstrap %s, engine %s (one after the "
                      "other: prefill, then decode)", inst.url, addr, engine_id)
        inst.contract, inst.bootstrap, inst.engine_id, inst.down_until = "mooncake", addr, engine_id, 0.0
        return True

    async def _stop(self, app: web.Application) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        if self._session is not None:
            await self._session.close()

    # -- plumbing --------------------------------------------------------------------------------
    async def _post_json(self, inst: Instance, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        """POST to an instance and read a JSON object back; InstanceError when it cannot be reached,
        answers with an error or with anything but a JSON object."""
        try:
            async with self._session.post(inst.url + path, json=body) as r:
                raw = await r.read()
        except UPSTREAM_ERRORS as e:
            inst.mark_down(f"{type(e).__name__}: {e}")
            raise InstanceError(inst, f"is down ({type(e).__name__}: {e})") from None
        if r.status != 200:
            raise InstanceError(inst, f"answered HTTP {r.status}: {_text(raw)}", status=502)
        try:
            return parse_object(raw, f"its answer on {path}")
        except BodyError as e:
            raise InstanceError(inst, f"answered malformed JSON: {e}") from None

    @staticmethod
    def _prefill_body(body: Dict[str, Any], tid: str) -> Dict[str, Any]:
        b = dict(body)  # only top-level keys change; the rest is shared, never written
        b["max_tokens"] = 1
        if "max_completion_tokens" in b:
            b["max_completion_tokens"] = 1
        b["stream"] = False
        b.pop("stream_options", None)
        b["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": tid}
        return b

    async def _prefill(self, inst: Instance, path: str, body: Dict[str, Any], tid: str) -> Tuple[Dict[str, Any], bool]:
        """The decoder's kv_transfer_params from the prefill's answer, and whether they are hixl's (the
        proxy may set their mode); NIXL's alone (NixlConnector) and Mooncake's go as the contract says."""
        out = await self._post_json(inst, path, self._prefill_body(body, tid))
        params = out.get("kv_transfer_params")
        try:
            inst.engine, inst.mode = engine_and_mode(params, tid)
            inst.engines, inst.contract = engines_of(params), "hixl"
        except BodyError as e:
            if inst.contract == "mooncake" and params is None:
                inst.served += 1
                return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                        "remote_bootstrap_addr": inst.bootstrap, "remote_engine_id": inst.engine_id}, False
            if nixl_only(params):
                inst.contract = "nixl"
                inst.served += 1
                return dict(params), False
            raise InstanceError(inst, f"returned no hixl kv_transfer_params for transfer {tid} (is it running "
                                      f"HixlConnector with kv_role kv_producer or kv_both?): {e}") from None
        inst.served += 1
        return dict(params), True

    async def _relay(self, request: web.Request, inst: Instance, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        """The decoder's response, as it comes (SSE included); never raises once the headers went out."""
        relay = Relay(request, resp, f"{inst.role} instance {inst.url}", inst.url)
        out = await relay.run()
        if relay.broken is not None:
            inst.mark_down(f"its stream broke: {relay.broken}")
            self.counts["errors"] += 1
        elif resp.status == 200 and not relay.client_gone:
            inst.served += 1
        return out

    # -- the routes -----------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.counts["requests"] += 1
        try:
            body = parse_object(await request.read(), "the request body")
            check_request(body)
        except BodyError as e:
            return _error(400, str(e), "invalid_request_error")
        path = request.path
        tid = uuid.uuid4().hex
        p, d = self.prefill.pick(), self.decode.pick()
        mode = self.mode if self.mode != "auto" else (p.mode or "push")
        try:
            if p.engine and mode == "push":
                self.counts["push"] += 1
                return await self._push(request, path, body, tid, p, d)
            self.counts["sequential"] += 1
            params, ours = await self._prefill(p, path, body, tid)
            if ours:
                params["mode"] = mode
            return await self._decode(request, path, body, params, d)
        except InstanceError as e:
            self.counts["errors"] += 1
            return _error(e.status, str(e), "upstream_error", e.inst.url)

    async def _decode(self, request: web.Request, path: str, body: Dict[str, Any], params: Dict[str, Any],
                      d: Instance) -> web.StreamResponse:
        b = dict(body)
        b["kv_transfer_params"] = params
        try:
            async with self._session.post(d.url + path, json=b) as resp:
                return await self._relay(request, d, resp)
        except UPSTREAM_ERRORS as e:
            d.mark_down(f"{type(e).__name__}: {e}")
            raise InstanceError(d, f"is down ({type(e).__name__}: {e})") from None

    async def _push(self, request: web.Request, path: str, body: Dict[str, Any], tid: str, p: Instance,
                    d: Instance) -> web.StreamResponse:
        """Both at once: the decoder's grant reaches the prefill before (or while) it computes."""
        b = dict(body)
        b["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": tid, "remote_engine": p.engine,
                                   "mode": "push"}
        if len(p.engines) > 1:  # a TP prefill: each rank's engine
            b["kv_transfer_params"]["remote_engines"] = list(p.engines)
        p_task = asyncio.ensure_future(self._prefill(p, path, body, tid))
        d_task = asyncio.ensure_future(self._session.post(d.url + path, json=b))
        resp: Optional[aiohttp.ClientResponse] = None
        try:
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and p_task.exception() is not None and self.on_prefill_failure == "error":
                raise p_task.exception()
            try:
                resp = await d_task
            except UPSTREAM_ERRORS as e:
                d.mark_down(f"{type(e).__name__}: {e}")
                raise InstanceError(d, f"is down ({type(e).__name__}: {e})") from None
            if resp.status != 200:
                # the decoder failed: when the prefill failed too, that is the cause to name
                if not p_task.done():
                    await asyncio.wait({p_task}, timeout=2.0)
                if p_task.done() and p_task.exception() is not None:
                    raise p_task.exception()
            return await self._relay(request, d, resp)
        finally:
            if resp is not None:
                resp.release()
            elif not d_task.done():
                d_task.cancel()  # closes the connection: vLLM aborts the decoder's request
            elif not d_task.cancelled() and d_task.exception() is None:
                d_task.result().close()
            if not p_task.done():
                p_task.add_done_callback(self._prefill_done_late)

    @staticmethod
    def _prefill_done_late(t: "asyncio.Future") -> None:
        if not t.cancelled() and t.exception() is not None:
            _log.warning("hixl proxy: %s", t.exception())

    async def _probe(self, inst: Instance) -> Tuple[str, bool]:
        try:
            async with self._session.get(inst.url + "/health", timeout=aiohttp.ClientTimeout(total=3)) as r:
                if r.status == 200:
                    if inst.down_until > time.monotonic():
                        inst.down_until = 0.0
                    return "ok", True
                return f"HTTP {r.status}", False
        except UPSTREAM_ERRORS as e:
            inst.mark_down(f"{type(e).__name__}: {e}")
            return f"down: {type(e).__name__}: {e}", False

    async def health(self, request: web.Request) -> web.Response:
        """200 when at least one prefill and one decode instance answer /health; 503 otherwise. The body
        names each instance and its state."""
        pools = (self.prefill, self.decode)
        results = await asyncio.gather(*(self._probe(i) for pool in pools for i in pool.instances))
        it = iter(results)
        doc: Dict[str, Dict[str, str]] = {}
        ok = True
        for pool in pools:
            states = {i.url: next(it) for i in pool.instances}
            doc[pool.role] = {u: s for u, (s, _) in states.items()}
            ok = ok and any(up for _, up in states.values())
        return web.json_response(doc, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.StreamResponse:
        d = self.decode.pick()
        try:
            async with self._session.get(d.url + "/v1/models") as resp:
                return await self._relay(request, d, resp)
        except UPSTREAM_ERRORS as e:
            d.mark_down(f"{type(e).__name__}: {e}")
            return _error(502, f"decode instance {d.url} is down ({type(e).__name__}: {e})", "upstream_error", d.url)

    async def status(self, request: web.Request) -> web.Response:
        """What the proxy knows: each instance's engine, mode, requests served and failures."""
        def row(i: Instance) -> Dict[str, Any]:
            return {"url": i.url, "engine": i.engine, "engines": i.engines, "contract": i.contract, "mode": i.mode,
                    "served": i.served, "failed": i.failed,
                    "down": i.down_until > time.monotonic(), "last_error": i.last_error,
                    "discovery_errors": i.discovery_errors, "discovery_error": i.discovery_error}
        return web.json_response({"counts": self.counts, "prefill": [row(i) for i in self.prefill.instances],
                                  "decode": [row(i) for i in self.decode.instances]})
