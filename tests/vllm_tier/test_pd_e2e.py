"""vLLM itself with HixlConnector: ``vllm serve`` prefill and decode instances behind ``hixl proxy``, on this
host, compared with one vLLM instance without a connector.

One cluster serves the module (starting an instance costs ~30-60 s on 2 cores): REF (no connector), P1
(kv_producer, defaults only), P2 (kv_producer, pull preferred: what its answers say), D1 (kv_consumer,
defaults only: shm on this host) and D2 (kv_consumer over tcp, kv_load_failure_policy "recompute"), each
instance's OpenMP thread on one core. The first traffic P1 and D1 see is a burst of concurrent requests.
``hixl proxy`` follows a prefill's preference unless ``--mode`` names one; the routers nobody here wrote (``vllm-router``, stand-ins for
vLLM's push proxy, :mod:`tests.vllm_tier.standin_router`) go by the prefill's answer (the tests
before the last). Each test routes through a proxy of its own and uses prompts no instance has seen (a nonce first), so that no prefix-cache hit hides a transfer.

Every completion must be identical to REF's (greedy), and the decoder's counters must show that the
prompt arrived by transfer and nothing of it was computed there: vLLM's own
``prompt_tokens_by_source{source="external_kv_transfer"}`` grows by the prompt tokens and
``{source="local_compute"}`` not at all, and so does hixl's ``hixl_kv_received_tokens``.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import pytest

pytest.importorskip("vllm")

from hixl_tools.vllm_launch import (ProxyProcess, RouterProcess, VllmInstance, free_port, post_json,  # noqa: E402
                                    serving, vllm_command)
from tests.vllm_tier.standin_router import StandinRouter, http_host_for_remote_host, nixl_fields_only  # noqa: E402
from tests.vllm_tier.conftest import log_marks  # noqa: E402

MODEL = "smollm2"
WORDS = ("river stone light north garden paper silver window market cloud music table orange engine "
         "winter bridge forest letter summer island doctor planet yellow camera").split()


def _text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(n_words))


def prompts(tag: str):
    """Short to long (one to ~10 blocks of 128 tokens), each starting with a nonce no instance saw."""
    nonce = f"[{tag} {uuid.uuid4().hex[:8]}]"
    return [f"{nonce} Question {i}: {_text(n, i)}. Answer in one sentence:" for i, n in
            enumerate([8, 150, 420, 900])]


def _log_dir() -> str:
    d = os.environ.get("HIXL_VLLM_LOGS") or tempfile.mkdtemp(prefix="hixl-vllm-")
    os.makedirs(d, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def model_dir():
    """SmolLM2 in HF format, written by `hixl model export` (cached across runs)."""
    out = os.environ.get("HIXL_VLLM_MODEL") or os.path.join(os.path.expanduser("~"), ".cache", "hixl", "smollm2-hf")
    exe = os.path.join(os.path.dirname(sys.executable), "hixl")
    cmd = ([exe] if os.path.exists(exe) else [sys.executable, "-m", "hixl.cli"]) + ["model", "export", out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.fixture(scope="module")
def cluster(model_dir):
    logs = _log_dir()
    kw = dict(log_dir=logs)
    inst = {
        # each instance's compute thread on one core: P1, the busiest prefill, alone on core 0
        "REF": VllmInstance("ref", model_dir, cores="1", **kw),
        "P1": VllmInstance("p1", model_dir, role="kv_producer", cores="0", **kw),
        "P2": VllmInstance("p2", model_dir, role="kv_producer", cores="1", extra={"mode": "pull"}, **kw),
        "D1": VllmInstance("d1", model_dir, role="kv_consumer", cores="1", **kw),
        "D2": VllmInstance("d2", model_dir, role="kv_consumer", cores="1", extra={"transport": "tcp"},
                           failure_policy="recompute", **kw),
    }
    with serving(inst.values()) as took:
        print(f"\n[vllm cluster] 5 instances ready in {took:.0f} s; logs in {logs}")
        yield inst


@pytest.fixture(autouse=True)
def _instance_logs_on_failure(request):
    """A failing test's report shows what the instances logged meanwhile (hixl's lines and vLLM's errors):
    CI keeps no other copy of their logs."""
    if "cluster" in request.fixturenames:
        log_marks(request.node, [i.log_path for i in request.getfixturevalue("cluster").values()])


@pytest.fixture
def proxy(cluster, request):
    made = []

    def make(prefill, decode, *args):
        p = ProxyProcess([cluster[x].url for x in prefill], [cluster[x].url for x in decode], log_dir=_log_dir(),
                         name=f"proxy-{request.node.name}-{len(made)}"[:80], args=list(args))
        log_marks(request.node, [p.log_path])
        p.start()
        made.append(p)
        return p
    yield make
    for p in made:
        p.stop()


def complete(url, prompt, max_tokens=24, **kw):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}
    return post_json(url + "/v1/completions", body)


def chat(url, prompt, max_tokens=24, stream=False):
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    if not stream:
        return post_json(url + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    text, chunks = [], 0
    with urllib.request.urlopen(req, timeout=600) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
    assert chunks > 2  # really streamed
    return "".join(text)


def _text_of(out):
    assert "choices" in out, out
    return out["choices"][0]["text"]


def _counters(inst):
    m = inst.metrics()
    return {
        "external": m.get('vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}', 0.0),
        "local": m.get('vllm:prompt_tokens_by_source_total{source="local_compute"}', 0.0),
        "received_tokens": m.get("vllm:hixl_kv_received_tokens_total", 0.0),
        "received": m.get("vllm:hixl_kv_received_requests_total", 0.0),
        "pulled": m.get("vllm:hixl_kv_received_requests_pull_total", 0.0),
        "recv_failed": m.get("vllm:hixl_kv_receive_failures_total", 0.0),
        "sent": m.get("vllm:hixl_kv_sent_requests_total", 0.0),
        "busy": m.get("vllm:hixl_kv_transfer_seconds_total", 0.0),
        "exposed": m.get("vllm:hixl_kv_exposed_transfer_seconds_total", 0.0),
    }


def _delta(inst, before, want, timeout=30.0):
    """Counters of ``inst`` since ``before``, once ``want(delta)`` holds (vLLM publishes them after the
    step that produced them) or the time is up."""
    deadline = time.monotonic() + timeout
    while True:
        now = _counters(inst)
        d = {k: now[k] - before[k] for k in now}
        if want(d) or time.monotonic() > deadline:
            return d
        time.sleep(0.2)


def _until_log(inst, text, timeout=30.0):
    """True once the instance's log holds `text` (or one of them: a tuple)."""
    texts = text if isinstance(text, tuple) else (text,)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = inst.log_text()
        if any(t in log for t in texts):
            return True
        time.sleep(0.2)
    return False


