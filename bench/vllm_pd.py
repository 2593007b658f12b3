#!/usr/bin/env python3
"""vLLM prefill/decode disaggregation on this host, in one run: the same prompts through
(a) one vLLM instance (mono) and the prefill instance of (b) serving requests by itself (p-alone),
(b) 1P1D HixlConnector push (layer-wise, through ``hixl proxy``), (c) 1P1D HixlConnector pull, (d) 1P1D
vLLM's NixlConnector (nixl-cu12, UCX on loopback, pull, the flow of vLLM's own PD proxy: prefill, then
decode with the prefill's kv_transfer_params). On request (``--configs``,
``all``): HixlConnector push and pull behind ``vllm-router`` in its nixl mode (router-push, router-pull),
NixlConnector behind the same router (router-nixl), and P TP=2 -> D TP=1 (push through ``hixl proxy``) on
the tiny Llama of ``hixl model tiny-llama`` with a TP=1 instance of it as its reference (tp-mono, tp2-to-tp1).
``mla`` and ``swa`` (also in ``all``): the tiny DeepSeek-V2 (MLA) and Gemma 3 (sliding window + full
attention) models of ``hixl model tiny``, vLLM's hybrid KV cache manager on, behind ``vllm-router``:
HixlConnector push and pull (in turns) and NixlConnector, on the same prompts (``mla-push``, ``mla-pull``,
``mla-nixl``; ``swa-...``), with the KV bytes per request by KV cache group kind.

Reported per configuration (median, p99 over the measured requests): TTFT and TPOT (ms, from the client's
streamed chunks), TTFT relative to the reference instance measured in the same run, KV moved (MiB = 2^20 B,
per request), transfer time (ms) and, for hixl push, the part of it exposed after the prefill's last layer
and the share hidden behind prefill compute. Transfer figures come from the instances' own counters
(``vllm:hixl_*`` of the connector; ``vllm:nixl_*`` of NixlConnector), read before and after each request.
For mono and push through ``hixl proxy`` (and the TP row), the TTFT in parts (median, p99, ms): HTTP hops
and proxy, API server, queue / KV wait (push: the prefill's own prefill time, the exposed transfer and the
rest) and the first step, from the instances' vLLM histograms (``bench/vllm_ttft.py``). Where each
instance's threads ran (CPU affinity, CPU seconds per thread over the measurement) is in the
JSON, so a spinning progress thread shows. A configuration that fails records why; the others stand.

Requests go one at a time (TTFT without queueing); each prompt starts with a nonce (no prefix-cache hit).
Each instance runs, all its processes, on its own core (``--pin process``; ``omp`` binds only the OpenMP
threads, as the TP row does: its prefill needs both cores) and each request starts after a quiet pause
(``--gap-s``), so no other instance's busy-waiting shares the core of a measured prefill: the stand-in for
a host per instance that 2 cores allow.
The configurations that share a set of instances, or run beside their reference, are measured in turns
(request i of each before request i + 1 of any), so the host's drift falls on all of them alike; mono and
push (and the TP row and its reference) get the same prompts, and their TTFT ratio is also taken per prompt,
with a distribution-free 95 % interval for its median (``bench/paired.py``); ``p-alone``, the prefill
instance serving requests by itself, is push's second reference, free of the difference between two
instances' own speeds. Goals, from one run (evaluated,
printed, never an exit status): hixl push TTFT <= NixlConnector's, hixl push's exposed transfer time <= 0.5x
NixlConnector's transfer time, and behind vllm-router hixl TTFT (push, pull) <= NixlConnector's, as ratios
of medians; on the tiny MLA and sliding-window models, hixl's TTFT (push, pull) and KV bytes per request <=
NixlConnector's (ratios of medians; the TTFT also per prompt, the two measured one after the other); behind hixl proxy, push TTFT <= 1.05x one instance's, per prompt: met or missed when the
interval lies on one side of 1.05, undecided (more requests needed) when it spans it. The TP row reports
its ratio to one TP=1 instance without a goal: on a two-layer model the per-request costs that do not grow
with the model (two HTTP hops, the grant, the decoder's first step) are most of its TTFT.

Runs in the vLLM environment (``bash ci/install-vllm.sh VENV``; ``VENV/bin/python bench/vllm_pd.py``). Writes
``vllm_pd.json``, ``vllm_pd.txt`` and, with matplotlib (``--from-json`` on a host that has it),
``vllm_pd.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
import uuid
from typing import Any, Dict, List, Optional

import paired  # bench/, beside this script
import vllm_ttft

WORDS = ("river stone light north garden paper silver window market cloud music table orange engine winter "
         "bridge forest letter summer island doctor planet yellow camera").split()
MIB = float(2 ** 20)
ALL_CONFIGS = ("mono", "p-alone", "push", "pull", "nixl", "router-push", "router-pull", "router-nixl", "tp", "mla",
               "swa")
# the hybrid rows: configuration -> the architecture of ``hixl model tiny`` it runs
HYBRID = {"mla": "deepseek-v2", "swa": "gemma3"}
KINDS = ("full", "sliding", "mla", "mamba")
# (configuration, reference) measured in turns on prompts of the same length: their TTFT ratio per prompt.
# p-alone is the prefill instance serving a request by itself: push over it is free of the difference
# between two instances' own speeds, which the per-prompt interval does not cover.
PAIRED = (("hixl-push", "mono"), ("hixl-pull", "mono"), ("router-push", "mono"), ("router-pull", "mono"),
          ("tp2-to-tp1", "tp-mono"), ("hixl-push", "p-alone")) + tuple(
              (f"{tag}-{mode}", f"{tag}-nixl") for tag in HYBRID for mode in ("push", "pull"))
# pairs whose two sides run on instances that are not up at the same time: measured one after the other
# (the same prompts, i by i), not in turns
APART = {(f"{tag}-{mode}", f"{tag}-nixl") for tag in HYBRID for mode in ("push", "pull")}


def _pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1))))]


def _prompt(n_words: int, i: int) -> str:
    return f"[{uuid.uuid4().hex[:10]}] " + " ".join(WORDS[(i * 5 + k * (i % 7 + 1)) % len(WORDS)]
                                                     for k in range(n_words)) + ". Summarize it:"


def stream(url: str, body: Dict[str, Any], timeout: float = 600.0) -> Dict[str, Any]:
    """Streams a completion; returns TTFT, TPOT, the text and the usage."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    t0 = time.monotonic()
    times, text, usage = [], [], {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                usage = d["usage"]
            for c in d.get("choices", []):
                if c.get("text"):
                    times.append(time.monotonic())
                    text.append(c["text"])
    if not times:
        raise RuntimeError(f"no token streamed from {url}")
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"ttft_s": ttft, "tpot_s": tpot, "text": "".join(text), "usage": usage, "e2e_s": times[-1] - t0}


