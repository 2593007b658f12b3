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

The proxy learns each prefill's engine and mode at start-up (and again after the instance was down)
with a one-token request the connector answers without holding blocks (``hixl_discover``).

The decoder's response is relayed as it is (status, headers, the SSE stream). An instance that cannot
be reached, or a prefill that fails, gives the client an HTTP 502 whose message names the instance; the
decoder's own request is then aborted (its connector cancels the transfer), unless
``--on-prefill-failure decode`` lets the decoder finish it by its ``kv_load_failure_policy``
("recompute" answers from the prompt alone).
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import aiohttp
from aiohttp import web

_log = logging.getLogger("hixl.proxy")
DOWN_FOR_S = 5.0  # an instance that could not be reached is skipped this long


@dataclass
class Instance:
    url: str
    role: str
    down_until: float = 0.0
    last_error: str = ""
    engine: Optional[str] = None   # a prefill's hixl engine, from its responses
    mode: Optional[str] = None     # a prefill's transfer mode, from its responses
    served: int = 0
    failed: int = 0

    def mark_down(self, why: str) -> None:
        self.down_until, self.last_error = time.monotonic() + DOWN_FOR_S, why
        self.engine = None  # a restarted instance has another engine: learn it again
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
    body: Dict[str, Any] = {"error": {"message": message, "type": kind, "code": status}}
    if instance:
        body["error"]["instance"] = instance
    return web.json_response(body, status=status)


