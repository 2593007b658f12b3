"""The connector behind routers nobody here wrote: ``vllm-router`` (``--vllm-pd-disaggregation``) in its
``nixl`` mode (a push prefill and a pull prefill) and its ``mooncake`` mode (the prefill's bootstrap
endpoint, ``GET /query``), and two stand-ins (:mod:`tests.vllm_tier.standin_router`): one that forwards only
NIXL's fields to the decoder (as vLLM's ``toy_push_proxy_server.py``), one that also replaces ``remote_host``
with the prefill's HTTP host name.

One cluster serves the module: REF (no connector), P1 (kv_producer, push), P2 (kv_producer, pull: its
answers say so) and D (kv_consumer), each router in front of one prefill and D. Every completion must equal
REF's token for token, and D's counters must show that the prompt arrived by transfer (as in
``test_pd_e2e``, whose helpers this module uses). Each test sends its prompts at once; the first test's
burst is the instances' first traffic (no warm-up).

``HIXL_VLLM_ROUTER_CONNECTOR=NixlConnector`` runs the same module with vLLM's NixlConnector, to check the
harness itself: only the vllm-router nixl-mode tests apply (it has no bootstrap endpoint, and its pull
decoder needs the block ids the stand-ins drop); the others say so and skip.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import time

import pytest

pytest.importorskip("vllm")

from hixl_tools.vllm_launch import RouterProcess, VllmInstance  # noqa: E402
from tests.vllm_tier import test_pd_e2e as pd  # noqa: E402  (its helpers; its tests stay there)
from tests.vllm_tier.conftest import log_marks  # noqa: E402
from tests.vllm_tier.standin_router import StandinRouter, http_host_for_remote_host, nixl_fields_only  # noqa: E402

CONNECTOR = os.environ.get("HIXL_VLLM_ROUTER_CONNECTOR", "HixlConnector")
HIXL = CONNECTOR == "HixlConnector"
model_dir = pd.model_dir  # the SmolLM2 export fixture


@pytest.fixture(scope="module")
def cluster(model_dir):
    logs = pd._log_dir()
    kw = dict(log_dir=logs, connector=CONNECTOR)
    inst = {
        "REF": VllmInstance("r-ref", model_dir, cores="1", log_dir=logs),
        "P1": VllmInstance("r-p1", model_dir, role="kv_producer", cores="0", **kw),
        "P2": VllmInstance("r-p2", model_dir, role="kv_producer", cores="0",
                           env={"HIXL_VLLM_MODE": "pull"} if HIXL else None, **kw),
        "D": VllmInstance("r-d", model_dir, role="kv_consumer", cores="1", **kw),
    }
    for i in inst.values():
        i.start()
    try:
        t0 = time.monotonic()
        for i in inst.values():
            i.wait_ready(timeout=1200)
        print(f"\n[vllm routers] 4 instances ({CONNECTOR}) ready in {time.monotonic() - t0:.0f} s; logs in {logs}")
        yield inst
    finally:
        for i in inst.values():
            i.stop()


@pytest.fixture(autouse=True)
def _instance_logs_on_failure(request):
    if "cluster" in request.fixturenames:
        log_marks(request.node, [i.log_path for i in request.getfixturevalue("cluster").values()])


@pytest.fixture
def front(cluster, request):
    """``front(kind, prefill)``: a router before ``prefill`` and D, stopped after the test."""
    made = []

    def make(kind, prefill):
        p, d = cluster[prefill], cluster["D"]
        name = f"router-{request.node.name}"[:80]
        if kind in ("nixl", "mooncake"):
            r = RouterProcess([(p.url, p.bootstrap_port if kind == "mooncake" else None)], [d.url], kv_connector=kind,
                              log_dir=pd._log_dir(), name=name)
            log_marks(request.node, [r.log_path])
        elif kind == "nixl-fields":
            r = StandinRouter(p.url, d.url, nixl_fields_only, name=name)
        else:  # the prefill by a host name, which becomes remote_host
            r = StandinRouter(p.url.replace("127.0.0.1", "localhost"), d.url, http_host_for_remote_host, name=name)
        made.append(r.start())
        return r
    yield make
    for r in made:
        r.stop()


def _burst_through(cluster, url, ps):
    """The prompts through ``url`` all at once; the texts and D's counter deltas."""
    want = sum(pd._prompt_tokens(cluster, ps))
    d0 = pd._counters(cluster["D"])
    with cf.ThreadPoolExecutor(len(ps)) as ex:
        outs = list(ex.map(lambda p: pd.complete(url, p), ps))
    texts = [pd._text_of(o) for o in outs]
    key = "received_tokens" if HIXL else "external"
    dd = pd._delta(cluster["D"], d0, lambda d: d[key] >= want and d["external"] >= want - len(ps))
    return texts, dd, want


