"""hixl proxy against stand-ins for vLLM instances (aiohttp servers that answer like a HixlConnector
prefill or decode instance and record what they got): the push and pull flows, round robin, instances
that are down or fail, streaming, /health; malformed bodies and answers, a decoder that breaks off its
stream (read as raw bytes), discovery that outlives what it is told. vLLM itself behind the proxy:
tests/vllm_tier/test_pd_e2e.py."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
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

    def __init__(self, role, engine="10.0.0.1:7000", mode="push", fail=None, delay=0.0, answer=None,
                 break_after=None):
        self.role, self.engine, self.mode, self.fail, self.delay = role, engine, mode, fail, delay
        self.answer = answer            # a prefill's answer to a request: kv_transfer_params -> raw bytes
        self.break_after = break_after  # a decoder that closes its connection after this many events
        self.models_answers, self.discover_answers = [], []  # raw answers given first, one per ask
        self.engines = None             # a TP prefill's engines (remote_engines), else one engine
        self.discover_params = None     # kv_transfer_params answered to discovery (a callable), else hixl's
        self.discovered = 0
        self.outage = False             # every connection closed without an answer
        self.got, self.aborted = [], 0
        self.app = web.Application()
        for path in ("/v1/completions", "/v1/chat/completions"):
            self.app.router.add_post(path, self.complete)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/models", self.models)

    @staticmethod
    def _raw(answer):
        status, raw = answer if isinstance(answer, tuple) else (200, answer)
        return web.Response(body=raw, status=status, content_type="application/json")

    @staticmethod
    def _drop(request):
        request.transport.close()
        return web.Response(text="never sent")

    async def health(self, request):
        return self._drop(request) if self.outage else web.Response(text="ok")

    async def models(self, request):
        if self.outage:
            return self._drop(request)
        if self.models_answers:
            return self._raw(self.models_answers.pop(0))
        return web.json_response({"data": [{"id": "m"}]})

    async def complete(self, request):
        if self.outage:
            return self._drop(request)
        body = await request.json()
        ktp = body.get("kv_transfer_params") or {}
        if ktp.get("hixl_discover"):
            self.discovered += 1
            if self.discover_answers:
                return self._raw(self.discover_answers.pop(0))
            if self.discover_params is not None:
                return web.json_response({"choices": [{"text": "."}], "kv_transfer_params": self.discover_params()})
            found = {"remote_engine": self.engine, "mode": self.mode}
            if self.engines:
                found["remote_engines"] = self.engines
            return web.json_response({"choices": [{"text": "."}], "kv_transfer_params": found})
        self.got.append(body)
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        if self.fail:
            return web.json_response({"error": {"message": self.fail}}, status=500)
        if self.role == "prefill" and self.answer is not None:
            return self._raw(self.answer(ktp))
        if self.role == "prefill":
            return web.json_response({"choices": [{"text": "P"}], "kv_transfer_params": {
                "do_remote_prefill": True, "transfer_id": ktp["transfer_id"], "remote_engine": self.engine,
                "mode": self.mode, "remote_blocks": [1, 2]}})
        text = "decoded " + str(body.get("prompt") or body.get("messages"))
        if self.break_after is not None:
            return await self._break_off(request, text, body.get("stream"))
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": text}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in text.split():
            await resp.write(f"data: {json.dumps({'choices': [{'text': word + ' '}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _break_off(self, request, text, stream):
        """break_after whole SSE events (or a JSON body's start), then half of one, then the connection
        closed: the chunked body never ends."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream" if stream else "application/json"})
        await resp.prepare(request)
        if stream:
            for word in text.split()[:self.break_after]:
                await resp.write(f"data: {json.dumps({'choices': [{'text': word + ' '}]})}\n\n".encode())
            await resp.write(b'data: {"choices": [{"te')
        else:
            await resp.write(b'{"choices": [{"text": "' + text.encode())
        await asyncio.sleep(0.1)  # the proxy has them before the connection goes
        request.transport.close()
        return resp


@pytest.fixture
def env():
    loop = Loop()
    made = []

    def proxy(prefill, decode, **kw):
        p = Proxy(prefill, decode, **kw)
        url = loop.serve(p.app())
        made.append(p)
        deadline = time.monotonic() + 10  # the prefills' engines discovered (those that are up and answer)
        while time.monotonic() < deadline and not all(i.engine or i.down_until or i.contract != "hixl" or
                                                      i.discovery_errors for i in p.prefill.instances):
            time.sleep(0.02)
        return p, url
    yield loop, proxy
    loop.close()


