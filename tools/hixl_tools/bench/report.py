"""Report of ``hixl bench``: tables with units in every header, JSON, CSV, PNG plots, the ratio
table (ours / each peer, per size) and the goals (reported, never enforced).

Units: B = bytes; MiB = 2^20 B (bandwidth MiB/s); us = microseconds; [x] = a ratio ours / peer;
[#] = a count. "med" is the median, "p99" the 99th percentile, "min" the lowest trial.
"""
from __future__ import annotations

import csv
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._extras import hint

MiB = 1 << 20
KiB = 1 << 10
UNITS = {"size": "B (bytes per descriptor)", "lat": "us (microseconds)", "bw": "MiB/s (MiB = 2^20 B)",
         "rate": "Mdesc/s (10^6 descriptors per second)", "ratio": "x (ours / peer)"}

# (header, key, format): our rows and peer rows share the columns they have in common.
OUR_COLS = [("transport", "transport", "s"), ("path", "path", "s"), ("op", "op", "s"), ("size[B]", "size_B", "d"),
            ("descs[#]", "descs", "d"), ("window[#req]", "window", "d"), ("threads[#]", "threads", "d"),
            ("lat_med[us]", "lat_med_us", ".2f"), ("lat_p99[us]", "lat_p99_us", ".2f"),
            ("half_rtt_med[us]", "half_rtt_med_us", ".2f"), ("half_rtt_p99[us]", "half_rtt_p99_us", ".2f"),
            ("bw_med[MiB/s]", "bw_med_MiBps", ".1f"), ("bw_min[MiB/s]", "bw_min_MiBps", ".1f"),
            ("rate[Mdesc/s]", "rate_Mdesc_s", ".4f"), ("req_med[us]", "req_med_us", ".1f"),
            ("req_p99[us]", "req_p99_us", ".1f"), ("lat_iters[#]", "lat_iters", "d"), ("bw_iters[#]", "bw_iters", "d")]
PEER_COLS = [("peer", "peer", "s"), ("protocol", "protocol", "s"), ("op", "op", "s"), ("size[B]", "size_B", "d"),
             ("window[#req]", "window", "d"), ("lat_med[us]", "lat_med_us", ".2f"),
             ("lat_p99[us]", "lat_p99_us", ".2f"), ("bw_med[MiB/s]", "bw_med_MiBps", ".1f"),
             ("bw_min[MiB/s]", "bw_min_MiBps", ".1f"), ("lat_iters[#]", "lat_iters", "d")]
RATIO_COLS = [("size[B]", "size_B", "d"), ("op", "op", "s"), ("ours", "ours", "s"), ("peer", "peer", "s"),
              ("ours_bw[MiB/s]", "ours_bw_MiBps", ".1f"), ("peer_bw[MiB/s]", "peer_bw_MiBps", ".1f"),
              ("bw_ours/peer[x]", "bw_ratio", ".3f"), ("ours_lat[us]", "ours_lat_us", ".2f"),
              ("peer_lat[us]", "peer_lat_us", ".2f"), ("lat_ours/peer[x]", "lat_ratio", ".3f"),
              ("lat_metric", "lat_metric", "s")]
CSV_COLS = [("impl", "impl", "s")] + OUR_COLS[:2] + [("protocol", "protocol", "s")] + OUR_COLS[2:]

# Which of our transports a peer stands against.
COMPAT = {("perftest", "rdma"): ("rdma",), ("mooncake", "rdma"): ("rdma",), ("mooncake", "tcp"): ("tcp", "shm"),
          ("nixl", "rdma"): ("rdma",), ("nixl", "tcp"): ("tcp", "shm")}


def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)) else None


