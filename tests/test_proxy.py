"""hixl proxy against stand-ins for vLLM instances (aiohttp servers that answer like a HixlConnector
prefill or decode instance and record what they got): the push and pull flows, round robin, instances
that are down or fail, streaming, /health. vLLM itself behind the proxy: tests/vllm_tier/test_pd_e2e.py."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from hixl.proxy.server import Proxy  # noqa: E402


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Loop:
    """An asyncio loop on a thread, for the fake instances and the proxy."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners = []

    def serve(self, app):
        port = _port()

        async def start():
            r = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
            await r.setup()
            await web.TCPSite(r, "127.0.0.1", port).start()
            self.runners.append(r)
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return f"http://127.0.0.1:{port}"

    def close(self):
        async def stop():
            for r in reversed(self.runners):
                await r.cleanup()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class Fake:
    """A prefill or decode instance as the proxy sees it."""

    def __init__(self, role, engine="10.0.0.1:7000", mode="push", fail=None, delay=0.0):
        self.role, self.engine, self.mode, self.fail, self.delay = role, engine, mode, fail, delay
        self.got, self.aborted = [], 0
        self.app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            self.app.router.add_post(path, self.complete)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)

    async def health(self, request):
        return web.Response(text="ok")

    async def models(self, request):
        return web.json_response({"data": [{"id": "m"}]})

    async def complete(self, request):
        body = await request.json()
        ktp = body.get("kv_transfer_params") or {}
        if ktp.get("hixl_discover"):
            return web.json_response({"choices": [{"text": "."}],
                                      "kv_transfer_params": {"remote_engine": self.engine, "mode": self.mode}})
        self.got.append(body)
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        if self.fail:
            return web.json_response({"error": {"message": self.fail}}, status=500)
        if self.role == "prefill":
            return web.json_response({"choices": [{"text": "P"}], "kv_transfer_params": {
                "do_remote_prefill": True, "transfer_id": ktp["transfer_id"], "remote_engine": self.engine,
                "mode": self.mode, "remote_blocks": [1, 2]}})
        text = "decoded " + str(body.get("prompt") or body.get("messages"))
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": text}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in text.split():
            await resp.write(f"data: {json.dumps({'choices': [{'text': word + ' '}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
def env():
    loop = Loop()
    made = []

    def proxy(prefill, decode, **kw):
        p = Proxy(prefill, decode, **kw)
        url = loop.serve(p.app())
        made.append(p)
        deadline = time.monotonic() + 10  # the prefills' engines discovered (those that are up)
        while time.monotonic() < deadline and not all(i.engine or i.down_until for i in p.prefill.instances):
            time.sleep(0.02)
        return p, url
    yield loop, proxy
    loop.close()


def post(url, body, timeout=30):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def test_push_goes_to_both_at_once_with_one_transfer_id(env):
    loop, proxy = env
    p, d = Fake("prefill", delay=0.3), Fake("decode")
    px, url = proxy([loop.serve(p.app)], [loop.serve(d.app)])
    t0 = time.monotonic()
    status, text = post(url + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 20, "stream": False})
    assert status == 200 and json.loads(text)["choices"][0]["text"] == "decoded hi"
    pb, db = p.got[0], d.got[0]
    tid = pb["kv_transfer_params"]["transfer_id"]
    assert pb["max_tokens"] == 1 and pb["stream"] is False and pb["kv_transfer_params"]["do_remote_decode"]
    assert db["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": tid,
                                        "remote_engine": "10.0.0.1:7000", "mode": "push"}
    assert db["max_tokens"] == 20
    assert time.monotonic() - t0 < 2
    assert px.counts["push"] == 1 and px.counts["sequential"] == 0


def test_pull_runs_the_prefill_first_and_hands_its_params_to_the_decoder(env):
    loop, proxy = env
    p, d = Fake("prefill", mode="pull"), Fake("decode")
    px, url = proxy([loop.serve(p.app)], [loop.serve(d.app)])
    status, _ = post(url + "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "q"}],
                                                    "max_completion_tokens": 9})
    assert status == 200
    assert p.got[0]["max_completion_tokens"] == 1
    ktp = d.got[0]["kv_transfer_params"]
    assert ktp["mode"] == "pull" and ktp["remote_blocks"] == [1, 2]
    assert ktp["transfer_id"] == p.got[0]["kv_transfer_params"]["transfer_id"]
    assert px.counts["sequential"] == 1
    # --mode overrides what the prefill prefers
    px2, url2 = proxy([loop.serve(Fake("prefill", mode="push").app)], [loop.serve(d.app)], mode="pull")
    assert post(url2 + "/v1/completions", {"model": "m", "prompt": "x"})[0] == 200
    assert d.got[-1]["kv_transfer_params"]["mode"] == "pull" and px2.counts["push"] == 0