def _reference(cluster, ps, **kw):
    return [_text_of(complete(cluster["REF"].url, p, **kw)) for p in ps]


def _prompt_tokens(cluster, ps):
    return [complete(cluster["REF"].url, p, max_tokens=1)["usage"]["prompt_tokens"] for p in ps]


def _run_pd(cluster, px, decode, prefill, ps, mode_counter):
    """The prompts through ``px`` all at once; returns the texts and the decoder's counter deltas."""
    want_tokens = sum(_prompt_tokens(cluster, ps))
    d0 = _counters(cluster[decode])
    p0 = {p: _counters(cluster[p]) for p in prefill}
    with cf.ThreadPoolExecutor(len(ps)) as ex:
        outs = list(ex.map(lambda p: complete(px.url, p), ps))
    texts = [_text_of(o) for o in outs]
    dd = _delta(cluster[decode], d0, lambda d: d["received_tokens"] >= want_tokens and d["external"] >= want_tokens)
    pd = {p: _delta(cluster[p], p0[p], lambda d: mode_counter(d)) for p in prefill}
    return texts, dd, pd, want_tokens


def _assert_all_transferred(dd, n_requests, want_tokens):
    assert dd["received"] == n_requests, dd
    assert dd["received_tokens"] == want_tokens, dd
    assert dd["external"] == want_tokens, dd      # vLLM's own count: every prompt token came by transfer
    assert dd["local"] == 0, dd                   # and none was computed on the decoder
    assert dd["recv_failed"] == 0, dd