def _m(inst, name: str) -> float:
    return inst.metrics().get(name, 0.0)


def _threads(pgid_root: int) -> Dict[str, Any]:
    """Every thread of the process group led by ``pgid_root``: name, allowed CPUs, CPU seconds so far."""
    hz = os.sysconf("SC_CLK_TCK")
    out: Dict[str, Any] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            if int(st[2]) != pgid_root:  # field 5: pgrp
                continue
            with open(f"/proc/{pid}/comm") as f:
                pname = f.read().strip()
            for tid in os.listdir(f"/proc/{pid}/task"):
                base = f"/proc/{pid}/task/{tid}"
                with open(base + "/stat") as f:
                    ts = f.read().rsplit(")", 1)[1].split()
                with open(base + "/comm") as f:
                    tname = f.read().strip()
                cpus = ""
                with open(base + "/status") as f:
                    for line in f:
                        if line.startswith("Cpus_allowed_list"):
                            cpus = line.split()[1]
                out[f"{pid}/{tid}"] = {"process": pname, "thread": tname, "cpus": cpus,
                                       "cpu_s": (int(ts[11]) + int(ts[12])) / hz}
        except (OSError, IndexError, ValueError):
            continue
    return out


def _thread_report(before: Dict[str, Any], after: Dict[str, Any], wall_s: float) -> List[Dict[str, Any]]:
    """Threads by CPU use over the interval, grouped by (process, thread name, CPUs)."""
    groups: Dict[tuple, Dict[str, Any]] = {}
    for k, a in after.items():
        b = before.get(k, {"cpu_s": 0.0})
        key = (a["process"], a["thread"], a["cpus"])
        g = groups.setdefault(key, {"process": a["process"], "thread": a["thread"], "cpus": a["cpus"], "n": 0,
                                    "cpu_s": 0.0})
        g["n"] += 1
        g["cpu_s"] += a["cpu_s"] - b["cpu_s"]
    rows = sorted(groups.values(), key=lambda g: -g["cpu_s"])
    for g in rows:
        g["cpu_s"] = round(g["cpu_s"], 3)
        g["core_share"] = round(g["cpu_s"] / wall_s, 3) if wall_s > 0 else 0.0
    return [g for g in rows if g["cpu_s"] > 0.01][:12]