def fmt(x: Any, f: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if f == "s":
        return str(x)
    if f == "d":
        return str(int(x))
    return format(float(x), f)


def table(rows: Sequence[Dict[str, Any]], cols: Sequence[Tuple[str, str, str]]) -> str:
    cells = [[fmt(r.get(k), f) for _, k, f in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(cols)]
    left = {i for i, (_, _, f) in enumerate(cols) if f == "s"}

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.ljust(w) if i in left else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths)))
    out = [line([h for h, _, _ in cols]), "  ".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    return "\n".join(out)


def our_dicts(rows: Sequence[Any]) -> List[Dict[str, Any]]:
    """Row objects of this run, or the row dicts of a JSON report (--from-json), as dicts."""
    return [dict(r) if isinstance(r, dict) else
            {"impl": "hixl", "transport": r.transport, "path": r.path, "op": r.op, "size_B": r.size, "descs": r.descs,
             "window": r.window, "threads": r.threads, **r.values} for r in rows]


def _ref_row(ours: Sequence[Dict[str, Any]], window0: int, **match: Any) -> Optional[Dict[str, Any]]:
    for r in ours:
        if all(r.get(k) == v for k, v in match.items()) and r["threads"] == 1 and r["window"] == window0:
            return r
    return None


def ratios(ours: Sequence[Dict[str, Any]], peer_rows: Sequence[Dict[str, Any]], window0: int) -> List[Dict[str, Any]]:
    """ours / peer for every peer point and each of our base rows (1 descriptor, 1 thread, window0)
    of a transport that peer stands against; plus the 1000 x 4 KiB row against ib_write_bw at 4 KiB."""
    out = []
    for p in peer_rows:
        label = "%s-%s" % (p["peer"], p["protocol"]) if p["peer"] != "perftest" else "perftest"
        for r in ours:
            if r["transport"] not in COMPAT.get((p["peer"], p["protocol"]), ()) or r["op"] != p["op"] \
                    or r["size_B"] != p["size_B"] or r["threads"] != 1 or r["window"] != window0:
                continue
            if r["descs"] != 1 and not (p["peer"] == "perftest" and p["op"] == "write" and r["descs"] > 1):
                continue
            half = p["peer"] == "perftest" and p["op"] == "write"
            lat_key = "half_rtt_med_us" if half else "lat_med_us"
            rounds = min(r.get("half_rtt_rounds", 1), p.get("lat_rounds", 1)) if half else 1
            our_lat = r.get(lat_key) if r["descs"] == 1 else None
            row = {"size_B": p["size_B"], "op": p["op"], "peer": label,
                   "ours": "%s/%s%s" % (r["transport"], r["path"], "" if r["descs"] == 1 else " x%d" % r["descs"]),
                   "ours_bw_MiBps": r.get("bw_med_MiBps"), "peer_bw_MiBps": p.get("bw_med_MiBps"),
                   "ours_lat_us": our_lat, "peer_lat_us": p.get("lat_med_us") if our_lat is not None else None,
                   "lat_metric": ("half RTT (ib_write_lat)" + (", best of %d rounds" % rounds if rounds > 1 else "")
                                  if half else "call") if our_lat is not None else "-",
                   "descs": r["descs"], "transport": r["transport"], "path": r["path"]}
            row["bw_ratio"] = _div(row["ours_bw_MiBps"], row["peer_bw_MiBps"])
            row["lat_ratio"] = _div(row["ours_lat_us"], row["peer_lat_us"])
            out.append(row)
    out.sort(key=lambda r: (r["peer"], r["op"], r["size_B"], r["ours"]))
    return out


def _div(a: Any, b: Any) -> Optional[float]:
    a, b = _num(a), _num(b)
    return a / b if a is not None and b else None


def goals(ratio_rows: Sequence[Dict[str, Any]], measured_peers: Sequence[str]) -> List[Dict[str, Any]]:
    """Issue-6 goals. Status: met / missed / not measured (with what was missing)."""
    def pick(peer: str, op: str, size: Optional[int], descs: int, prefer: Sequence[str]) -> List[Dict[str, Any]]:
        rows = [r for r in ratio_rows if r["peer"] == peer and r["op"] == op and r["transport"] == "rdma"
                and r["descs"] == descs and (size is None or r["size_B"] == size)]
        for path in prefer:
            got = [r for r in rows if r["path"] == path]
            if got:
                return got
        return []

    def goal(name: str, desc: str, rows: List[Dict[str, Any]], key: str, ok: Any, threshold: str,
             why_missing: str) -> Dict[str, Any]:
        vals = [r[key] for r in rows if r.get(key) is not None]
        if not vals:
            if rows:  # both measured, but a number is missing (perftest prints 0.00 or inf at times)
                why_missing = "no ratio: " + ", ".join("%s %s B: ours %s, peer %s" % (
                    r["ours"], r["size_B"], fmt(r.get("ours_" + ("bw_MiBps" if key == "bw_ratio" else "lat_us")), ".2f"),
                    fmt(r.get("peer_" + ("bw_MiBps" if key == "bw_ratio" else "lat_us")), ".2f")) for r in rows)
            return {"goal": name, "description": desc, "threshold": threshold, "status": "not measured",
                    "value": None, "detail": why_missing}
        worst = max(vals) if threshold.startswith("<") else min(vals)
        status = "met" if all(ok(v) for v in vals) else "missed"
        detail = ", ".join("%s %s B: %.3f" % (r["ours"], r["size_B"], r[key]) for r in rows if r.get(key) is not None)
        return {"goal": name, "description": desc, "threshold": threshold, "status": status, "value": worst,
                "detail": detail}
    pt = "perftest" in measured_peers
    mc = "mooncake-rdma" in measured_peers
    need_pt = "needs --transport rdma --vs perftest (and write at that size)"
    need_mc = "needs --transport rdma --vs mooncake (Mooncake's rdma protocol) and write"
    mid = [r for r in pick("mooncake-rdma", "write", None, 1, ("engine", "endpoint", "python"))
           if 64 * KiB <= r["size_B"] <= 16 * MiB]
    return [
        goal("write_bw_1MiB_vs_ib_write_bw", "WRITE bandwidth at 1 MiB >= 0.90x ib_write_bw (C++ endpoint path)",
             pick("perftest", "write", MiB, 1, ("endpoint", "engine")) if pt else [], "bw_ratio",
             lambda v: v >= 0.90, ">= 0.90x", need_pt),
        goal("write_lat_8B_vs_ib_write_lat", "8 B WRITE latency (half RTT, typical) <= 1.2x ib_write_lat t_typical "
             "(C++ endpoint path)", pick("perftest", "write", 8, 1, ("endpoint",)) if pt else [], "lat_ratio",
             lambda v: v <= 1.2, "<= 1.2x", need_pt),
        goal("bw_vs_mooncake_rdma_64KiB_16MiB", "WRITE bandwidth >= 1.0x Mooncake rdma at every size 64 KiB..16 MiB "
             "(engine path)", mid if mc else [], "bw_ratio", lambda v: v >= 1.0, ">= 1.0x", need_mc),
        goal("lat_vs_mooncake_rdma_all_sizes", "WRITE latency (one call) < Mooncake rdma at every size (engine path)",
             pick("mooncake-rdma", "write", None, 1, ("engine", "endpoint", "python")) if mc else [], "lat_ratio",
             lambda v: v < 1.0, "< 1.0x", need_mc),
        goal("1000x4KiB_vs_ib_write_bw_4KiB", "1000 x 4 KiB descriptors in one call >= 0.8x ib_write_bw at 4 KiB "
             "(endpoint and engine paths)",
             pick("perftest", "write", 4096, 1000, ("endpoint",)) + pick("perftest", "write", 4096, 1000, ("engine",))
             if pt else [], "bw_ratio",
             lambda v: v >= 0.8, ">= 0.8x", need_pt),
    ]


def _json_safe(o: Any) -> Any:
    if isinstance(o, float) and (math.isnan(o) or math.isinf(o)):
        return None
    if isinstance(o, dict):
        return {str(k): _json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_json_safe(v) for v in o]
    return o


def _mpl_config_dir() -> None:
    """Where $HOME is read-only (the rxe VM), matplotlib would build its font cache in a new temporary
    directory every run (minutes under QEMU TCG): give it one seeded with the user's cache if any."""
    if "MPLCONFIGDIR" in os.environ:
        return
    home = Path.home()
    cfg = Path(os.environ.get("XDG_CONFIG_HOME", home / ".config")) / "matplotlib"
    cache = Path(os.environ.get("XDG_CACHE_HOME", home / ".cache")) / "matplotlib"

    def writable(d: Path) -> bool:
        while not d.exists():
            d = d.parent
        return os.access(d, os.W_OK)
    seed = sorted((home / ".cache" / "matplotlib").glob("fontlist-*.json"))
    if writable(cfg) and writable(cache) and (list(cache.glob("fontlist-*.json")) or not seed):
        return
    d = tempfile.mkdtemp(prefix="hixl-bench-mpl-")
    for f in seed:
        try:
            shutil.copy(f, d)
        except OSError:
            pass
    os.environ["MPLCONFIGDIR"] = d


def _size_label(v: float) -> str:
    for unit, n in (("G", 1 << 30), ("M", MiB), ("K", KiB)):
        if v >= n and v % n == 0:
            return "%d%s" % (v // n, unit)
    return "%d" % v


def plots(ours: Sequence[Dict[str, Any]], peer_rows: Sequence[Dict[str, Any]], window0: int, base: Path) -> List[str]:
    """Bandwidth vs size and latency vs size (log-log). Returns the files written; raises ImportError
    without matplotlib."""
    _mpl_config_dir()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 (FuncFormatter)

    series: Dict[str, List[Tuple[int, Optional[float], Optional[float]]]] = {}
    for r in ours:
        if r["descs"] == 1 and r["threads"] == 1 and r["window"] == window0:
            series.setdefault("hixl %s/%s %s" % (r["transport"], r["path"], r["op"]), []).append(
                (r["size_B"], r.get("bw_med_MiBps"), r.get("lat_med_us")))
            if r.get("half_rtt_med_us") is not None:
                series.setdefault("hixl %s/%s %s half RTT" % (r["transport"], r["path"], r["op"]), []).append(
                    (r["size_B"], None, r["half_rtt_med_us"]))
    for p in peer_rows:
        name = "%s %s" % (p["peer"] if p["peer"] == "perftest" else "%s-%s" % (p["peer"], p["protocol"]), p["op"])
        if p["peer"] == "perftest" and p["op"] == "write":
            name += " (lat: half RTT)"
        series.setdefault(name, []).append((p["size_B"], p.get("bw_med_MiBps"), p.get("lat_med_us")))
    files = []
    for idx, (what, ylabel, fname) in enumerate(((1, "bandwidth [MiB/s] (MiB = 2^20 B)", "_bw.png"),
                                                 (2, "latency, median [us]", "_lat.png"))):
        fig, ax = plt.subplots(figsize=(9, 5.5))
        for name, pts in sorted(series.items()):
            pts = sorted((x, v[what - 1]) for x, *v in pts if v[what - 1] is not None)
            if not pts:
                continue
            style = "-o" if name.startswith("hixl") else "--s"
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=name, markersize=4)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: _size_label(v)))
        ax.set_yscale("log")
        ax.set_xlabel("message size [B]")
        ax.set_ylabel(ylabel)
        ax.set_title("hixl bench: %s vs size (1 descriptor, window %d, 1 thread)"
                     % ("bandwidth" if idx == 0 else "latency", window0))
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = str(base) + fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def emit(res: Dict[str, Any], s: Any) -> Dict[str, Any]:
    """Prints the tables and writes <out>/<name>.{txt,json,csv} (+ _ratios.csv, _bw.png, _lat.png)."""
    a = s.args
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / a.name
    ours = our_dicts(res["rows"])
    peer_rows = res["peers"]
    w0 = s.window0
    rat = ratios(ours, peer_rows, w0)
    measured = sorted({p["peer"] if p["peer"] == "perftest" else "%s-%s" % (p["peer"], p["protocol"])
                       for p in peer_rows})
    gl = goals(rat, measured) if s.goals else []
    m = res["meta"]
    qps = m.get("settings", {}).get("rdma_qps_per_link", 1)
    lines = ["hixl bench %s  host %s  cpus %s  pinned %s  device %s gid %s%s  (measured in %.1f s, %.1f s in all)"
             % (m["hixl"], m["host"], m["cpus"], m["pinned"], m["rdma_device"], m["gid_index"],
                "  engine links: %d queue pairs" % qps if qps > 1 else "", m.get("measure_s", math.nan),
                m.get("elapsed_s", math.nan)),
             "units: size in B (bytes per descriptor); latency in us; bandwidth in MiB/s with MiB = 2^20 B; "
             "med = median, p99 = 99th percentile, min = lowest trial; [x] = ours / peer",
             "", "== hixl =="]
    lines.append(table(ours, OUR_COLS))
    if peer_rows:
        lines += ["", "== peers (same run) =="]
        lines.append(table(peer_rows, PEER_COLS))
    if rat:
        lines += ["", "== ratio: ours / peer, per size (bw: > 1 is better for us; lat: < 1 is better) =="]
        lines.append(table(rat, RATIO_COLS))
    elif s.peers:
        lines += ["", "== ratio: no peer measured (see notes) =="]
    if gl and not any(t == "rdma" for t in s.transports):
        lines += ["", "goals: not measured (they need --transport rdma --vs perftest,mooncake)"]
    elif gl:
        lines += ["", "== goals (reported, not enforced) =="]
        for g in gl:
            val = "" if g["value"] is None else " worst %.3fx" % g["value"]
            lines.append("  %-13s %s%s (%s) -- %s" % (g["status"].upper(), g["goal"], val, g["threshold"],
                                                   g["detail"] or ""))
    for n in res["notes"]:
        lines.append("note: " + n)
    t0 = time.monotonic()
    files = {"txt": str(base) + ".txt", "json": str(base) + ".json", "csv": str(base) + ".csv",
             "ratios_csv": str(base) + "_ratios.csv"}
    if a.plots:
        try:
            files["plots"] = plots(ours, peer_rows, w0, base)  # type: ignore[assignment]
        except ImportError:
            lines.append("note: plots skipped: matplotlib is not installed (%s)" % hint("matplotlib"))
    if a.plots and "plots" in files:
        lines.append("plots: %.1f s" % (time.monotonic() - t0))
    lines.append("files: " + ", ".join(v if isinstance(v, str) else ", ".join(v) for v in files.values()))
    text = "\n".join(lines)
    print(text)
    sys.stdout.flush()
    Path(files["txt"]).write_text(text + "\n")
    with open(files["csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([h for h, _, _ in CSV_COLS])
        for r in ours + [{"impl": p["peer"], **p} for p in peer_rows]:
            w.writerow(["" if r.get(k) is None else fmt(r.get(k), "s" if fm == "s" else fm) for _, k, fm in CSV_COLS])
    with open(files["ratios_csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([h for h, _, _ in RATIO_COLS])
        for r in rat:
            w.writerow(["" if r.get(k) is None else fmt(r.get(k), fm) for _, k, fm in RATIO_COLS])
    doc = {"meta": m, "units": UNITS, "columns": {h: k for h, k, _ in OUR_COLS + PEER_COLS + RATIO_COLS},
           "rows": ours, "peers": peer_rows, "ratios": rat, "goals": gl, "notes": res["notes"], "files": files}
    Path(files["json"]).write_text(json.dumps(_json_safe(doc), indent=1) + "\n")
    return doc
