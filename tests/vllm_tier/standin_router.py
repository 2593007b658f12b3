"""A router stand-in for the vLLM tier (aiohttp, in a thread of the test process): the two-hop flow of
vLLM's toy proxies (prefill with ``max_tokens: 1`` and ``do_remote_decode``, then the decoder with
params built from the prefill's answer), with a ``transform`` that decides what of the prefill's
``kv_transfer_params`` reaches the decoder:

- :func:`nixl_fields_only`: what vLLM's ``toy_push_proxy_server.py`` sends: NIXL's engine coordinates
  (``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size``), no block ids,
  nothing else;
- :func:`http_host_for_remote_host`: the same, with ``remote_host`` replaced by the prefill's HTTP host name
  (as routers that know only the instances' URLs do).
"""
from __future__ import annotations

import asyncio
import threading
import urllib.parse
import uuid
from typing import Any, Callable, Dict, Optional

import aiohttp
from aiohttp import web

from hixl_tools._net import free_port

Transform = Callable[[Dict[str, Any], str], Dict[str, Any]]
NIXL_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


def nixl_fields_only(params: Dict[str, Any], prefill_url: str) -> Dict[str, Any]:
    out = {"do_remote_prefill": True, "do_remote_decode": False}
    out.update({k: params.get(k) for k in NIXL_FIELDS})
    return out


def http_host_for_remote_host(params: Dict[str, Any], prefill_url: str) -> Dict[str, Any]:
    out = nixl_fields_only(params, prefill_url)
    out["remote_host"] = urllib.parse.urlsplit(prefill_url).hostname
    return out


class StandinRouter:
    def __init__(self, prefill_url: str, decode_url: str, transform: Transform, name: str = "standin"):
        self.prefill_url, self.decode_url, self.transform, self.name = prefill_url, decode_url, transform, name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.seen: list = []  # (prefill's params, decoder's params) per request
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"standin-{name}", daemon=True)

    def start(self) -> "StandinRouter":
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError(f"router stand-in {self.name} did not start on port {self.port}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        finally:  # closed here, not by the garbage collector in some later test (a ResourceWarning there)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()
        await self._http.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        path = request.path
        headers = {"X-Request-Id": uuid.uuid4().hex}
        first = dict(body, stream=False, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        first.pop("stream_options", None)
        async with self._http.post(self.prefill_url + path, json=first, headers=headers) as r:
            if r.status != 200:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
            answer = await r.json()
        params = answer.get("kv_transfer_params") or {}
        second = dict(body, kv_transfer_params=self.transform(params, self.prefill_url))
        self.seen.append((params, second["kv_transfer_params"]))
        async with self._http.post(self.decode_url + path, json=second, headers=headers) as r:
            out = web.StreamResponse(status=r.status, headers={"content-type": r.headers.get("content-type",
                                                                                                 "application/json")})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out