def post_raw(url, raw, timeout=30):
    """POSTs the bytes ``raw`` as a JSON body; (status, text) whatever the status."""
    req = urllib.request.Request(url, raw, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def post(url, body, timeout=30):
    return post_raw(url, json.dumps(body).encode(), timeout)


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


def _nested(depth):
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("raw, says", [
    (b"[" * 200_000, "nests more than 128 levels"),
    (('{"model": "m", "prompt": %s}' % _nested(300)).encode(), "nests more than 128 levels"),
    (b"{not json", "is not JSON"),
    (b'{"prompt": "\xff"}', "is not JSON"),
    (b"[1, 2]", "is a JSON array, not an object"),
    (b'"x"', "is a JSON string, not an object"),
    (b'{"model": "m", "prompt": "x", "n": "2"}', "'n' must be an integer, not a JSON string"),
    (b'{"model": "m", "prompt": "x", "best_of": [1]}', "'best_of' must be an integer, not a JSON array"),
    (b'{"model": "m", "prompt": "x", "n": true}', "'n' must be an integer, not a JSON boolean"),
], ids=["200000-open-brackets", "300-deep-prompt", "not-json", "not-utf8", "array", "string", "n-string",
        "best_of-array", "n-boolean"])
def test_a_malformed_request_body_gets_a_400_with_an_openai_error(env, raw, says):
    loop, proxy = env
    p, d = Fake("prefill"), Fake("decode")
    px, url = proxy([loop.serve(p.app)], [loop.serve(d.app)])
    status, text = post_raw(url + "/v1/completions", raw, timeout=10)
    assert status == 400, text
    err = json.loads(text)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and says in err["message"], err
    assert p.got == [] and d.got == []
    assert post(url + "/v1/completions", {"model": "m", "prompt": "x"}, timeout=10)[0] == 200  # it goes on


def _params(**kw):
    return lambda ktp: json.dumps({"choices": [{"text": "P"}], "kv_transfer_params": {
        "transfer_id": ktp["transfer_id"], **kw}}).encode()


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("answer, says", [
    (lambda ktp: b"[1, 2]", "is a JSON array, not an object"),
    (lambda ktp: b'"done"', "is a JSON string, not an object"),
    (lambda ktp: b"<html>oops</html>", "is not JSON"),
    (lambda ktp: b"[" * 100_000, "nests more than 128 levels"),
    (lambda ktp: ('{"kv_transfer_params": {"remote_blocks": %s}}' % _nested(300)).encode(), "nests more than"),
    (lambda ktp: b'{"kv_transfer_params": [1]}', "kv_transfer_params is a JSON array, not an object"),
    (lambda ktp: b'{"choices": []}', "kv_transfer_params is a JSON null, not an object"),
    (_params(remote_engine=7), "hold no hixl engine"),
    (_params(remote_engine="10.0.0.1:7000", mode="sideways"), "mode 'sideways', not push or pull"),
], ids=["array", "string", "not-json", "100000-open-brackets", "300-deep-params", "params-array", "no-params",
        "engine-number", "mode-unknown"])
def test_a_malformed_prefill_answer_gets_a_502_naming_the_prefill(env, mode, answer, says):
    loop, proxy = env
    p, d = Fake("prefill", mode=mode, answer=answer), Fake("decode", delay=30)
    p_url = loop.serve(p.app)
    px, url = proxy([p_url], [loop.serve(d.app)])
    assert px.prefill.instances[0].engine == "10.0.0.1:7000"  # discovered: push goes to both at once
    t0 = time.monotonic()
    status, text = post(url + "/v1/completions", {"model": "m", "prompt": "x"}, timeout=10)
    assert status == 502, text
    err = json.loads(text)["error"]
    assert err["instance"] == p_url and p_url in err["message"] and says in err["message"], err
    assert err["type"] == "upstream_error" and err["code"] == 502
    assert time.monotonic() - t0 < 5 and px.counts["errors"] == 1
    if mode == "pull":
        assert d.got == []  # the decoder was never asked
    else:
        deadline = time.monotonic() + 5
        while d.aborted < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert d.aborted == 1  # its request closed: vLLM aborts it


def raw_request(url, path, body, timeout=10):
    """The bytes a client gets for one POST, read from a plain socket up to the server's close; and
    whether the server reset the connection."""
    u = urllib.parse.urlparse(url)
    head = (f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    data, reset = b"", False
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        s.sendall(head + body)
        while True:
            try:
                got = s.recv(65536)
            except ConnectionResetError:
                reset = True
                break
            if not got:
                break
            data += got
    return data, reset


def dechunk(data):
    """(header block, body, whether the chunked body ended with its last chunk and nothing after)."""
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = b""
    while True:
        line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            return head, body, False
        size = int(line.split(b";")[0], 16)
        if len(rest) < size + 2:
            return head, body, False
        assert rest[size:size + 2] == b"\r\n", rest[:size + 2]
        if size == 0:
            assert rest[2:] == b"", f"bytes after the chunked body's end: {rest[2:300]!r}"
            return head, body, True
        body, rest = body + rest[:size], rest[size + 2:]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_decoder_that_breaks_off_its_stream_ends_it_with_an_error_event(env, mode):
    loop, proxy = env
    p, d = Fake("prefill", mode=mode), Fake("decode", break_after=2)
    d_url = loop.serve(d.app)
    px, url = proxy([loop.serve(p.app)], [d_url])
    data, reset = raw_request(url, "/v1/completions",
                              json.dumps({"model": "m", "prompt": "a b c", "stream": True}).encode())
    assert data.count(b"HTTP/1.") == 1, data  # one status line: no second response inside the body
    assert data.startswith(b"HTTP/1.1 200 ") and not reset, data
    head, body, complete = dechunk(data)
    assert complete, body  # the chunked body ends properly
    events = body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", events
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-3]]
    assert texts == ["decoded ", "a "]  # the whole events as they came; the half one dropped
    err = json.loads(events[-3][len("data: "):])["error"]  # what vLLM sends and openai-python raises on
    assert err["code"] == 502 and err["type"] == "upstream_error" and err["instance"] == d_url, err
    assert d_url in err["message"] and "broke off" in err["message"], err
    assert px.counts["errors"] == 1 and px.decode.instances[0].down_until > 0


