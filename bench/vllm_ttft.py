"""TTFT in parts, per request, for ``bench/vllm_pd.py``: from what the vLLM instances already export on
``/metrics`` (the ``_sum``/``_count`` of their per-request histograms, read before and after each
request, one request at a time) and the connector's ``vllm:hixl_*`` counters. No instrumentation of its own.

vLLM's histograms, per instance: ``time_to_first_token`` (its API server: the request's arrival to the
first token's output), ``request_queue_time`` (its engine core: queued to scheduled; a decoder's request
waiting for its KV is not scheduled until the KV arrived, so this is the decoder's KV wait) and
``request_prefill_time`` (scheduled to the first token: the step that produced it).

Parts of the client's TTFT (per request they sum to it; ``hops`` and ``api`` are what is left over):

* ``hops``: the client's TTFT minus the serving instance's own: HTTP to the proxy, the proxy, the hop to
  the instance and the first chunk's way back (mono: one direct hop);
* ``api``: the instance's TTFT minus queue and first step: its API server (tokenizing, the hand-off to
  the engine core and the output's way back);
* ``kv_wait``: the instance's queue time (the decoder: arrival at its engine core to scheduled after the
  KV arrived), split for push into the prefill's own prefill time (``p_compute``), the exposed transfer
  (``exposed``: the push after the prefill's last layer) and the rest (``kv_other``: the prefill's later
  start and queue, the completion notice, the decoder's step boundaries);
* ``first_step``: the instance's prefill time: the decoder's first step after its KV arrived (mono: the
  whole prompt's prefill).

Informational, not parts: the prefill's queue time and API-server time, and the decoder's hixl KV wait
(its grant until the KV was complete) with the decoder's scheduling around it (queue time minus that).
"""
from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List, Optional

HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
              "prefill": "vllm:request_prefill_time_seconds"}
TOP = ("hops", "api", "kv_wait", "first_step")  # per request, these sum to the client's TTFT
SPLIT = ("p_compute", "exposed", "kv_other")  # these sum to kv_wait (push)
INFO = ("p_queue", "p_api", "hixl_wait", "d_sched")
PARTS = TOP + SPLIT
LABELS = {"hops": "HTTP hops+proxy", "api": "API server", "kv_wait": "queue/KV wait", "p_compute": "P prefill",
          "exposed": "exposed xfer", "kv_other": "KV wait other", "first_step": "first step",
          "p_queue": "P queue", "p_api": "P API server", "hixl_wait": "hixl grant->KV", "d_sched": "D sched"}


def _pct(xs: List[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100.0 * (len(s) - 1))))]


def snapshot(inst) -> Dict[str, float]:
    """The histograms' ``_sum`` and ``_count`` of one instance (absent ones are left out)."""
    m = inst.metrics()
    return {k + sfx: m[k + sfx] for k in HISTOGRAMS.values() for sfx in ("_sum", "_count") if k + sfx in m}


def engine_times(inst, before: Dict[str, float], settle: Callable) -> Dict[str, Optional[float]]:
    """The instance's own TTFT, queue and prefill time (s) for the request since ``before``: the mean of
    the new observations (one request at a time: one each), after waiting for them (vLLM records queue
    and prefill time when the request finishes)."""
    names = [n for n in HISTOGRAMS.values() if n + "_count" in before]

    def delta() -> Dict[str, float]:
        now = snapshot(inst)
        return {k: now.get(k, v) - v for k, v in before.items()}

    d = settle(delta, lambda x: all(x.get(n + "_count", 0) >= 1 for n in names))
    out: Dict[str, Optional[float]] = {}
    for short, n in HISTOGRAMS.items():
        c = d.get(n + "_count", 0)
        out[short] = d[n + "_sum"] / c if c >= 1 else None
    return out


