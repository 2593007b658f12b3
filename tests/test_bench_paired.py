"""bench/vllm_pd.py's comparisons, without vLLM: the median's distribution-free interval against a
reference computed from the binomial distribution by brute force, the per-prompt ratios and the goal's
verdict, and the runner's turns (the order, the shared prompts, an arm that fails) over stand-in arms."""
from __future__ import annotations

import os
import random
import re
import sys
from itertools import product
from types import SimpleNamespace

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
import paired  # noqa: E402
import vllm_pd  # noqa: E402


def _coverage(n: int, k: int) -> float:
    """P(x_(k) <= median < x_(n-k+1)) for a continuous distribution: the share of the 2^n sign patterns
    (each value below or above the true median) with at least k values on each side."""
    hits = sum(1 for signs in product((0, 1), repeat=n) if k <= sum(signs) <= n - k)
    return hits / 2 ** n


@pytest.mark.parametrize("n", [1, 5, 6, 7, 10, 16])
def test_the_median_interval_is_the_narrowest_order_statistics_that_cover_95_percent(n):
    xs = [float(v) for v in range(100, 100 + n)]
    random.Random(n).shuffle(xs)
    ci = paired.median_interval(xs)
    if n <= 5:  # even (min, max) covers 1 - 2 / 2^n < 95 %
        assert ci is None and _coverage(n, 1) < 0.95
        return
    k = int(ci[0]) - 100 + 1  # the interval is [x_(k), x_(n-k+1)]
    assert ci[1] == 100 + n - k
    assert _coverage(n, k) >= 0.95 > _coverage(n, k + 1)


def test_ratios_pair_rows_by_prompt_and_summary_splits_by_length():
    mono = [{"i": i, "words": w, "ttft_s": t} for i, w, t in ((0, 500, 2.0), (1, 900, 4.0), (2, 500, 2.0))]
    push = [{"i": 1, "words": 900, "ttft_s": 4.2}, {"i": 0, "words": 500, "ttft_s": 2.2},
            {"i": 3, "words": 900, "ttft_s": 9.0}]  # i = 3 has no mono partner
    r = paired.ratios(push, mono)
    assert sorted((p["i"], round(p["ratio"], 6)) for p in r) == [(0, 1.1), (1, 1.05)]
    s = paired.summary(r)
    assert s["n"] == 2 and s["ci"] is None and s["median"] == pytest.approx(1.075)
    assert s["by_words"] == {"500": {"n": 1, "median": pytest.approx(1.1)},
                             "900": {"n": 1, "median": pytest.approx(1.05)}}
    assert paired.summary([]) is None


@pytest.mark.parametrize("ratios, want", [
    ([1.00, 1.01, 1.02, 1.02, 1.03, 1.03, 1.04, 1.04], "met"),
    ([1.06, 1.07, 1.08, 1.08, 1.09, 1.10, 1.11, 1.12], "missed"),
    ([0.95, 0.98, 1.01, 1.03, 1.04, 1.07, 1.09, 1.12], "undecided"),
    ([1.02, 1.03], "met by the median only"),
    ([1.08, 1.09], "missed by the median only"),
])
def test_the_verdict_decides_only_when_the_interval_is_on_one_side(ratios, want):
    v = paired.verdict(paired.summary([{"i": i, "ratio": x} for i, x in enumerate(ratios)]), 1.05)
    assert v == want or v.startswith(want + " ") or v.startswith(want + ":"), v


class _Inst:
    def __init__(self, name):
        self.name, self.env = name, {}
        self.proc = SimpleNamespace(pid=os.getpid())

    def tail(self, n=20):
        return f"{self.name}'s log"


def _runner(requests=4, words="500,900"):
    args = SimpleNamespace(requests=requests, warmup=1, words=[int(w) for w in words.split(",")], gap_s=0.0,
                           out="", max_tokens=1)
    r = vllm_pd.Runner.__new__(vllm_pd.Runner)  # no output folder
    r.args, r.results, r.placement, r.fronts = args, {}, {}, {}
    return r


def test_arms_go_in_turns_pairs_share_prompts_and_a_failing_arm_leaves_the_rest(capsys):
    mono, p, d = _Inst("mono"), _Inst("p"), _Inst("d")
    calls = []

    def arm(name, fail_at=None):
        def one(i, prompt):
            calls.append((name, i, prompt))
            if i == fail_at:
                raise RuntimeError(f"{name} broke at {i}")
            return {"ttft_s": 1.0 + 0.01 * i, "prompt_tokens": len(prompt.split())}
        return one

    r = _runner()
    r._measure("g", {"mono": ({"mono": mono}, arm("mono")), "push": ({"p": p, "d": d}, arm("push")),
                     "pull": ({"p": p, "d": d}, arm("pull", fail_at=2))})
    measured = [(n, i) for n, i, _ in calls if i >= 0]
    # each round in a rotated order; pull leaves after its failure at round 2
    assert measured == [("mono", 0), ("push", 0), ("pull", 0), ("push", 1), ("pull", 1), ("mono", 1),
                        ("pull", 2), ("mono", 2), ("push", 2), ("push", 3), ("mono", 3)]
    prompts = {(n, i): pr for n, i, pr in calls}
    for i in range(4):  # mono and push share each prompt; pull, on push's instances, gets another
        assert prompts[("mono", i)] == prompts[("push", i)]
        if i < 3:
            assert prompts[("pull", i)] != prompts[("push", i)]
            strip = lambda s: re.sub(r"^\[[0-9a-f]+\] ", "", s)  # noqa: E731
            assert strip(prompts[("pull", i)]) == strip(prompts[("push", i)])
    assert [row["i"] for row in r.results["push"]] == [0, 1, 2, 3]
    assert [row["words"] for row in r.results["mono"]] == [500, 900, 500, 900]
    assert r.results["pull"]["failed"] == "RuntimeError: pull broke at 2" and "p_log" in r.results["pull"]
    assert set(r.placement["g"]) == {"mono", "p", "d"}
    summ = vllm_pd.summarize({"results": r.results})["summary"]
    assert summ["push"]["ttft_ms"]["median"] == pytest.approx(1015.0)