# ------------------------------------------------------------------------------------ tests
def test_model_export_is_complete_and_vllm_serves_it(model_dir, cluster):
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.getsize(os.path.join(model_dir, f)) > 0
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert "Paris" in chat(cluster["REF"].url, "What is the capital of France?")
    # the instances run `vllm serve` where this environment has a working one (ci/install-vllm.sh makes it)
    if os.environ.get("HIXL_REQUIRE_VLLM") == "1":
        assert vllm_command()[-1] == "serve"


def test_push_1p1d_identical_to_one_instance_and_the_kv_came_by_transfer(cluster, proxy):
    ps = prompts("push")
    ref = _reference(cluster, ps)
    px = proxy(["P1"], ["D1"])
    texts, dd, pd, want = _run_pd(cluster, px, "D1", ["P1"], ps, lambda d: d["sent"] >= len(ps))
    assert texts == ref
    _assert_all_transferred(dd, len(ps), want)
    assert dd["pulled"] == 0
    assert pd["P1"]["sent"] == len(ps), pd
    assert 0 <= pd["P1"]["exposed"] < pd["P1"]["busy"], pd  # part of the transfer hid behind the prefill
    st = px.status()
    assert st["counts"]["push"] == len(ps) and st["counts"]["errors"] == 0, st
    # chat, and chat streamed, through the same pair
    q = prompts("push-chat")[2]
    assert chat(px.url, q) == chat(cluster["REF"].url, q)
    q = prompts("push-stream")[3]
    assert chat(px.url, q, stream=True) == chat(cluster["REF"].url, q)


def test_pull_1p1d_identical_to_one_instance(cluster, proxy):
    ps = prompts("pull")
    ref = _reference(cluster, ps)
    px = proxy(["P1"], ["D1"], "--mode", "pull")
    texts, dd, _, want = _run_pd(cluster, px, "D1", ["P1"], ps, lambda d: True)
    assert texts == ref
    _assert_all_transferred(dd, len(ps), want)
    assert dd["pulled"] == len(ps)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_over_tcp(cluster, proxy, mode):
    ps = prompts(f"tcp-{mode}")
    ref = _reference(cluster, ps)
    px = proxy(["P1"], ["D2"], "--mode", mode)
    texts, dd, _, want = _run_pd(cluster, px, "D2", ["P1"], ps, lambda d: True)
    assert texts == ref
    _assert_all_transferred(dd, len(ps), want)
    assert "(transports tcp)" in cluster["D2"].log_text()  # D2's engine offers tcp only: its links are tcp