def test_a_decoder_that_breaks_off_a_json_answer_gets_the_connection_cut(env):
    loop, proxy = env
    p, d = Fake("prefill", mode="pull"), Fake("decode", break_after=0)
    px, url = proxy([loop.serve(p.app)], [loop.serve(d.app)])
    data, _ = raw_request(url, "/v1/completions", json.dumps({"model": "m", "prompt": "a"}).encode())
    assert data.count(b"HTTP/1.") == 1 and data.startswith(b"HTTP/1.1 200 "), data
    head, body, complete = dechunk(data)
    assert not complete and body == b'{"choices": [{"text": "decoded a', body  # cut: an incomplete body
    assert px.counts["errors"] == 1


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_discovery_outlives_malformed_answers_and_rediscovers_after_an_outage(env):
    loop, proxy = env
    p, d = Fake("prefill", engine="10.0.0.1:1"), Fake("decode", delay=0.3)  # the prefill's failure comes first
    p.models_answers = [b'{"data": [1]}', b"[1]", b'{"data": "m"}', b'{"data": [{"id": 5}]}', b"not json",
                        b"[" * 100_000, (500, b'{"error": {"message": "starting"}}'), b'{"data": []}']
    p.discover_answers = [b"[]", b'{"kv_transfer_params": {"remote_engine": 3}}', b'{"kv_transfer_params": 1}']
    p_url = loop.serve(p.app)
    px, url = proxy([p_url], [loop.serve(d.app)], discover_every_s=0.05)
    inst = px.prefill.instances[0]
    assert _wait(lambda: inst.engine == "10.0.0.1:1"), inst
    assert inst.discovery_errors == 11 and px.counts["discovery_errors"] == 11 and inst.failed == 0
    assert inst.discovery_error == ""  # the last ask worked
    with urllib.request.urlopen(url + "/proxy/status", timeout=10) as r:
        assert json.load(r)["prefill"][0]["discovery_errors"] == 11
    assert post(url + "/v1/completions", {"model": "m", "prompt": "x"}, timeout=10)[0] == 200
    assert px.counts["push"] == 1
    # an outage: the request that finds it gets a 502 naming it; once it is back (restarted, with
    # another engine) discovery learns it again, and requests go to its new engine
    p.outage = True
    status, text = post(url + "/v1/completions", {"model": "m", "prompt": "y"}, timeout=10)
    assert status == 502 and p_url in json.loads(text)["error"]["message"]
    assert inst.engine is None and inst.failed >= 1
    p.engine, p.outage = "10.0.0.2:2", False
    assert _wait(lambda: inst.engine == "10.0.0.2:2"), inst
    assert post(url + "/v1/completions", {"model": "m", "prompt": "z"}, timeout=10)[0] == 200
    assert d.got[-1]["kv_transfer_params"]["remote_engine"] == "10.0.0.2:2"


