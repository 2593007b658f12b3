"""A fresh push/pull pair started with vLLM's default thread settings (no ``OMP_NUM_THREADS``, no
``VLLM_CPU_OMP_THREADS_BIND``: vLLM binds each worker where it chooses; on this 2-core host both workers
share core 0), its first traffic a burst of concurrent requests, compared token for token with one
instance.

It guards what made such a pair lose its first burst: a prefill holding blocks for a decoder's grant
kept vLLM stepping, and its worker spun on the core its decoder needed to send that grant, until the
heartbeat gave up (the producer's idle wait, docs/vllm.md ``idle_wait_ms``).
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from hixl_tools.vllm_launch import ProxyProcess, VllmInstance  # noqa: E402
from tests.vllm_tier import test_pd_e2e as pd  # noqa: E402  (its helpers; its tests stay there)
from tests.vllm_tier.conftest import log_marks  # noqa: E402

pytestmark = pytest.mark.vllm
model_dir = pd.model_dir


@pytest.fixture(scope="module")
def cluster(model_dir):
    logs = pd._log_dir()
    inst = {
        "REF": VllmInstance("dt-ref", model_dir, cores="1", log_dir=logs),
        "P": VllmInstance("dt-p", model_dir, role="kv_producer", log_dir=logs, threads="default"),
        "D": VllmInstance("dt-d", model_dir, role="kv_consumer", log_dir=logs, threads="default"),
    }
    for i in inst.values():
        i.start()
    try:
        for i in inst.values():
            i.wait_ready(timeout=1200)
        yield inst
    finally:
        for i in inst.values():
            i.stop()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_fresh_pair_with_vllms_default_thread_settings_serves_a_first_burst(cluster, mode, request):
    """Push first (P and D have served nothing before it), then pull."""
    ps = pd.prompts(f"fresh-{mode}")
    ref = pd._reference(cluster, ps)
    px = ProxyProcess([cluster["P"].url], [cluster["D"].url], log_dir=pd._log_dir(), name=f"dt-proxy-{mode}",
                      args=["--mode", mode])
    log_marks(request.node, [px.log_path] + [i.log_path for i in cluster.values()])
    px.start()
    try:
        t0 = time.monotonic()
        texts, dd, _, want = pd._run_pd(cluster, px, "D", ["P"], ps, lambda d: True)
        print(f"\n[fresh {mode} burst, vLLM's default threads] {len(ps)} requests in {time.monotonic() - t0:.1f} s")
    finally:
        px.stop()
    assert texts == ref
    pd._assert_all_transferred(dd, len(ps), want)
    assert dd["pulled"] == (len(ps) if mode == "pull" else 0), dd