def parts(ttft_s: float, own: Dict[str, Optional[float]], prefill: Optional[Dict[str, Optional[float]]] = None,
          exposed_s: Optional[float] = None, hixl_wait_s: Optional[float] = None) -> Optional[Dict[str, float]]:
    """The parts (s) of one request's client TTFT ``ttft_s``; ``own``: the serving instance's times
    (the decoder, or mono); ``prefill``: the prefill instance's (push). None when a time is missing."""
    if any(own.get(k) is None for k in HISTOGRAMS):
        return None
    out = {"hops": ttft_s - own["ttft"], "api": own["ttft"] - own["queue"] - own["prefill"],
           "kv_wait": own["queue"], "first_step": own["prefill"]}
    if prefill is not None and prefill.get("prefill") is not None and exposed_s is not None:
        out.update(p_compute=prefill["prefill"], exposed=exposed_s,
                   kv_other=own["queue"] - prefill["prefill"] - exposed_s)
        if prefill.get("queue") is not None:
            out["p_queue"] = prefill["queue"]
            if prefill.get("ttft") is not None:
                out["p_api"] = prefill["ttft"] - prefill["queue"] - prefill["prefill"]
    if hixl_wait_s is not None and prefill is not None:
        out.update(hixl_wait=hixl_wait_s, d_sched=own["queue"] - hixl_wait_s)
    return out


def summarize(rows: List[Dict[str, Any]]) -> Optional[Dict[str, Dict[str, float]]]:
    """Median and p99 (ms) of each part over the rows that have them."""
    got = [r["parts_s"] for r in rows if r.get("parts_s")]
    if not got:
        return None
    out: Dict[str, Dict[str, float]] = {}
    for k in PARTS + INFO:
        xs = [p[k] * 1e3 for p in got if p.get(k) is not None]
        if xs:
            out[k] = {"median": statistics.median(xs), "p99": _pct(xs, 99)}
    return out


def gap(push: Dict[str, Dict[str, float]], mono: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """Push minus mono per part (medians, ms). Mono's prefill is its first step; push's prefill is inside
    its KV wait, so ``kv_wait+first_step`` compares the two paths from the engine core's arrival."""
    out = {k: push[k]["median"] - mono[k]["median"] for k in ("hops", "api", "kv_wait", "first_step")
           if k in push and k in mono}
    if all(k in out for k in ("kv_wait", "first_step")):
        out["kv_wait+first_step"] = out["kv_wait"] + out["first_step"]
    if "p_compute" in push and "first_step" in mono:
        out["p_compute vs mono prefill"] = push["p_compute"]["median"] - mono["first_step"]["median"]
    return out


def table_lines(summary: Dict[str, Any]) -> List[str]:
    """The parts table: one line per configuration that has them, median / p99 per part (ms)."""
    rows = [(n, s["ttft_parts_ms"]) for n, s in summary.items() if isinstance(s, dict) and s.get("ttft_parts_ms")]
    if not rows:
        return []
    keys = [k for k in PARTS + INFO if any(k in p for _, p in rows)]
    lines = ["TTFT in parts, median/p99 [ms]: per request, HTTP hops+proxy + API server + queue/KV wait + first "
             "step = the client's TTFT; P prefill + exposed xfer + KV wait other = queue/KV wait (push); "
             "the rest is informational",
             "config       " + " ".join(f"{LABELS[k] + ' [ms]':>19}" for k in keys)]
    for name, p in rows:
        cells = [f"{p[k]['median']:.1f}/{p[k]['p99']:.1f}" if k in p else "-" for k in keys]
        lines.append(f"{name:<12} " + " ".join(f"{c:>19}" for c in cells))
    for name, s in summary.items():
        if isinstance(s, dict) and s.get("ttft_parts_gap_ms"):
            lines.append(f"{name} - {s['ttft_parts_gap_ms_ref']} per part (medians, ms): " + ", ".join(
                f"{k} {v:+.1f}" for k, v in s["ttft_parts_gap_ms"].items()))
    return lines