# ---------------------------------------------------------------------------------- other contracts, TP
def test_a_tp_prefill_has_the_decoder_told_each_ranks_engine(env):
    loop, proxy = env
    p, d = Fake("prefill", engine="10.0.0.1:1"), Fake("decode")
    p.engines = ["10.0.0.1:1", "10.0.0.1:2"]
    px, url = proxy([loop.serve(p.app)], [loop.serve(d.app)])
    assert px.prefill.instances[0].engines == ["10.0.0.1:1", "10.0.0.1:2"]
    assert post(url + "/v1/completions", {"model": "m", "prompt": "x"})[0] == 200
    ktp = d.got[0]["kv_transfer_params"]
    assert ktp["remote_engines"] == ["10.0.0.1:1", "10.0.0.1:2"] and ktp["remote_engine"] == "10.0.0.1:1"
    assert px.counts["push"] == 1


def test_a_prefill_answering_nixls_fields_alone_has_them_forwarded_unchanged(env):
    loop, proxy = env
    nixl = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e-1",
            "remote_request_id": "cmpl-1", "remote_block_ids": [[3, 4]], "remote_host": "10.0.0.1",
            "remote_port": 5600, "tp_size": 1}
    p = Fake("prefill", answer=lambda ktp: json.dumps({"choices": [{"text": "P"}], "kv_transfer_params": nixl}).encode())
    p.discover_params = lambda: None  # NixlConnector answers a request it does not prefill with no params
    d = Fake("decode")
    px, url = proxy([loop.serve(p.app)], [loop.serve(d.app)], discover_every_s=0.05)
    for i in range(2):
        assert post(url + "/v1/completions", {"model": "m", "prompt": f"x{i}"})[0] == 200
        assert d.got[i]["kv_transfer_params"] == nixl  # no mode, no transfer id added
    inst = px.prefill.instances[0]
    assert inst.contract == "nixl" and px.counts["sequential"] == 2 and px.counts["push"] == 0
    asked = p.discovered
    time.sleep(0.3)
    assert p.discovered == asked  # known: discovery stops asking it


def test_a_mooncake_prefill_is_found_at_its_bootstrap_endpoint(env):
    loop, proxy = env
    boot = web.Application()
    queries = []

    async def query(request):
        queries.append(1)
        return web.json_response({"0": {"engine_id": "mc-engine", "worker_addr": {"0": {"0": "tcp://10.0.0.1:1"}}}})
    boot.router.add_get("/query", query)
    boot_url = loop.serve(boot)
    p = Fake("prefill", answer=lambda ktp: json.dumps({"choices": [{"text": "P"}]}).encode())
    p.discover_params = lambda: None
    d = Fake("decode")
    px, url = proxy([loop.serve(p.app)], [loop.serve(d.app)], bootstrap_port=int(boot_url.rsplit(":", 1)[1]))
    inst = px.prefill.instances[0]
    assert _wait(lambda: inst.contract == "mooncake"), inst
    assert post(url + "/v1/completions", {"model": "m", "prompt": "x"})[0] == 200
    tid = p.got[0]["kv_transfer_params"]["transfer_id"]
    assert p.got[0]["kv_transfer_params"] == {"do_remote_decode": True, "transfer_id": tid}
    assert d.got[0]["kv_transfer_params"] == {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
                                              "remote_bootstrap_addr": boot_url, "remote_engine_id": "mc-engine"}
    assert px.counts["sequential"] == 1 and queries
    with urllib.request.urlopen(url + "/proxy/status", timeout=10) as r:
        assert json.load(r)["prefill"][0]["contract"] == "mooncake"


def test_without_a_bootstrap_port_a_prefill_answering_nothing_is_no_prefill(env):
    loop, proxy = env
    p = Fake("prefill", answer=lambda ktp: json.dumps({"choices": [{"text": "P"}]}).encode())
    p.discover_params = lambda: None
    p_url = loop.serve(p.app)
    px, url = proxy([p_url], [loop.serve(Fake("decode").app)])
    status, text = post(url + "/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 502 and "returned no hixl kv_transfer_params" in text and p_url in text