# ------------------------------------------------------------------------------------ configurations
class Runner:
    def __init__(self, args):
        self.args = args
        self.out = args.out
        os.makedirs(self.out, exist_ok=True)
        self.logs = os.path.join(self.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.results: Dict[str, Any] = {}
        self.placement: Dict[str, Any] = {}
        self.fronts: Dict[str, Any] = {}  # configuration -> the proxy or router in front of it

    def _measure(self, group: str, arms: Dict[str, Any]) -> None:
        """Warm-up, then the measured requests of every arm in ``arms`` (name -> (instances, ``one``)), in
        turns: request ``i`` of each arm before request ``i + 1`` of any, the arms' order rotating, so a
        drift of the host's speed falls on all of them alike. ``one(i, prompt)`` returns a row. Arms on
        instances of their own get the same prompt for ``i`` (their TTFTs pair up); an arm on instances that
        already saw it gets the same words under a fresh nonce (no prefix-cache hit). An arm that raises
        records why and leaves the turns; the others go on."""
        a = self.args
        live = dict(arms)
        for name, (_, one) in list(live.items()):
            try:
                for w in range(a.warmup):
                    time.sleep(a.gap_s)
                    one(-1 - w, _prompt(a.words[w % len(a.words)], 1000 + w))
            except Exception as e:
                self._failed(name, live.pop(name), e)
        insts = {k: v for _, (ii, _) in live.items() for k, v in ii.items()}
        t_before = {k: _threads(v.proc.pid) for k, v in insts.items()}
        t0 = time.monotonic()
        rows: Dict[str, List[Dict[str, Any]]] = {n: [] for n in live}
        for i in range(a.requests):
            if not live:  # every arm failed
                break
            words = a.words[i % len(a.words)]
            base, seen, prompts = _prompt(words, i), set(), {}
            for name, (ii, _) in live.items():  # the first arm on a set of instances gets the shared prompt
                prompts[name] = _prompt(words, i) if seen & set(ii) else base
                seen |= set(ii)
            names = list(live)
            for name in names[i % len(names):] + names[:i % len(names)]:
                time.sleep(a.gap_s)  # the last request's spinners go idle first (see --gap-s)
                try:
                    row = live[name][1](i, prompts[name])
                except Exception as e:
                    self._failed(name, live.pop(name), e)
                    continue
                rows[name].append(dict(row, i=i, words=words))
                print(f"  {name} {i + 1}/{a.requests}: TTFT {row['ttft_s'] * 1e3:.0f} ms, prompt "
                      f"{row['prompt_tokens']} tokens, KV {row.get('kv_bytes', 0) / MIB:.1f} MiB, "
                      f"transfer {row.get('transfer_s', 0) * 1e3:.1f} ms", flush=True)
        wall = time.monotonic() - t0
        self.placement[group] = {k: {"env": {e: v.env.get(e) for e in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
                                                                     "UCX_TLS") if v.env.get(e) is not None},
                                     "threads": _thread_report(t_before[k], _threads(v.proc.pid), wall)}
                                 for k, v in insts.items()}
        for name in live:
            self.results[name] = rows[name]

    def _failed(self, name: str, arm, e: Exception) -> None:
        """A configuration that failed: why, and the tails of its instances' (and front's) logs."""
        insts = arm[0]
        self.results[name] = dict({"failed": f"{type(e).__name__}: {e}"},
                                  **{f"{k}_log": v.tail(20) for k, v in insts.items()})
        front = self.fronts.get(name)
        if front is not None:
            self.results[name]["front_log"] = front.tail(20)
        print(f"{name}: failed:", e, flush=True)

    def _settle(self, fn, want, timeout=20.0):
        deadline = time.monotonic() + timeout
        while True:
            v = fn()
            if want(v) or time.monotonic() > deadline:
                return v
            time.sleep(0.05)

    def _pd_row(self, p, d, url: str, mode: str, prompt: str, parts: bool = False) -> Dict[str, Any]:
        """One request through ``url`` (a proxy or router before ``p`` and ``d``, HixlConnector), with the
        instances' counters: KV moved, transfer time and (push) the part exposed after the prefill;
        ``parts``: its TTFT in parts (``vllm_ttft``; push through hixl proxy, both dispatched at once)."""
        a = self.args
        h0 = {"p": vllm_ttft.snapshot(p), "d": vllm_ttft.snapshot(d)} if parts else None
        p0 = {k: _m(p, k) for k in ("vllm:hixl_kv_sent_requests_total", "vllm:hixl_kv_transfer_seconds_total",
                                    "vllm:hixl_kv_exposed_transfer_seconds_total", "vllm:hixl_kv_sent_descriptors_total")}
        by_kind = [f'vllm:hixl_kv_received_bytes_by_kind_total{{kind="{k}"}}' for k in KINDS]
        d0 = {k: _m(d, k) for k in ("vllm:hixl_kv_received_requests_total", "vllm:hixl_kv_received_bytes_total",
                                    "vllm:hixl_kv_wait_seconds_sum", "vllm:hixl_kv_received_tokens_total", *by_kind)}
        r = stream(url, {"model": "smollm2", "prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0})
        dd = self._settle(lambda: {k: _m(d, k) - v for k, v in d0.items()},
                          lambda x: x["vllm:hixl_kv_received_requests_total"] >= 1)
        row = {"ttft_s": r["ttft_s"], "tpot_s": r["tpot_s"], "prompt_tokens": r["usage"].get("prompt_tokens"),
               "kv_bytes": dd["vllm:hixl_kv_received_bytes_total"], "kv_tokens": dd["vllm:hixl_kv_received_tokens_total"],
               "wait_s": dd["vllm:hixl_kv_wait_seconds_sum"],
               "kv_bytes_by_kind": {k: dd[n] for k, n in zip(KINDS, by_kind) if dd[n]}}
        if mode == "push":
            pd = self._settle(lambda: {k: _m(p, k) - v for k, v in p0.items()},
                              lambda x: x["vllm:hixl_kv_sent_requests_total"] >= 1)
            busy = pd["vllm:hixl_kv_transfer_seconds_total"]
            row.update(transfer_s=busy, exposed_s=pd["vllm:hixl_kv_exposed_transfer_seconds_total"],
                       descriptors=pd["vllm:hixl_kv_sent_descriptors_total"])
            row["hidden_share"] = 1.0 - row["exposed_s"] / busy if busy > 0 else None
            if h0 is not None:
                row["engine_s"] = {k: vllm_ttft.engine_times(i, h0[k], self._settle) for k, i in (("p", p), ("d", d))}
                row["parts_s"] = vllm_ttft.parts(row["ttft_s"], row["engine_s"]["d"], row["engine_s"]["p"],
                                                 row["exposed_s"], row["wait_s"])
        else:  # the read is the decoder's: all of it after the prefill
            row.update(transfer_s=row["wait_s"], exposed_s=row["wait_s"])
        return row

    def _mono_arm(self, ref):
        """One instance, no connector: its rows carry its TTFT in parts."""
        a = self.args

        def one_mono(i, prompt):
            h0 = vllm_ttft.snapshot(ref)
            r = stream(ref.url, {"model": "smollm2", "prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0})
            own = vllm_ttft.engine_times(ref, h0, self._settle)
            return {"ttft_s": r["ttft_s"], "tpot_s": r["tpot_s"], "prompt_tokens": r["usage"].get("prompt_tokens"),
                    "engine_s": {"mono": own}, "parts_s": vllm_ttft.parts(r["ttft_s"], own)}
        return {ref.name: ref}, one_mono

    def _hixl_arm(self, name: str, front, p, d, mode: str, what: str, parts: bool = False):
        """HixlConnector ``mode`` through ``front`` (a ProxyProcess or RouterProcess)."""
        def one(i, prompt):
            return self._pd_row(p, d, front.url, mode, prompt, parts)
        return self._front_arm(name, front, (p, d), one, what)

    def _front_arm(self, name: str, front, insts, one, what: str):
        """The arm ``one`` on ``insts`` behind ``front``, started here; None (the failure recorded) when
        it does not start. ``_run_arms`` stops it either way."""
        print(f"{name}: {what}", flush=True)
        arm = ({i.name: i for i in insts}, one)
        self.fronts[name] = front
        try:
            front.start()
        except Exception as e:
            self._failed(name, arm, e)
            return None
        return arm

    def _run_arms(self, group: str, arms: Dict[str, Any]) -> None:
        """Measures the arms that started, in turns, then stops their fronts."""
        try:
            self._measure(group, {k: v for k, v in arms.items() if v is not None})
        finally:
            for name in arms:
                front = self.fronts.get(name)
                if front is not None and getattr(front, "proc", None) is not None:
                    front.stop()

    def run_hixl(self, model: str) -> None:
        from hixl_tools.vllm_launch import ProxyProcess, RouterProcess, VllmInstance, serving

        a, logs = self.args, self.logs
        own = dict(log_dir=logs, whole_process=a.pin == "process")
        ref = VllmInstance("mono", model, cores="0", **own)
        p = VllmInstance("hixl-p", model, role="kv_producer", cores="0", **own)
        d = VllmInstance("hixl-d", model, role="kv_consumer", cores="1", **own)
        insts = [ref, p, d]
        if "router-pull" in a.configs:  # a prefill whose answers say pull (vllm-router forwards them as they are)
            insts.append(VllmInstance("hixl-p-pull", model, role="kv_producer", cores="0",
                                      env={"HIXL_VLLM_MODE": "pull"}, **own))
        with serving(insts, timeout=900):
            arms: Dict[str, Any] = {}
            if "mono" in a.configs:
                print("mono: one vLLM instance, no connector", flush=True)
                arms["mono"] = self._mono_arm(ref)
            for mode in ("push", "pull"):
                if mode in a.configs:
                    arms[f"hixl-{mode}"] = self._hixl_arm(
                        f"hixl-{mode}", ProxyProcess([p.url], [d.url], log_dir=logs, name=f"proxy-{mode}",
                                                     args=["--mode", mode]),
                        p, d, mode, f"1P1D HixlConnector through hixl proxy --mode {mode}", parts=mode == "push")
            for mode, pre in (("push", p), ("pull", insts[-1])):
                if f"router-{mode}" in a.configs:
                    arms[f"router-{mode}"] = self._hixl_arm(
                        f"router-{mode}", RouterProcess([(pre.url, None)], [d.url], log_dir=logs,
                                                        name=f"router-{mode}"),
                        pre, d, mode, f"1P1D HixlConnector ({mode}) behind vllm-router, nixl mode")
            if "p-alone" in a.configs:  # last: the arms before it on the prefill have the shared prompts
                print("p-alone: the prefill instance serving requests by itself (no transfer)", flush=True)
                arms["p-alone"] = self._mono_arm(p)
            self._run_arms("hixl", arms)

    def _nixl_row(self, d, url: str, prompt: str, prefill_url: Optional[str] = None) -> Dict[str, Any]:
        """One request, NixlConnector: through a router at ``url``, or (``prefill_url``) the two hops of
        vLLM's PD proxy made here (prefill, then the decoder with the prefill's kv_transfer_params)."""
        a = self.args
        d0 = {k: _m(d, k) for k in ("vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_bytes_transferred_sum",
                                    "vllm:nixl_xfer_time_seconds_count")}
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0}
        t_p = 0.0
        if prefill_url is not None:
            t0 = time.monotonic()
            first = dict(body, max_tokens=1, stream=False, kv_transfer_params={
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None})
            req = urllib.request.Request(prefill_url + "/v1/completions", json.dumps(first).encode(),
                                         {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                body["kv_transfer_params"] = json.load(r)["kv_transfer_params"]
            t_p = time.monotonic() - t0
        r = stream(url, body)
        dd = self._settle(lambda: {k: _m(d, k) - v for k, v in d0.items()},
                          lambda x: x["vllm:nixl_xfer_time_seconds_count"] >= 1)
        return {"ttft_s": t_p + r["ttft_s"], "tpot_s": r["tpot_s"], "prompt_tokens": r["usage"].get("prompt_tokens"),
                "kv_bytes": dd["vllm:nixl_bytes_transferred_sum"], "transfer_s": dd["vllm:nixl_xfer_time_seconds_sum"],
                "exposed_s": dd["vllm:nixl_xfer_time_seconds_sum"], "prefill_call_s": t_p}

    def run_nixl(self, model: str) -> None:
        from hixl_tools.vllm_launch import RouterProcess, VllmInstance, serving

        a = self.args
        names = [n for n in ("nixl", "router-nixl") if n in a.configs]
        try:
            import nixl._api  # noqa: F401
        except ImportError as e:
            for n in names:
                self.results[n] = {"skipped": f"NIXL does not import here ({e}): pip install --no-deps "
                                              "nixl==1.5.1 nixl-cu12==1.5.1"}
            print("nixl: skipped:", self.results[names[0]]["skipped"], flush=True)
            return
        kw = dict(connector="NixlConnector", log_dir=self.logs,  # KV buffer on the CPU, UCX on loopback
                  whole_process=a.pin == "process")
        p = VllmInstance("nixl-p", model, role="kv_producer", cores="0",
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(a.nixl_port)}, **kw)
        d = VllmInstance("nixl-d", model, role="kv_consumer", cores="1",
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(a.nixl_port + 50)}, **kw)
        with serving((p, d), timeout=900):
            arms: Dict[str, Any] = {}
            insts = {p.name: p, d.name: d}
            if "nixl" in names:
                print("nixl: 1P1D NixlConnector (pull, UCX), the flow of vLLM's PD proxy", flush=True)
                arms["nixl"] = (insts, lambda i, prompt: self._nixl_row(d, d.url, prompt, prefill_url=p.url))
            if "router-nixl" in names:
                router = RouterProcess([(p.url, None)], [d.url], log_dir=self.logs, name="router-nixl")
                arms["router-nixl"] = self._front_arm("router-nixl", router, (p, d),
                                                      lambda i, prompt: self._nixl_row(d, router.url, prompt),
                                                      "1P1D NixlConnector behind vllm-router, nixl mode")
            self._run_arms("nixl", arms)

    def run_hybrid(self, tag: str, model: str) -> None:
        """The tiny ``HYBRID[tag]`` model behind vllm-router: HixlConnector push and pull (in turns), then
        NixlConnector, on the same prompts; vLLM's hybrid KV cache manager on for both connectors."""
        from hixl_tools.vllm_launch import RouterProcess, VllmInstance

        a, logs = self.args, self.logs
        own = dict(log_dir=logs, whole_process=a.pin == "process")
        p = VllmInstance(f"{tag}-p", model, role="kv_producer", cores="0", **own)
        pp = VllmInstance(f"{tag}-p-pull", model, role="kv_producer", cores="0", env={"HIXL_VLLM_MODE": "pull"}, **own)
        d = VllmInstance(f"{tag}-d", model, role="kv_consumer", cores="1", **own)
        self._with_instances([p, pp, d], [f"{tag}-push", f"{tag}-pull"], lambda: self._run_arms(f"{tag}-hixl", {
            f"{tag}-{mode}": self._hixl_arm(f"{tag}-{mode}", RouterProcess([(pre.url, None)], [d.url], log_dir=logs,
                                                                           name=f"router-{tag}-{mode}"),
                                            pre, d, mode, f"{HYBRID[tag]}: HixlConnector ({mode}) behind vllm-router")
            for mode, pre in (("push", p), ("pull", pp))}))
        kw = dict(own, connector="NixlConnector")
        p = VllmInstance(f"{tag}-nixl-p", model, role="kv_producer", cores="0",
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(a.nixl_port + 100)}, **kw)
        d = VllmInstance(f"{tag}-nixl-d", model, role="kv_consumer", cores="1",
                         env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(a.nixl_port + 150)}, **kw)
        router = RouterProcess([(p.url, None)], [d.url], log_dir=logs, name=f"router-{tag}-nixl")
        self._with_instances([p, d], [f"{tag}-nixl"], lambda: self._run_arms(f"{tag}-nixl", {
            f"{tag}-nixl": self._front_arm(f"{tag}-nixl", router, (p, d),
                                           lambda i, prompt: self._nixl_row(d, router.url, prompt),
                                           f"{HYBRID[tag]}: NixlConnector behind vllm-router")}))

    def _with_instances(self, insts, names: List[str], run) -> None:
        """Starts ``insts``, runs ``run()`` once they serve, stops them; when they do not start, the
        configurations ``names`` record why."""
        from hixl_tools.vllm_launch import serving

        try:
            with serving(insts, timeout=900):
                run()
        except Exception as e:
            for name in names:
                self.results.setdefault(name, dict({"failed": f"{type(e).__name__}: {e}"},
                                                   **{f"{i.name}_log": i.tail(20) for i in insts}))
            print(f"{', '.join(names)}: failed:", e, flush=True)

    def run_tp(self, tiny: str) -> None:
        """TP=2 -> TP=1 on the tiny Llama (SmolLM2's heads do not divide by 2), push through hixl proxy,
        with a TP=1 instance of the same model as its reference."""
        from hixl_tools.vllm_launch import ProxyProcess, VllmInstance, serving

        # The TP=2 prefill needs both cores, so the decoder shares one with it whatever --pin says: bound
        # whole to that core, the decoder's threads waited out the prefill rank's busy-wait after each
        # step (~1 s) in most requests; with only the OpenMP threads bound, the rest can move.
        logs = self.logs
        ref = VllmInstance("tp-mono", tiny, cores="1", log_dir=logs)
        p = VllmInstance("tp2-p", tiny, role="kv_producer", tp=2, log_dir=logs)  # a core per rank
        d = VllmInstance("tp1-d", tiny, role="kv_consumer", cores="1", log_dir=logs)
        try:
            with serving((ref, p, d), timeout=900):
                print("tp-mono: one TP=1 instance of the tiny Llama, no connector", flush=True)
                self._run_arms("tp", {"tp-mono": self._mono_arm(ref), "tp2-to-tp1": self._hixl_arm(
                    "tp2-to-tp1", ProxyProcess([p.url], [d.url], log_dir=logs, name="proxy-tp",
                                               args=["--mode", "push"]),
                    p, d, "push", "P TP=2 -> D TP=1, HixlConnector push through hixl proxy", parts=True)})
        except Exception as e:
            self.results["tp2-to-tp1"] = {"failed": f"{type(e).__name__}: {e}", "prefill_log": p.tail(30)}
            print("tp2-to-tp1: failed:", e, flush=True)


# ------------------------------------------------------------------------------------ report
def summarize(doc: Dict[str, Any]) -> Dict[str, Any]:
    summ: Dict[str, Any] = {}
    for name, rows in doc["results"].items():
        if not isinstance(rows, list) or not rows:
            summ[name] = rows
            continue
        s: Dict[str, Any] = {"requests": len(rows)}
        for k, scale in (("ttft_s", 1e3), ("tpot_s", 1e3), ("transfer_s", 1e3), ("exposed_s", 1e3)):
            xs = [r[k] * scale for r in rows if r.get(k) is not None]
            if xs:
                s[k.replace("_s", "_ms")] = {"median": statistics.median(xs), "p99": _pct(xs, 99)}
        xs = [r["kv_bytes"] / MIB for r in rows if r.get("kv_bytes")]
        if xs:
            s["kv_MiB"] = {"median": statistics.median(xs), "p99": _pct(xs, 99)}
        xs = [r["hidden_share"] for r in rows if r.get("hidden_share") is not None]
        if xs:
            s["hidden_share"] = {"median": statistics.median(xs), "p99": _pct(xs, 99)}
        kinds = sorted({k for r in rows for k in r.get("kv_bytes_by_kind") or {}})
        if kinds:  # a hybrid model's bytes per request, by KV cache group kind
            s["kv_MiB_by_kind"] = {k: statistics.median([(r.get("kv_bytes_by_kind") or {}).get(k, 0) / MIB
                                                         for r in rows]) for k in kinds}
        s["prompt_tokens"] = {"median": statistics.median([r["prompt_tokens"] or 0 for r in rows])}
        s["ttft_parts_ms"] = vllm_ttft.summarize(rows)
        summ[name] = s
    for name, s in summ.items():  # TTFT against the reference measured in this run (tp rows: tp-mono)
        base = summ.get("tp-mono" if name.startswith("tp") else "mono")
        if isinstance(s, dict) and "ttft_ms" in s and isinstance(base, dict) and "ttft_ms" in base:
            s["ttft_vs_mono"] = {q: s["ttft_ms"][q] / base["ttft_ms"][q] for q in ("median", "p99")}
            if s.get("ttft_parts_ms") and base.get("ttft_parts_ms") and s is not base:
                s["ttft_parts_gap_ms"] = vllm_ttft.gap(s["ttft_parts_ms"], base["ttft_parts_ms"])
                s["ttft_parts_gap_ms_ref"] = "tp-mono" if name.startswith("tp") else "mono"
    for name, ref in PAIRED:  # the same prompts, in turns: TTFT ratio per prompt
        rows, base = doc["results"].get(name), doc["results"].get(ref)
        if isinstance(rows, list) and isinstance(base, list) and isinstance(summ.get(name), dict):
            pp = paired.summary(paired.ratios(rows, base))
            if pp:
                summ[name].setdefault("ttft_paired", {})[ref] = dict(pp, in_turns=(name, ref) not in APART)
    goals = _ratio_goals(summ)
    push, nixl = summ.get("hixl-push"), summ.get("nixl")
    if push is None:  # not asked for
        pass
    elif isinstance(push, dict) and isinstance(nixl, dict) and "ttft_ms" in push and "ttft_ms" in nixl:
        r = push["ttft_ms"]["median"] / nixl["ttft_ms"]["median"]
        goals.append({"goal": "hixl push TTFT <= NixlConnector TTFT (median)", "ratio": r,
                      "status": "met" if r <= 1.0 else "missed"})
        if "exposed_ms" in push and "transfer_ms" in nixl and nixl["transfer_ms"]["median"] > 0:
            r = push["exposed_ms"]["median"] / nixl["transfer_ms"]["median"]
            goals.append({"goal": "hixl push exposed transfer <= 0.5x NixlConnector transfer time (median)",
                          "ratio": r, "status": "met" if r <= 0.5 else "missed"})
    else:
        why = (nixl or {}).get("skipped") or (nixl or {}).get("failed") or "not measured"
        goals.append({"goal": "hixl push vs NixlConnector (TTFT, exposed transfer)", "status": f"not measured: {why}"})
    return {"summary": summ, "goals": goals}


def _ratio_goal(summ: Dict[str, Any], goal: str, num: str, den: str, limit: float) -> Optional[Dict[str, Any]]:
    """``num``'s median TTFT / ``den``'s <= ``limit``; None when neither row was asked for."""
    a, b = summ.get(num), summ.get(den)
    if a is None:  # not asked for
        return None
    if isinstance(a, dict) and isinstance(b, dict) and "ttft_ms" in a and "ttft_ms" in b:
        r = a["ttft_ms"]["median"] / b["ttft_ms"]["median"]
        return {"goal": goal, "ratio": r, "status": "met" if r <= limit else "missed"}
    why = "; ".join(f"{k}: {(v or {}).get('skipped') or (v or {}).get('failed') or 'not measured'}"
                    for k, v in ((num, a), (den, b)) if not (isinstance(v, dict) and "ttft_ms" in v))
    return {"goal": goal, "status": f"not measured: {why}"}


def _paired_goal(summ: Dict[str, Any], goal: str, num: str, limit: float) -> Optional[Dict[str, Any]]:
    """``num``'s TTFT over its reference's, per prompt (measured in turns): met or missed when the
    median ratio's 95 % interval lies on one side of ``limit``, undecided otherwise."""
    ref = next(r for n, r in PAIRED if n == num)  # the first listed: one instance without a connector
    g = _ratio_goal(summ, goal, num, ref, limit)
    pp = (summ[num].get("ttft_paired") or {}).get(ref) if isinstance(summ.get(num), dict) else None
    if g is None or pp is None:
        return g
    g.update(ratio_of_medians=g.pop("ratio"), ratio=pp["median"], ci=pp["ci"], pairs=pp["n"],
             status=paired.verdict(pp, limit))
    return g


def _kv_goal(summ: Dict[str, Any], goal: str, num: str, den: str) -> Optional[Dict[str, Any]]:
    """``num``'s median KV bytes per request / ``den``'s <= 1; None when ``num`` was not asked for."""
    a, b = summ.get(num), summ.get(den)
    if a is None:
        return None
    if isinstance(a, dict) and isinstance(b, dict) and "kv_MiB" in a and "kv_MiB" in b:
        r = a["kv_MiB"]["median"] / b["kv_MiB"]["median"]
        return {"goal": goal, "ratio": r, "status": "met" if r <= 1.0 else "missed"}
    return {"goal": goal, "status": "not measured: " + "; ".join(
        f"{k}: {(v or {}).get('skipped') or (v or {}).get('failed') or 'no KV bytes'}" for k, v in ((num, a), (den, b))
        if not (isinstance(v, dict) and "kv_MiB" in v))}


def _hybrid_goals(summ: Dict[str, Any]) -> List[Optional[Dict[str, Any]]]:
    """On the tiny MLA and sliding-window models: hixl's TTFT and KV bytes per request <= NixlConnector's."""
    out: List[Optional[Dict[str, Any]]] = []
    for tag, arch in HYBRID.items():
        for mode in ("push", "pull"):
            out.append(_ratio_goal(summ, f"{arch}: hixl {mode} TTFT <= NixlConnector's (median)", f"{tag}-{mode}",
                                   f"{tag}-nixl", 1.0))
            out.append(_kv_goal(summ, f"{arch}: hixl {mode} KV bytes per request <= NixlConnector's (median)",
                                f"{tag}-{mode}", f"{tag}-nixl"))
    return out


def _ratio_goals(summ: Dict[str, Any]) -> List[Dict[str, Any]]:
    goals = _hybrid_goals(summ) + [_ratio_goal(summ, "behind vllm-router, hixl push TTFT <= NixlConnector's (median)", "router-push",
                         "router-nixl", 1.0),
             _ratio_goal(summ, "behind vllm-router, hixl pull TTFT <= NixlConnector's (median)", "router-pull",
                         "router-nixl", 1.0),
             _paired_goal(summ, "behind hixl proxy, push TTFT <= 1.05x one instance's (median per prompt)",
                          "hixl-push", 1.05)]
    return [g for g in goals if g is not None]


def table(doc: Dict[str, Any]) -> str:
    cols = [("TTFT med [ms]", "ttft_ms", "median"), ("TTFT p99 [ms]", "ttft_ms", "p99"),
            ("TTFT/mono med", "ttft_vs_mono", "median"),
            ("TPOT med [ms]", "tpot_ms", "median"), ("TPOT p99 [ms]", "tpot_ms", "p99"),
            ("KV/req [MiB]", "kv_MiB", "median"), ("xfer med [ms]", "transfer_ms", "median"),
            ("xfer p99 [ms]", "transfer_ms", "p99"), ("exposed med [ms]", "exposed_ms", "median"),
            ("hidden med [%]", "hidden_share", "median")]
    lines = ["config       reqs  prompt[tok] " + " ".join(f"{c[0]:>16}" for c in cols)]
    for name, s in doc["summary"].items():
        if not isinstance(s, dict) or "requests" not in s:
            lines.append(f"{name:<12} {json.dumps(s)[:200]}")
            continue
        vals = []
        for _, key, q in cols:
            v = s.get(key, {}).get(q)
            vals.append("-" if v is None else (f"{v * 100:.1f}" if key == "hidden_share" else
                                               f"{v:.3f}" if key == "ttft_vs_mono" else f"{v:.1f}"))
        lines.append(f"{name:<12} {s['requests']:>4}  {s['prompt_tokens']['median']:>11.0f} " +
                     " ".join(f"{v:>16}" for v in vals))
    for name, s in doc["summary"].items():
        if isinstance(s, dict) and s.get("kv_MiB_by_kind"):
            lines.append(f"{name} KV per request by group kind [MiB, median]: " +
                         ", ".join(f"{k} {v:.2f}" for k, v in s["kv_MiB_by_kind"].items()))
    lines.append("")
    parts = vllm_ttft.table_lines(doc["summary"])
    lines += parts + [""] if parts else []
    lines += _paired_lines(doc["summary"])
    for g in doc["goals"]:
        lines.append(f"goal: {g['goal']}: {g['status']}" + (f" (ratio {g['ratio']:.3f})" if "ratio" in g else ""))
    lines.append("")
    lines.append("threads (CPU seconds over the measured requests, share of one core, allowed CPUs):")
    for cfg, insts in doc.get("placement", {}).items():
        for inst, p in insts.items():
            env = " ".join(f"{k}={v}" for k, v in p["env"].items())
            top = ", ".join(f"{t['process']}/{t['thread']} x{t['n']} cpus {t['cpus']}: {t['core_share']:.2f}"
                            for t in p["threads"][:5])
            lines.append(f"  {cfg:<10} {inst:<8} [{env}] {top}")
    return "\n".join(lines)


def _paired_lines(summary: Dict[str, Any]) -> List[str]:
    """TTFT over the reference's per prompt (the two measured in turns): median, interval, per length."""
    lines = []
    for name, s in summary.items():
        for ref, pp in ((s.get("ttft_paired") or {}) if isinstance(s, dict) else {}).items():
            ci = (f"{pp['level']:.0%} interval [{pp['ci'][0]:.3f}, {pp['ci'][1]:.3f}]" if pp["ci"] else
                  "too few for an interval")
            by = "; ".join(f"{w} words: {v['median']:.3f} ({v['n']})" for w, v in (pp.get("by_words") or {}).items())
            how = "in turns" if pp.get("in_turns", True) else "one after the other"
            lines.append(f"{name} / {ref} TTFT per prompt, {how}: median {pp['median']:.3f}, {ci}, "
                         f"{pp['n']} prompts" + (f"; by length: {by}" if by else ""))
    return lines + [""] if lines else []


def plot(doc: Dict[str, Any], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [n for n, s in doc["summary"].items() if isinstance(s, dict) and "ttft_ms" in s]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for k, (key, title) in enumerate((("ttft_ms", "TTFT [ms]"), ("transfer_ms", "KV transfer [ms]"))):
        med = [doc["summary"][n].get(key, {}).get("median") or 0 for n in names]
        p99 = [doc["summary"][n].get(key, {}).get("p99") or 0 for n in names]
        ax[k].bar(names, med, label="median")
        ax[k].scatter(names, p99, color="k", marker="_", s=300, label="p99")
        if key == "transfer_ms":
            exp = [doc["summary"][n].get("exposed_ms", {}).get("median") or 0 for n in names]
            ax[k].bar(names, exp, color="tab:red", alpha=0.6, label="exposed (median)")
        ax[k].set_title(title)
        ax[k].legend()
    fig.suptitle(f"vLLM PD on this host, {doc['args']['requests']} requests each")
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="SmolLM2 in HF format (default: hixl model export into ~/.cache/hixl/smollm2-hf)")
    ap.add_argument("--out", default="bench/results/vllm_pd", help="output folder")
    ap.add_argument("--requests", type=int, default=16,
                    help="measured requests per configuration (16: a 95 %% interval for the per-prompt ratio "
                         "between the 4th and the 13th of its values)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--words", default="500,900", help="prompt lengths in words, cycled (about 1.1 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--configs", default="mono,p-alone,push,pull,nixl",
                    help=f"comma-separated, or 'all' ({','.join(ALL_CONFIGS)}): router-* put vllm-router (nixl mode) "
                         "in front; tp is P TP=2 -> D TP=1 on the tiny Llama (hixl model tiny-llama)")
    ap.add_argument("--tiny-model", help="the tiny Llama for the tp row (default: hixl model tiny-llama into "
                                         "~/.cache/hixl/tiny-llama)")
    ap.add_argument("--nixl-port", type=int, default=5600)
    ap.add_argument("--gap-s", type=float, default=1.5,
                    help="pause before each request: vLLM's workers and engine cores busy-wait (sched_yield) for "
                         "1 s after their last message, and on a shared core the last request's instance would "
                         "slow the next one's prefill (by ~15%% at 500 words, measured here)")
    ap.add_argument("--pin", choices=("process", "omp"), default="process",
                    help="process: each instance's every process on its core, as if on a host of its own (a "
                         "decoder's vLLM engine core steps while its request waits for KV; unbound, it takes time "
                         "from the prefill's core); omp: only the OpenMP threads, as the e2e tests run them")
    ap.add_argument("--from-json", help="redraw the report and plot of an earlier run")
    a = ap.parse_args(argv)
    if a.from_json:
        with open(a.from_json) as f:
            doc = json.load(f)
        base = os.path.splitext(a.from_json)[0]
        print(table(doc))
        print("plot:", base + ".png" if plot(doc, base + ".png") else "matplotlib not available")
        return 0
    a.words = [int(x) for x in a.words.split(",")]
    a.configs = set(ALL_CONFIGS if a.configs == "all" else a.configs.split(","))
    if a.configs - set(ALL_CONFIGS):
        ap.error(f"unknown --configs {sorted(a.configs - set(ALL_CONFIGS))}; known: {','.join(ALL_CONFIGS)}")
    model = a.model or os.path.join(os.path.expanduser("~"), ".cache", "hixl", "smollm2-hf")
    r = subprocess.run([sys.executable, "-m", "hixl.cli", "model", "export", model])
    if r.returncode != 0:
        return 2
    run = Runner(a)
    t0 = time.monotonic()
    if a.configs & {"mono", "p-alone", "push", "pull", "router-push", "router-pull"}:
        run.run_hixl(model)
    if a.configs & {"nixl", "router-nixl"}:
        run.run_nixl(model)
    if "tp" in a.configs:
        tiny = a.tiny_model or os.path.join(os.path.expanduser("~"), ".cache", "hixl", "tiny-llama")
        if subprocess.run([sys.executable, "-m", "hixl.cli", "model", "tiny-llama", tiny]).returncode != 0:
            return 2
        run.run_tp(tiny)
    for tag in (t for t in HYBRID if t in a.configs):
        tiny = os.path.join(os.path.expanduser("~"), ".cache", "hixl", f"tiny-{HYBRID[tag]}")
        if subprocess.run([sys.executable, "-m", "hixl.cli", "model", "tiny", HYBRID[tag], tiny]).returncode != 0:
            return 2
        run.run_hybrid(tag, tiny)
    doc = {"args": {"requests": a.requests, "warmup": a.warmup, "words": a.words, "max_tokens": a.max_tokens,
                    "configs": sorted(a.configs), "pin": a.pin, "gap_s": a.gap_s},
           "host": {"cpus": os.cpu_count()}, "wall_s": time.monotonic() - t0,
           "results": run.results, "placement": run.placement}
    doc.update(summarize(doc))
    base = os.path.join(a.out, "vllm_pd")
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    text = table(doc)
    with open(base + ".txt", "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"wrote {base}.json, {base}.txt" + (f", {base}.png" if plot(doc, base + ".png") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