def test_the_push_goal_uses_the_per_prompt_ratio_and_its_interval():
    mono = [{"i": i, "words": 500, "ttft_s": 2.0 + 0.3 * (i % 3), "prompt_tokens": 560} for i in range(16)]
    push = [dict(m, ttft_s=m["ttft_s"] * 1.02) for m in mono]
    alone = [dict(m, ttft_s=m["ttft_s"] * 0.9) for m in mono]  # the prefill instance, by itself: faster
    doc = vllm_pd.summarize({"results": {"mono": mono, "hixl-push": push, "p-alone": alone}})
    g = next(g for g in doc["goals"] if "hixl proxy" in g["goal"])  # judged against mono, not p-alone
    assert g["status"] == "met" and g["ratio"] == pytest.approx(1.02) and g["pairs"] == 16
    assert g["ci"] == [pytest.approx(1.02), pytest.approx(1.02)]
    assert doc["summary"]["hixl-push"]["ttft_paired"]["p-alone"]["median"] == pytest.approx(1.02 / 0.9)
    lines = vllm_pd._paired_lines(doc["summary"])
    assert lines[0].startswith("hixl-push / mono TTFT per prompt, in turns: median 1.020, 95% interval")
    assert lines[1].startswith("hixl-push / p-alone TTFT per prompt, in turns: median 1.133, 95% interval")


def test_the_hybrid_rows_compare_ttft_and_kv_bytes_with_nixlconnector_and_report_bytes_by_kind():
    def rows(ttft, kv, kinds=None):
        return [{"i": i, "words": 500, "ttft_s": ttft, "prompt_tokens": 560, "kv_bytes": kv,
                 **({"kv_bytes_by_kind": kinds} if kinds else {})} for i in range(6)]
    mib = 2 ** 20
    res = {"swa-push": rows(0.1, 1.5 * mib, {"full": 0.75 * mib, "sliding": 0.75 * mib}),
           "swa-pull": rows(0.2, 1.5 * mib, {"full": 0.75 * mib, "sliding": 0.75 * mib}),
           "swa-nixl": rows(0.4, 1.5 * mib), "mla-push": rows(0.5, 3 * mib, {"mla": 3 * mib}),
           "mla-pull": {"failed": "RuntimeError: no"}, "mla-nixl": rows(0.4, 2 * mib)}
    doc = vllm_pd.summarize({"results": res})
    goals = {g["goal"]: g for g in doc["goals"]}
    assert goals["gemma3: hixl push TTFT <= NixlConnector's (median)"]["ratio"] == pytest.approx(0.25)
    assert goals["gemma3: hixl pull KV bytes per request <= NixlConnector's (median)"]["status"] == "met"
    assert goals["deepseek-v2: hixl push TTFT <= NixlConnector's (median)"]["status"] == "missed"
    assert goals["deepseek-v2: hixl push KV bytes per request <= NixlConnector's (median)"]["ratio"] == 1.5
    assert goals["deepseek-v2: hixl pull TTFT <= NixlConnector's (median)"]["status"].startswith("not measured")
    assert not any("hixl push vs NixlConnector" in g for g in goals)  # hixl-push was not asked for
    assert doc["summary"]["swa-push"]["kv_MiB_by_kind"] == {"full": 0.75, "sliding": 0.75}
    lines = vllm_pd._paired_lines(doc["summary"])
    assert any(x.startswith("swa-push / swa-nixl TTFT per prompt, one after the other: median 0.250") for x in lines)
    assert "swa-push KV per request by group kind [MiB, median]: full 0.75, sliding 0.75" in vllm_pd.table(
        dict(doc, placement={}))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell a binding from none")
def test_a_whole_process_instance_runs_every_process_on_its_cores(tmp_path):
    """``VllmInstance(whole_process=True)``: the instance's process, and what it starts, get only its
    cores (the bench's stand-in for a host per instance); without it they keep ours."""
    from hixl_tools.vllm_launch import VllmInstance

    probe = ("import os, subprocess, sys; print('parent', sorted(os.sched_getaffinity(0))); sys.stdout.flush(); "
             "subprocess.run([sys.executable, '-c', 'import os; print(\"child\", sorted(os.sched_getaffinity(0)))'])")
    cpu = min(os.sched_getaffinity(0))
    for whole, want in ((True, [cpu]), (False, sorted(os.sched_getaffinity(0)))):
        inst = VllmInstance(f"probe-{whole}", "none", cores=str(cpu), log_dir=str(tmp_path), whole_process=whole)
        inst.cmd = [sys.executable, "-c", probe]
        inst.start()
        assert inst.proc.wait(30) == 0
        inst.stop()
        log = inst.log_text()
        assert f"parent {want}" in log and f"child {want}" in log, log
    with pytest.raises(ValueError, match="whole_process needs cores"):
        VllmInstance("x", "none", whole_process=True)


def test_a_run_whose_every_arm_fails_records_each_and_ends():
    def broken(i, prompt):
        raise OSError("connection refused")

    r = _runner()
    r._measure("g", {"mono": ({"mono": _Inst("mono")}, broken), "push": ({"p": _Inst("p")}, broken)})
    assert r.results == {n: dict(r.results[n], failed="OSError: connection refused") for n in ("mono", "push")}
    assert r.placement["g"] == {}
