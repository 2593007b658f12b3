"""Paired TTFT ratios for ``bench/vllm_pd.py``: two configurations measured in turns on the same prompts,
the ratio taken per prompt, its median and a distribution-free confidence interval for that median, and
a goal's verdict that says when the run is too short to decide.

Why paired: one instance's TTFT for the same prompt moves by several per cent from one request to the
next on a shared host, and drifts over minutes. A ratio of two medians measured one configuration after
the other carries both; a ratio per prompt, the two requests sent one after the other, cancels the drift
and leaves the per-request noise, which the interval states.

The interval is the order-statistic one for a median (no assumption about the distribution): with ``n``
ratios sorted, ``[x_(k), x_(n-k+1)]`` where ``k`` is the largest count with ``P(Binomial(n, 1/2) < k)`` at most
``(1 - level) / 2``. Six ratios are the fewest that give a 95 % interval.
"""
from __future__ import annotations

import statistics
from math import comb
from typing import Any, Dict, List, Optional, Tuple


def median_interval(xs: List[float], level: float = 0.95) -> Optional[Tuple[float, float]]:
    """The distribution-free ``level`` confidence interval for the median of ``xs``; None when ``xs`` has
    too few values for one."""
    n = len(xs)
    tail = (1.0 - level) / 2.0
    cdf, k = 0.0, 0
    for j in range(n + 1):  # k: how many of the smallest values lie below the interval, at most
        cdf += comb(n, j) / 2.0 ** n
        if cdf > tail:
            break
        k = j + 1
    if k == 0:
        return None
    s = sorted(xs)
    return s[k - 1], s[n - k]


def ratios(num: List[Dict[str, Any]], den: List[Dict[str, Any]], key: str = "ttft_s") -> List[Dict[str, Any]]:
    """Per prompt (rows matched by their ``i``): ``num``'s ``key`` over ``den``'s, with the prompt's
    length (``words``) when the rows carry it. Rows without a partner are left out."""
    by_i = {r["i"]: r for r in den if r.get(key)}
    out = []
    for r in num:
        d = by_i.get(r.get("i"))
        if d is not None and r.get(key) is not None:
            out.append({"i": r["i"], "words": r.get("words"), "ratio": r[key] / d[key]})
    return out


def summary(pairs: List[Dict[str, Any]], level: float = 0.95) -> Optional[Dict[str, Any]]:
    """Median ratio, its interval and, per prompt length, the median ratio and count."""
    if not pairs:
        return None
    xs = [p["ratio"] for p in pairs]
    ci = median_interval(xs, level)
    out: Dict[str, Any] = {"n": len(xs), "median": statistics.median(xs), "level": level,
                           "ci": list(ci) if ci else None}
    lengths = sorted({p["words"] for p in pairs if p.get("words") is not None})
    if len(lengths) > 1:
        out["by_words"] = {str(w): {"n": len(ws), "median": statistics.median(ws)}
                           for w in lengths for ws in [[p["ratio"] for p in pairs if p["words"] == w]]}
    return out


def verdict(s: Dict[str, Any], limit: float) -> str:
    """``met`` or ``missed`` when the interval lies on one side of ``limit``; otherwise undecided, with
    the point estimate's side, so a short run says it is short rather than passing or failing by chance."""
    side = "met" if s["median"] <= limit else "missed"
    if s["ci"] is None:
        return f"{side} by the median only ({s['n']} pairs: too few for a {s['level']:.0%} interval)"
    lo, hi = s["ci"]
    if hi <= limit:
        return "met"
    if lo > limit:
        return "missed"
    return (f"undecided: the {s['level']:.0%} interval [{lo:.3f}, {hi:.3f}] spans {limit:g} "
            f"(median {side}); more requests narrow it")