def test_round_robin_over_the_prefills_and_decoders(env):
    loop, proxy = env
    ps = [Fake("prefill", engine=f"10.0.0.{i}:1") for i in range(2)]
    ds = [Fake("decode") for _ in range(2)]
    _, url = proxy([loop.serve(p.app) for p in ps], [loop.serve(d.app) for d in ds])
    for i in range(4):
        assert post(url + "/v1/completions", {"model": "m", "prompt": f"p{i}"})[0] == 200
    assert [len(p.got) for p in ps] == [2, 2] and [len(d.got) for d in ds] == [2, 2]
    # each decoder was told the engine of the prefill that computed its request
    for d in ds:
        for body in d.got:
            tid = body["kv_transfer_params"]["transfer_id"]
            owner = next(p for p in ps if any(b["kv_transfer_params"]["transfer_id"] == tid for b in p.got))
            assert body["kv_transfer_params"]["remote_engine"] == owner.engine


def test_a_prefill_that_is_down_gives_a_502_naming_it_and_is_skipped(env):
    loop, proxy = env
    good, d = Fake("prefill"), Fake("decode")
    dead = f"http://127.0.0.1:{_port()}"
    px, url = proxy([dead, loop.serve(good.app)], [loop.serve(d.app)])
    with urllib.request.urlopen(url + "/health") as r:
        health = json.load(r)
    assert health["prefill"][dead].startswith("down") and r.status == 200
    codes = [post(url + "/v1/completions", {"model": "m", "prompt": f"p{i}"})[0] for i in range(4)]
    assert codes == [200] * 4  # the dead one is skipped while it is known down
    assert len(good.got) == 4
    px2, url2 = proxy([dead], [loop.serve(d.app)])
    status, text = post(url2 + "/v1/completions", {"model": "m", "prompt": "x"})
    err = json.loads(text)["error"]
    assert status == 502 and dead in err["message"] and err["instance"] == dead
    req = urllib.request.Request(url2 + "/health")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    with e.value:
        assert e.value.code == 503 and dead in e.value.read().decode()


def test_a_failing_prefill_in_push_mode_aborts_the_decoder_request_and_names_the_prefill(env):
    loop, proxy = env
    p, d = Fake("prefill", fail="boom", delay=0.2), Fake("decode", delay=30)
    p_url = loop.serve(p.app)
    px, url = proxy([p_url], [loop.serve(d.app)])
    t0 = time.monotonic()
    status, text = post(url + "/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 502 and p_url in json.loads(text)["error"]["message"] and "boom" in text
    assert time.monotonic() - t0 < 5  # not the decoder's 30 s
    deadline = time.monotonic() + 5
    while d.aborted < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert d.aborted == 1  # the decoder's request was closed: vLLM aborts it, its connector cancels


def test_on_prefill_failure_decode_lets_the_decoder_answer(env):
    loop, proxy = env
    p, d = Fake("prefill", fail="boom"), Fake("decode", delay=0.3)
    _, url = proxy([loop.serve(p.app)], [loop.serve(d.app)], on_prefill_failure="decode")
    status, text = post(url + "/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 200 and "decoded x" in text


def test_the_decoder_stream_is_relayed_as_it_comes(env):
    loop, proxy = env
    p, d = Fake("prefill"), Fake("decode")
    _, url = proxy([loop.serve(p.app)], [loop.serve(d.app)])
    req = urllib.request.Request(url + "/v1/completions", json.dumps({"model": "m", "prompt": "a b c",
                                                                      "stream": True}).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = [x.decode().strip() for x in r if x.strip()]
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]) == "decoded a b c "
    assert "stream" not in p.got[0] or p.got[0]["stream"] is False


def test_bad_requests_are_refused_before_any_instance_is_asked(env):
    loop, proxy = env
    p, d = Fake("prefill"), Fake("decode")
    _, url = proxy([loop.serve(p.app)], [loop.serve(d.app)])
    assert post(url + "/v1/completions", {"model": "m", "prompt": "x", "n": 2})[0] == 400
    req = urllib.request.Request(url + "/v1/completions", b"{not json", {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
    e.value.close()
    assert e.value.code == 400
    assert p.got == [] and d.got == []
    with pytest.raises(ValueError):
        Proxy([], ["http://x:1"])
    with pytest.raises(ValueError):
        Proxy(["http://x:1"], ["http://y:1"], mode="sideways")
