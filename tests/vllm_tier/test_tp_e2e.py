"""Prefill and decode with different tensor parallelism, with real ``vllm serve`` instances: P TP=2 -> D TP=1
behind ``hixl proxy`` (push, layer-wise) and P TP=1 -> D TP=2 behind ``vllm-router`` (nixl mode; the prefill
answers pull).

The model is ``hixl model tiny-llama`` (8 query and 4 KV heads, so that TP=2 splits them; SmolLM2-135M's 9
and 3 do not divide by 2), written once into ``~/.cache/hixl/tiny-llama`` (``HIXL_VLLM_TINY_MODEL``). Three
instances: REF (TP=1, no connector), X (TP=2, kv_both, push) and Y (TP=1, kv_both, pull): X prefills for Y
in the first direction, Y for X in the second. Completions must equal REF's token for token and the
decoder's counters must show that the whole prompt came by transfer; the first requests of each direction
go at once.

The worker-level tests (``test_tp_parts``) move every head between real engines of different TP too,
without vLLM.

``HIXL_VLLM_TP_CONNECTOR=NixlConnector`` runs the same with vLLM's NixlConnector (behind vllm-router in
both directions: ``hixl proxy`` does not front it), to check the harness itself.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")

from hixl_tools.vllm_launch import ProxyProcess, RouterProcess, VllmInstance  # noqa: E402
from tests.vllm_tier import test_pd_e2e as pd  # noqa: E402  (its helpers; its tests stay there)
from tests.vllm_tier.conftest import log_marks  # noqa: E402

CONNECTOR = os.environ.get("HIXL_VLLM_TP_CONNECTOR", "HixlConnector")
HIXL = CONNECTOR == "HixlConnector"


@pytest.fixture(scope="module")
def tiny_model():
    out = os.environ.get("HIXL_VLLM_TINY_MODEL") or os.path.join(os.path.expanduser("~"), ".cache", "hixl",
                                                                   "tiny-llama")
    exe = os.path.join(os.path.dirname(sys.executable), "hixl")
    cmd = ([exe] if os.path.exists(exe) else [sys.executable, "-m", "hixl.cli"]) + ["model", "tiny-llama", out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.fixture(scope="module")
def cluster(tiny_model):
    logs = pd._log_dir()
    kw = dict(log_dir=logs, connector=CONNECTOR, served_name=pd.MODEL)
    inst = {
        "REF": VllmInstance("tp-ref", tiny_model, cores="1", log_dir=logs, served_name=pd.MODEL),
        "X": VllmInstance("tp-x2", tiny_model, role="kv_both", tp=2, **kw),  # "0|1": a core per rank
        "Y": VllmInstance("tp-y1", tiny_model, role="kv_both", cores="0",
                          env={"HIXL_VLLM_MODE": "pull"} if HIXL else None, **kw),
    }
    for i in inst.values():
        i.start()
    try:
        t0 = time.monotonic()
        for i in inst.values():
            i.wait_ready(timeout=1200)
        print(f"\n[vllm tp] REF, X (TP=2), Y ({CONNECTOR}) ready in {time.monotonic() - t0:.0f} s; logs in {logs}")
        yield inst
    finally:
        for i in inst.values():
            i.stop()


@pytest.fixture(autouse=True)
def _instance_logs_on_failure(request):
    if "cluster" in request.fixturenames:
        log_marks(request.node, [i.log_path for i in request.getfixturevalue("cluster").values()])


def test_tiny_llama_has_heads_for_tp2_and_a_robust_greedy_margin(tiny_model):
    with open(os.path.join(tiny_model, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 4)
    with open(os.path.join(tiny_model, "hixl_tiny_llama.json")) as f:
        made = json.load(f)
    assert made["smallest_relative_greedy_margin"] >= 1e-3, made  # float32 rounding is ~1e-6 of the logits


def _burst(cluster, url, decoder, ps):
    want = sum(pd._prompt_tokens(cluster, ps))
    d0 = pd._counters(cluster[decoder])
    with cf.ThreadPoolExecutor(len(ps)) as ex:
        outs = list(ex.map(lambda p: pd.complete(url, p), ps))
    dd = pd._delta(cluster[decoder], d0, lambda d: d["external"] >= want - (0 if HIXL else len(ps)))
    return [pd._text_of(o) for o in outs], dd, want


def _assert_by_transfer(dd, ps, want):
    if HIXL:  # vLLM's own count: every prompt token came by transfer, none computed on the decoder
        assert dd["external"] == want and dd["local"] == 0, (dd, want)
        assert dd["received"] >= len(ps) and dd["received_tokens"] >= want and dd["recv_failed"] == 0, dd
    else:  # NixlConnector may compute a prompt's last token on the decoder
        assert dd["external"] >= want - len(ps) and dd["local"] <= len(ps), (dd, want)


def test_prefill_tp2_to_decode_tp1_push_behind_hixl_proxy(cluster, request):
    ps = pd.prompts("tp2-to-tp1")
    ref = pd._reference(cluster, ps)
    logs = pd._log_dir()
    if HIXL:
        front = ProxyProcess([cluster["X"].url], [cluster["Y"].url], log_dir=logs, name="tp-proxy",
                             args=["--mode", "push"])
    else:
        front = RouterProcess([(cluster["X"].url, None)], [cluster["Y"].url], log_dir=logs, name="tp-router-xy")
    log_marks(request.node, [front.log_path])
    front.start()
    try:
        texts, dd, want = _burst(cluster, front.url, "Y", ps)
    finally:
        front.stop()
    assert texts == ref
    _assert_by_transfer(dd, ps, want)
    if HIXL:
        assert dd["pulled"] == 0, dd


def test_prefill_tp1_to_decode_tp2_pull_behind_vllm_router(cluster, request):
    ps = pd.prompts("tp1-to-tp2")
    ref = pd._reference(cluster, ps)
    router = RouterProcess([(cluster["Y"].url, None)], [cluster["X"].url], log_dir=pd._log_dir(),
                           name="tp-router-yx")
    log_marks(request.node, [router.log_path])
    router.start()
    try:
        texts, dd, want = _burst(cluster, router.url, "X", ps)
    finally:
        router.stop()
    assert texts == ref
    _assert_by_transfer(dd, ps, want)
    if HIXL:
        assert dd["pulled"] >= len(ps), dd
