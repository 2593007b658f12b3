"""The models people disaggregate, with real ``vllm serve`` instances and vLLM's hybrid KV cache manager on:
DeepSeek-V2 (MLA), Gemma 3 and gpt-oss (sliding window and full attention), Qwen3-Next (Gated DeltaNet
linear attention and full attention), each a small random-weight model of ``hixl model tiny ARCH``.

One cluster per architecture, three instances: REF (TP=1, no connector), X and Y (``kv_both``). X prefills
for Y behind ``hixl proxy`` (push, layer-wise), Y for X behind ``vllm-router`` (pull). Gemma 3 and the MLA
model run X with TP=2, so that the first direction is P TP=2 -> D TP=1 and the second P TP=1 -> D TP=2 (the
MLA latent crossing the network once and copied between the decoder's ranks; Gemma 3's attention heads split
over the ranks, each decoder rank taking its own from the prefill ranks that hold them); gpt-oss's three
instances keep their KV in FP8, and its X and Y run with vLLM's default thread settings (no
``OMP_NUM_THREADS``, no ``VLLM_CPU_OMP_THREADS_BIND``: on a 2-core host both bind to core 0), their first
traffic a burst of pushes: a prefill holding blocks for a decoder's grant keeps vLLM stepping, and must not
spin on the core its decoder needs to send that grant (the producer's idle wait, docs/vllm.md
``idle_wait_ms``). Every completion must equal
REF's token for token; the decoder's counters must show that every prompt token came by transfer but the
ones vLLM's contract leaves to the decoder (with a sliding window or a Mamba state: the last one); no
instance may log that vLLM turned its hybrid KV cache manager off; the bytes moved per group kind must be
what each kind needs (a sliding window's: its window, whatever the prompt's length).
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

from hixl_tools.vllm_launch import ProxyProcess, RouterProcess, VllmInstance, serving  # noqa: E402
from tests.vllm_tier import test_pd_e2e as pd  # noqa: E402  (its helpers; its tests stay there)
from tests.vllm_tier.conftest import log_marks  # noqa: E402
from tests.vllm_tier.standin_router import StandinRouter, nixl_fields_only  # noqa: E402

pytestmark = pytest.mark.vllm

# arch: (X's TP, dtype, the KV cache group kinds that move, tokens the decoder computes of each prompt,
# more vllm serve arguments)
ARCHS = {
    "deepseek-v2": (2, "float32", {"mla"}, 0, []),
    "gemma3": (2, "float32", {"full", "sliding"}, 1, []),
    "gpt-oss": (1, "float32", {"full", "sliding"}, 1, ["--kv-cache-dtype", "fp8"]),  # FP8 KV (all three)
    "qwen3-next": (1, "bfloat16", {"full", "mamba"}, 1, []),
}
DEFAULT_THREADS = {"gpt-oss"}  # X and Y with vLLM's default thread settings
HMA_OFF = "Turning off hybrid kv cache manager"


def _tiny(arch):
    out = os.path.join(os.environ.get("HIXL_VLLM_TINY_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                            "hixl"), f"tiny-{arch}")
    exe = os.path.join(os.path.dirname(sys.executable), "hixl")
    cmd = ([exe] if os.path.exists(exe) else [sys.executable, "-m", "hixl.cli"]) + ["model", "tiny", arch, out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


@pytest.fixture(scope="module", params=list(ARCHS))
def cluster(request):
    arch = request.param
    tp, dtype, _, _, args = ARCHS[arch]
    model = _tiny(arch)
    logs = pd._log_dir()
    kw = dict(log_dir=logs, served_name=pd.MODEL, dtype=dtype, args=args)
    fresh = arch in DEFAULT_THREADS
    x_cores, y_cores = (None, None) if fresh else (None if tp > 1 else "1", "0")
    threads = "default" if fresh else "pinned"
    inst = {
        "REF": VllmInstance(f"{arch}-ref", model, cores="1", **kw),
        "X": VllmInstance(f"{arch}-x", model, role="kv_both", tp=tp, cores=x_cores, threads=threads, **kw),
        "Y": VllmInstance(f"{arch}-y", model, role="kv_both", cores=y_cores, threads=threads,
                          env={"HIXL_VLLM_MODE": "pull"}, **kw),
    }
    with serving(inst.values()) as took:
        print(f"\n[vllm {arch}] REF, X (TP={tp}), Y ready in {took:.0f} s, threads {threads}; logs in {logs}")
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        yield arch, inst, config


@pytest.fixture(autouse=True)
def _instance_logs_on_failure(request):
    if "cluster" in request.fixturenames:
        log_marks(request.node, [i.log_path for i in request.getfixturevalue("cluster")[1].values()])


def _kinds(inst):
    """Bytes received over the network and sent, by group kind, and the relayed bytes."""
    m = inst.metrics()
    out = {f"{side}:{kind}": m.get(f'vllm:hixl_kv_{name}_bytes_by_kind_total{{kind="{kind}"}}', 0.0)
           for side, name in (("recv", "received"), ("sent", "sent")) for kind in ("full", "sliding", "mla", "mamba")}
    out["relayed"] = m.get("vllm:hixl_kv_relayed_bytes_total", 0.0)
    out["sent"] = m.get("vllm:hixl_kv_sent_bytes_total", 0.0)
    return out


def _burst(inst, front, p_name, d_name, ps, local_each, push):
    """The prompts through ``front`` at once: texts, the decoder's counter deltas, the prompt tokens, and
    the byte counters' deltas of both sides (a push's: once the prefill published what it sent)."""
    n = pd._prompt_tokens(inst, ps)
    want = sum(n) - local_each * len(ps)
    d0, k0 = pd._counters(inst[d_name]), {x: _kinds(inst[x]) for x in (p_name, d_name)}
    with cf.ThreadPoolExecutor(len(ps)) as ex:
        outs = list(ex.map(lambda p: pd.complete(front.url, p), ps))
    dd = pd._delta(inst[d_name], d0, lambda d: d["external"] >= want and d["received_tokens"] >= want)
    kk = {d_name: {k: v - k0[d_name][k] for k, v in _kinds(inst[d_name]).items()}}
    got = sum(v for k, v in kk[d_name].items() if k.startswith("recv:")) + kk[d_name]["relayed"]
    deadline = time.monotonic() + 30  # the prefill publishes its counters once it gave the blocks back
    while True:
        kk[p_name] = {k: v - k0[p_name][k] for k, v in _kinds(inst[p_name]).items()}
        if not push or kk[p_name]["sent"] >= got - kk[d_name]["relayed"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return [pd._text_of(o) for o in outs], dd, n, kk


def _assert_by_transfer(dd, ps, n, local_each, d_tp):
    """vLLM's own count: the prompt tokens came by transfer, but the last of each when the decoder computes
    it itself (vLLM's contract with a sliding window or a Mamba state); hixl's count agrees (each of the
    decoder's ranks counts what it received)."""
    assert dd["external"] == sum(n) - local_each * len(ps), (dd, n)
    assert dd["local"] == local_each * len(ps), (dd, n)
    assert dd["received_tokens"] == d_tp * (sum(n) - local_each * len(ps)) and dd["recv_failed"] == 0, dd


def _assert_window_bytes(cfg, kk, d_name, ps, n):
    """A sliding layer moves its window's blocks (at most cdiv(window, block) + 1 of them), however long the
    prompt: bounded per request, while a full-attention layer's bytes grow with the prompt (blocks of 128
    tokens: vLLM's CPU attention)."""
    window, block = cfg["sliding_window"], 128
    kinds = cfg.get("layer_types") or []
    n_sliding = sum(t == "sliding_attention" for t in kinds)
    n_full = sum(t == "full_attention" for t in kinds)
    per_block_layer = kk[d_name]["recv:full"] / (n_full * sum(-(-(x - 1) // block) for x in n))
    bound = n_sliding * len(ps) * (-(-window // block) + 1) * per_block_layer
    assert 0 < kk[d_name]["recv:sliding"] <= bound, (kk, bound)
    assert max(n) > 6 * window  # the longest prompt is many windows long: the whole prompt would be far more
    assert kk[d_name]["recv:sliding"] < n_sliding * sum(-(-(x - 1) // block) for x in n) * per_block_layer / 2


def test_hma_stays_on_and_every_group_is_registered(cluster):
    arch, inst, config = cluster
    for name in ("REF", "X", "Y"):
        assert HMA_OFF not in inst[name].log_text(), f"{arch} {name}: vLLM turned its hybrid KV cache manager off"
    for name in ("X", "Y"):
        log = inst[name].log_text()
        kinds = {k for k, said in (("full", "full attention"), ("sliding", "sliding window"), ("mla", "MLA latent"),
                                   ("mamba", "Mamba state")) if f": {said}" in log and "KV cache group" in log}
        assert kinds == ARCHS[arch][2], (arch, name, kinds)


def _through(cluster, request, front, p_name, d_name, ps, push):
    """The prompts ``ps`` through ``front`` (started and stopped here) from ``p_name`` to ``d_name``: the
    completions must equal REF's and come by transfer; returns the counters' deltas (``_burst``)."""
    arch, inst, _ = cluster
    local_each = ARCHS[arch][3]
    ref = pd._reference(inst, ps)
    if getattr(front, "log_path", None):
        log_marks(request.node, [front.log_path])
    front.start()
    try:
        texts, dd, n, kk = _burst(inst, front, p_name, d_name, ps, local_each, push)
    finally:
        front.stop()
    assert texts == ref
    _assert_by_transfer(dd, ps, n, local_each, ARCHS[arch][0] if d_name == "X" else 1)
    return dd, n, kk


def test_push_behind_hixl_proxy_is_identical_and_by_transfer(cluster, request):
    arch, inst, config = cluster
    ps = pd.prompts(f"{arch}-push")
    front = ProxyProcess([inst["X"].url], [inst["Y"].url], log_dir=pd._log_dir(), name=f"{arch}-proxy",
                         args=["--mode", "push"])
    dd, n, kk = _through(cluster, request, front, "X", "Y", ps, push=True)
    assert dd["pulled"] == 0, dd
    assert {k.split(":")[1] for k, v in kk["Y"].items() if k.startswith("recv:") and v} == ARCHS[arch][2], kk
    assert kk["X"]["sent"] == sum(v for k, v in kk["Y"].items() if k.startswith("recv:")), kk
    if arch == "deepseek-v2":  # P TP=2 -> D TP=1: one rank's latent crossed, the other rank sent nothing
        assert kk["X"]["sent:mla"] == kk["Y"]["recv:mla"] and kk["Y"]["relayed"] == 0, kk
    if "sliding" in ARCHS[arch][2]:
        _assert_window_bytes(config, kk, "Y", ps, n)


def test_pull_behind_vllm_router_is_identical_and_by_transfer(cluster, request):
    arch, inst, _ = cluster
    ps = pd.prompts(f"{arch}-pull")
    router = RouterProcess([(inst["Y"].url, None)], [inst["X"].url], log_dir=pd._log_dir(), name=f"{arch}-router")
    dd, n, kk = _through(cluster, request, router, "Y", "X", ps, push=False)
    assert dd["pulled"] >= len(ps), dd
    if arch == "deepseek-v2":  # P TP=1 -> D TP=2: the latent crossed once (read by decoder rank 0), rank 1 copied it
        assert kk["X"]["recv:mla"] == kk["X"]["relayed"] > 0, kk


def test_behind_a_stand_in_of_vllms_push_proxy_the_whole_request_is_pushed_after_the_prefill(cluster, request):
    """vLLM's toy push proxy: the prefill first, then the decoder with NIXL's fields alone (no block ids):
    the decoder's grant reaches a prefill that finished, which pushes every group from the blocks it holds
    (the window's, the state after the prompt)."""
    arch, inst, _ = cluster
    ps = pd.prompts(f"{arch}-standin")[1::2]  # one short and the longest
    front = StandinRouter(inst["X"].url, inst["Y"].url, nixl_fields_only, name=f"{arch}-standin")
    dd, n, kk = _through(cluster, request, front, "X", "Y", ps, push=True)
    assert dd["pulled"] == 0 and all("remote_block_ids" not in d for _, d in front.seen), front.seen
    assert {k.split(":")[1] for k, v in kk["Y"].items() if k.startswith("recv:") and v} == ARCHS[arch][2], kk