class Proxy:
    def __init__(self, prefill: List[str], decode: List[str], *, timeout_s: float = 600.0,
                 on_prefill_failure: str = "error", mode: str = "auto"):
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
        self._session: Optional[aiohttp.ClientSession] = None
        self._discovery: Optional[asyncio.Future] = None
        self.counts = {"requests": 0, "push": 0, "sequential": 0, "errors": 0}  # sequential: pull, or a first push

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
        instances at once from the first one; again whenever an instance was down."""
        while True:
            for inst in self.prefill.instances:
                if inst.engine is None or inst.down_until:
                    try:
                        await self._discover(inst)
                    except InstanceError as e:
                        _log.info("hixl proxy: %s", e)
            await asyncio.sleep(2.0)

    async def _discover(self, inst: Instance) -> None:
        try:
            async with self._session.get(inst.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                models = (await r.json()).get("data", [])
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError, ValueError) as e:
            inst.mark_down(f"{type(e).__name__}: {e}")
            raise InstanceError(inst, f"cannot be asked for its hixl engine ({type(e).__name__}: {e})") from None
        if not models:
            raise InstanceError(inst, "serves no model")
        out = await self._post_json(inst, "/v1/completions", {
            "model": models[0]["id"], "prompt": ".", "max_tokens": 1, "kv_transfer_params": {"hixl_discover": True}})
        params = out.get("kv_transfer_params") or {}
        if not params.get("remote_engine"):
            raise InstanceError(inst, f"does not run HixlConnector (no hixl engine in {params!r})")
        if (inst.engine, inst.mode) != (params["remote_engine"], params.get("mode", "push")):
            _log.info("hixl proxy: prefill %s: hixl engine %s, %s mode", inst.url, params["remote_engine"],
                      params.get("mode", "push"))
        inst.engine, inst.mode, inst.down_until = params["remote_engine"], params.get("mode", "push"), 0.0

    async def _stop(self, app: web.Application) -> None:
        if self._discovery is not None:
            self._discovery.cancel()
        if self._session is not None:
            await self._session.close()

    # -- plumbing --------------------------------------------------------------------------------
    async def _post_json(self, inst: Instance, path: str, body: Dict[str, Any]) -> Dict[str, Any]:
        """POST to an instance and read a JSON answer; InstanceError when it cannot be reached or
        answers with an error."""
        try:
            async with self._session.post(inst.url + path, json=body) as r:
                text = await r.text()
                if r.status != 200:
                    raise InstanceError(inst, f"answered HTTP {r.status}: {text[:500]}", status=502)
                return json.loads(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            inst.mark_down(f"{type(e).__name__}: {e}")
            raise InstanceError(inst, f"is down ({type(e).__name__}: {e})") from None
        except ValueError as e:
            raise InstanceError(inst, f"answered no JSON ({e})") from None

    @staticmethod
    def _prefill_body(body: Dict[str, Any], tid: str) -> Dict[str, Any]:
        b = copy.deepcopy(body)
        b["max_tokens"] = 1
        if "max_completion_tokens" in b:
            b["max_completion_tokens"] = 1
        b["stream"] = False
        b.pop("stream_options", None)
        b["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": tid}
        return b

    async def _prefill(self, inst: Instance, path: str, body: Dict[str, Any], tid: str) -> Dict[str, Any]:
        out = await self._post_json(inst, path, self._prefill_body(body, tid))
        params = out.get("kv_transfer_params")
        if not isinstance(params, dict) or params.get("transfer_id") != tid or not params.get("remote_engine"):
            raise InstanceError(inst, f"returned no hixl kv_transfer_params for transfer {tid} (is it running "
                                      f"HixlConnector with kv_role kv_producer or kv_both?): {params!r}")
        inst.engine, inst.mode = params["remote_engine"], params.get("mode", "push")
        inst.served += 1
        return params

    async def _relay(self, request: web.Request, inst: Instance, resp: aiohttp.ClientResponse) -> web.StreamResponse:
        """The decoder's response, as it comes (SSE included)."""
        out = web.StreamResponse(status=resp.status)
        for h in ("Content-Type", "Cache-Control"):
            if h in resp.headers:
                out.headers[h] = resp.headers[h]
        await out.prepare(request)
        chunks = resp.content.iter_any()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
                inst.mark_down(f"its stream broke: {e}")  # the client sees a truncated stream
                raise
            try:
                await out.write(chunk)
            except (ConnectionError, RuntimeError):  # the client went away: stop (vLLM aborts the request)
                resp.close()
                return out
        await out.write_eof()
        if resp.status == 200:
            inst.served += 1
        return out

    # -- the routes -----------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.counts["requests"] += 1
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "the request body is not a JSON object", "invalid_request_error")
        if body.get("n", 1) not in (1, None) or body.get("best_of", 1) not in (1, None):
            return _error(400, "n > 1 and best_of > 1 are not supported through the PD proxy",
                          "invalid_request_error")
        path = request.path
        tid = uuid.uuid4().hex
        p, d = self.prefill.pick(), self.decode.pick()
        mode = self.mode if self.mode != "auto" else (p.mode or "push")
        try:
            if p.engine and mode == "push":
                self.counts["push"] += 1
                return await self._push(request, path, body, tid, p, d)
            self.counts["sequential"] += 1
            params = await self._prefill(p, path, body, tid)
            params["mode"] = mode
            return await self._decode(request, path, body, params, d)
        except InstanceError as e:
            self.counts["errors"] += 1
            return _error(e.status, str(e), "upstream_error", e.inst.url)

    async def _decode(self, request: web.Request, path: str, body: Dict[str, Any], params: Dict[str, Any],
                      d: Instance) -> web.StreamResponse:
        b = copy.deepcopy(body)
        b["kv_transfer_params"] = params
        try:
            async with self._session.post(d.url + path, json=b) as resp:
                return await self._relay(request, d, resp)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            d.mark_down(f"{type(e).__name__}: {e}")
            raise InstanceError(d, f"is down ({type(e).__name__}: {e})") from None

    async def _push(self, request: web.Request, path: str, body: Dict[str, Any], tid: str, p: Instance,
                    d: Instance) -> web.StreamResponse:
        """Both at once: the decoder's grant reaches the prefill before (or while) it computes."""
        b = copy.deepcopy(body)
        b["kv_transfer_params"] = {"do_remote_prefill": True, "transfer_id": tid, "remote_engine": p.engine,
                                   "mode": "push"}
        p_task = asyncio.ensure_future(self._prefill(p, path, body, tid))
        d_task = asyncio.ensure_future(self._session.post(d.url + path, json=b))
        resp: Optional[aiohttp.ClientResponse] = None
        try:
            done, _ = await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and p_task.exception() is not None and self.on_prefill_failure == "error":
                raise p_task.exception()
            try:
                resp = await d_task
            except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
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
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
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
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            d.mark_down(f"{type(e).__name__}: {e}")
            return _error(502, f"decode instance {d.url} is down ({type(e).__name__}: {e})", "upstream_error", d.url)

    async def status(self, request: web.Request) -> web.Response:
        """What the proxy knows: each instance's engine, mode, requests served and failures."""
        def row(i: Instance) -> Dict[str, Any]:
            return {"url": i.url, "engine": i.engine, "mode": i.mode, "served": i.served, "failed": i.failed,
                    "down": i.down_until > time.monotonic(), "last_error": i.last_error}
        return web.json_response({"counts": self.counts, "prefill": [row(i) for i in self.prefill.instances],
                                  "decode": [row(i) for i in self.decode.instances]})