def _assert_by_transfer(dd, ps, want, pulled=None):
    if HIXL:
        pd._assert_all_transferred(dd, len(ps), want)
        if pulled is not None:
            assert dd["pulled"] == pulled, dd
    else:  # NixlConnector: vLLM's own counters (it may compute a prompt's last token on the decoder)
        assert dd["external"] >= want - len(ps) and dd["local"] <= len(ps), (dd, want)


@pytest.mark.parametrize("prefill,mode", [("P1", "push"), ("P2", "pull")])
def test_vllm_router_nixl_mode(cluster, front, prefill, mode):
    ps = pd.prompts(f"router-nixl-{mode}")
    ref = pd._reference(cluster, ps)
    r = front("nixl", prefill)
    texts, dd, want = _burst_through(cluster, r.url, ps)
    assert texts == ref
    _assert_by_transfer(dd, ps, want, pulled=len(ps) if mode == "pull" else 0)


def test_vllm_router_mooncake_mode(cluster, front):
    if not HIXL:
        pytest.skip("NixlConnector serves no Mooncake bootstrap endpoint (HixlConnector is the one under test)")
    assert cluster["P1"].bootstrap_port
    ps = pd.prompts("router-mooncake")
    ref = pd._reference(cluster, ps)
    r = front("mooncake", "P1")
    texts, dd, want = _burst_through(cluster, r.url, ps)
    assert texts == ref
    _assert_by_transfer(dd, ps, want)


@pytest.mark.parametrize("kind", ["nixl-fields", "http-host"])
def test_router_standins(cluster, front, kind):
    if not HIXL:
        pytest.skip("NixlConnector (pull) needs remote_block_ids, which these stand-ins drop as vLLM's push proxy "
                    "does for NixlPushConnector (its EngineCore dies on an assertion without them)")
    ps = pd.prompts(f"standin-{kind}")
    ref = pd._reference(cluster, ps)
    r = front(kind, "P1")
    texts, dd, want = _burst_through(cluster, r.url, ps)
    assert texts == ref
    _assert_by_transfer(dd, ps, want)
    sent = [d for _, d in r.seen]
    assert len(sent) == len(ps) and all("remote_block_ids" not in d for d in sent), sent
    if kind == "http-host":
        assert {d["remote_host"] for d in sent} == {"localhost"}, sent


def test_standin_transforms_keep_only_nixl_s_fields():
    answer = {"remote_engine_id": "e", "remote_request_id": "r", "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.7",
              "remote_port": 5, "tp_size": 1, "transfer_id": "t", "remote_engine": "10.0.0.7:5", "mode": "pull"}
    out = nixl_fields_only(answer, "http://prefill-0:8000")
    assert out == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e",
                   "remote_request_id": "r", "remote_host": "10.0.0.7", "remote_port": 5, "tp_size": 1}
    assert http_host_for_remote_host(answer, "http://prefill-0:8000") == dict(out, remote_host="prefill-0")