def test_two_prefills_into_one_decoder_concurrently(cluster, proxy):
    ps = prompts("two-prefills") + prompts("two-prefills-b")
    ref = _reference(cluster, ps)
    px = proxy(["P1", "P2"], ["D1"], "--mode", "push")  # P2's answers prefer pull
    texts, dd, pd, want = _run_pd(cluster, px, "D1", ["P1", "P2"], ps, lambda d: d["sent"] >= len(ps) // 2)
    assert texts == ref
    _assert_all_transferred(dd, len(ps), want)
    assert pd["P1"]["sent"] == pd["P2"]["sent"] == len(ps) // 2, pd  # round robin: both pushed at once
    assert {p["served"] for p in px.status()["prefill"]} == {len(ps) // 2}


def test_a_decoder_whose_prefill_cannot_be_reached_recomputes_by_its_policy(cluster):
    """D2 has kv_load_failure_policy "recompute": a load from an engine that is not there fails, and the
    request is answered from the prompt alone, identical to REF."""
    p = prompts("recompute")[2]
    before = _counters(cluster["D2"])
    out = complete(cluster["D2"].url, p, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": uuid.uuid4().hex, "remote_engine": f"127.0.0.1:{free_port()}",
        "mode": "push"})
    assert _text_of(out) == _reference(cluster, [p])[0]
    d = _delta(cluster["D2"], before, lambda d: d["recv_failed"] >= 1)
    assert d["recv_failed"] == 1 and d["received"] == 0 and d["local"] > 0, d


def test_vllm_LLM_as_the_prefill(cluster, model_dir):
    """The connector with vllm.LLM(...) (offline) as a kv_producer: its outputs' kv_transfer_params
    take the decode instance D1 to the KV it holds (push: the whole request once D1's grant comes)."""
    ps = prompts("llm")[1:3]
    script = r'''
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
def main():
    ps, out = json.loads(sys.argv[1]), []
    llm = LLM(model=sys.argv[2], enforce_eager=True, dtype="float32", max_model_len=2048,
              kv_transfer_config=KVTransferConfig(kv_connector="HixlConnector", kv_connector_module_path="hixl.vllm",
                                                  kv_role="kv_producer"))
    for i, p in enumerate(ps):
        sp = SamplingParams(temperature=0, max_tokens=1,
                            extra_args={"kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"llm-{i}"}})
        out.append(llm.generate([p], sp)[0].kv_transfer_params)
    print("PARAMS " + json.dumps(out), flush=True)
    sys.stdin.readline()  # keep the engine (and the blocks it holds for D1) until the test is done
if __name__ == "__main__":
    main()
'''
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0",
               HF_HUB_OFFLINE="1")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    log = open(os.path.join(_log_dir(), "llm-prefill.log"), "w")
    proc = subprocess.Popen([sys.executable, f.name, json.dumps(ps), model_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    with log, proc.stdout:
        _llm_prefill_run(cluster, proc, ps, f.name)


def _llm_prefill_run(cluster, proc, ps, script):
    try:
        line = ""
        deadline = time.monotonic() + 600
        while not line.startswith("PARAMS ") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the vllm.LLM prefill exited"
        params = json.loads(line[len("PARAMS "):])
        assert [p["transfer_id"] for p in params] == ["llm-0", "llm-1"] and all(p["remote_engine"] for p in params)
        before = _counters(cluster["D1"])
        texts = [_text_of(complete(cluster["D1"].url, p, kv_transfer_params=kp)) for p, kp in zip(ps, params)]
        assert texts == _reference(cluster, ps)
        want = sum(_prompt_tokens(cluster, ps))
        _assert_all_transferred(_delta(cluster["D1"], before, lambda d: d["received_tokens"] >= want), len(ps), want)
    finally:
        proc.stdin.close()
        proc.wait(60)
        os.unlink(script)


# ------------------------------------------------------------------ routers nobody here wrote
@pytest.fixture
def front(cluster, request):
    """``front(kind, prefill)``: a router before ``prefill`` and D1, stopped after the test: ``vllm-router``
    (``--vllm-pd-disaggregation``) in its ``nixl`` or ``mooncake`` mode, or a stand-in of vLLM's push proxy
    that passes on NIXL's fields only (``nixl-fields``), or also names the prefill's HTTP host as
    ``remote_host`` (``http-host``)."""
    made = []

    def make(kind, prefill):
        p, d = cluster[prefill], cluster["D1"]
        name = f"router-{request.node.name}"[:80]
        if kind in ("nixl", "mooncake"):
            r = RouterProcess([(p.url, p.bootstrap_port if kind == "mooncake" else None)], [d.url], kv_connector=kind,
                              log_dir=_log_dir(), name=name)
            log_marks(request.node, [r.log_path])
        elif kind == "nixl-fields":
            r = StandinRouter(p.url, d.url, nixl_fields_only, name=name)
        else:
            r = StandinRouter(p.url.replace("127.0.0.1", "localhost"), d.url, http_host_for_remote_host, name=name)
        made.append(r.start())
        return r
    yield make
    for r in made:
        r.stop()


def _through_router(cluster, r, tag, pull):
    ps = prompts(tag)
    ref = _reference(cluster, ps)
    texts, dd, _, want = _run_pd(cluster, r, "D1", [], ps, lambda d: True)
    assert texts == ref
    _assert_all_transferred(dd, len(ps), want)
    assert dd["pulled"] == (len(ps) if pull else 0), dd


@pytest.mark.parametrize("prefill,mode", [("P1", "push"), ("P2", "pull")])
def test_vllm_router_nixl_mode(cluster, front, prefill, mode):
    """P1's answers say push: vllm-router rebuilds the decoder's params from NIXL's fields, with its own
    request id; P2's say pull: it passes them on. Either way every prompt token comes by transfer."""
    _through_router(cluster, front("nixl", prefill), f"router-nixl-{mode}", mode == "pull")


def test_vllm_router_mooncake_mode(cluster, front):
    """vllm-router asks P1's bootstrap endpoint (GET /query) for its engine, then dispatches."""
    assert cluster["P1"].bootstrap_port
    _through_router(cluster, front("mooncake", "P1"), "router-mooncake", False)


@pytest.mark.parametrize("kind", ["nixl-fields", "http-host"])
def test_router_standins(cluster, front, kind):
    r = front(kind, "P1")
    _through_router(cluster, r, f"standin-{kind}", False)
    sent = [d for _, d in r.seen]
    assert len(sent) == 4 and all("remote_block_ids" not in d for d in sent), sent
    if kind == "http-host":
        assert {d["remote_host"] for d in sent} == {"localhost"}, sent


def test_standin_transforms_keep_only_nixl_s_fields():
    answer = {"remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.7",
              "remote_port": 5, "tp_size": 1, "transfer_id": "t", "remote_engine": "10.0.0.7:5", "mode": "pull"}
    out = nixl_fields_only(answer, "http://prefill-0:8000")
    assert out == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
                   "remote_request_id": "r", "remote_host": "10.0.0.7", "remote_port": 5, "tp_size": 1}
    assert http_host_for_remote_host(answer, "http://prefill-0:8000") == dict(out, remote_host="prefill-0")


def test_zz_a_prefill_killed_mid_request(cluster, proxy):
    """P2 is killed while it computes a prompt whose decoder (D1) already granted its blocks: the client
    gets an HTTP 502 naming P2 at once, D1 ends its side (no hang, no blocks kept), /health names P2 as
    down, and P1 and D1 go on serving. (Last: P2 stays dead.)"""
    px = proxy(["P2", "P1"], ["D1"], "--mode", "push")  # a grant reaches P2 while it computes
    long_prompt = prompts("kill")[3] + " " + _text(500, 99)
    t0 = time.monotonic()
    complete(cluster["REF"].url, prompts("kill-timing")[3] + " " + _text(500, 98), max_tokens=1)
    prefill_s = time.monotonic() - t0  # what such a prefill takes here
    assert prefill_s > 0.8, f"the prompt is too short to be killed mid-prefill ({prefill_s:.2f} s)"
    d0 = _counters(cluster["D1"])
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, px.url, long_prompt)  # round robin: P2 first
        deadline = time.monotonic() + 30
        while px.status()["counts"]["push"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3 * prefill_s)  # P2 is inside the prefill now (its response would come after prefill_s)
        assert not fut.done(), fut.result()
        t_kill = time.monotonic()
        cluster["P2"].kill()
        out = fut.result(timeout=120)
        waited = time.monotonic() - t_kill
    assert out.get("http_status") == 502, out
    assert cluster["P2"].url in json.dumps(out), out
    assert waited < 30, waited  # the connector's timeout (120 s) is not what ended it
    # D1 ended the load it was granted for (its link to P2 closed) and holds no blocks for it
    dd = _delta(cluster["D1"], d0, lambda d: d["received"] + d["recv_failed"] >= 0, timeout=5)
    assert dd["received"] == 0, dd
    # whichever comes first: the proxy's abort after its 502, or D1's own failure flag (the link to P2
    # closed: the load fails at once)
    assert _until_log(cluster["D1"], ("aborted while waiting for its KV",
                                      "failed to load its KV: the link to its prefill closed")), cluster["D1"].tail()
    with urllib.request.urlopen(px.url + "/health", timeout=30) as r:
        health = json.load(r)
        assert r.status == 200
    assert health["prefill"][cluster["P2"].url].startswith("down"), health
    assert health["prefill"][cluster["P1"].url] == "ok" and health["decode"][cluster["D1"].url] == "ok"
    # the survivors serve; every request now goes to P1
    ps = prompts("after-kill")
    ref = _reference(cluster, ps)
    texts, dd, _, want = _run_pd(cluster, px, "D1", ["P1"], ps, lambda d: True)
    assert texts == ref
    _assert_all_transferred(dd, len(ps), want)
