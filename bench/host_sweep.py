#!/usr/bin/env python3
"""Same-host (shm) and TCP transports of hixl.Hixl against single-thread memcpy and Mooncake.

Everything is measured in one run on this machine:

* ``memcpy``: ``ctypes.memmove`` between two buffers of this process (one thread): the ceiling
  for a one-copy same-host transfer.
* ``hixl shm`` / ``hixl tcp``: ``Hixl.transfer_sync`` WRITEs from this process into a target
  engine in a child process (``bench/hixl_target.py``), the API an inference engine calls.
  ``shm`` targets device memory from the ``hixl.acl`` shim (memfd: mapped, then memcpy);
  ``shm_cma`` targets plain numpy memory (cross-memory attach, ``process_vm_writev``).
* ``mooncake tcp``: Mooncake's transfer engine over TCP on loopback (P2PHANDSHAKE), measured by
  ``bench/mooncake_ref.py`` in its own child processes (skipped with a note when not installed).

Per size: latency = wall time of one synchronous call (median and p99 of ``--lat-iters`` calls
after warm-up, microseconds); bandwidth = back-to-back synchronous calls moving >= 64 MiB (at
least 20, at most 2000 calls), MiB/s with 1 MiB = 2^20 bytes, median of the trials. The
``memcpy`` column is its own run; the shm/memcpy ratios put every hixl trial between two memcpy
trials of the same size (same process, same source buffer) and report the median of hixl / mean
of its two neighbours, so that drift of a shared machine does not enter the ratio. Other
ratios are against the references of the same run. Goals (from the issue) are reported, never enforced:
shm >= 0.8x memcpy at >= 1 MiB; shm >= 5x Mooncake's bandwidth and <= 0.2x its latency; our tcp
no slower than its tcp.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import hixl

HERE = Path(__file__).resolve().parent
MiB = 1 << 20


def _pct(vals, q):
    s = sorted(vals)
    if not s:
        return math.nan
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _iters(size):
    return max(20, min(2000, math.ceil(64 * MiB / size)))


def _bw_trial(call, size, n):
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return n * size / (time.perf_counter() - t0) / MiB


def measure(call, size, lat_iters, warmup=20, trials=3, ref=None):
    """call() moves `size` bytes once. Returns latency (us) median/p99 and bandwidth (MiB/s).

    With ``ref`` (a reference call moving the same bytes, e.g. memcpy), every bandwidth trial of
    ``call`` sits between two trials of ``ref``, and ``vs_ref_bw`` is the median over trials of
    call / mean(ref before, ref after): drift of this shared machine cancels out to first order.
    """
    for _ in range(warmup):
        call()
        if ref:
            ref()
    lat = []
    for _ in range(lat_iters):
        t0 = time.perf_counter_ns()
        call()
        lat.append((time.perf_counter_ns() - t0) / 1e3)
    n = _iters(size)
    bws, refs = [], []
    for _ in range(trials):
        if ref:
            refs.append(_bw_trial(ref, size, n))
        bws.append(_bw_trial(call, size, n))
    out = {"lat_median_us": statistics.median(lat), "lat_p99_us": _pct(lat, 0.99),
           "bw_mib_s": statistics.median(bws), "bw_iters": n}
    if ref:
        refs.append(_bw_trial(ref, size, n))  # ref, call, ref, ..., call, ref: each call between two refs
        out["ref_bw_mib_s"] = statistics.median(refs)
        out["vs_ref_bw"] = statistics.median(b / ((r0 + r1) / 2) for b, r0, r1 in zip(bws, refs, refs[1:]))
    return out


def bench_memcpy(sizes, lat_iters):
    top = max(sizes)
    src = np.random.default_rng(1).integers(0, 256, top, dtype=np.uint8)
    dst = np.zeros(top, np.uint8)
    out = {}
    for size in sizes:
        out[size] = measure(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, size), size, lat_iters)
    return out


def bench_hixl(transport, sizes, lat_iters, memory="host"):
    top = max(sizes)
    target = subprocess.Popen([sys.executable, str(HERE / "hixl_target.py"), transport, str(top), memory],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    e = hixl.Hixl()
    try:
        info = json.loads(target.stdout.readline())
        if e.initialize("127.0.0.1", {"HixlTransport": transport}) != hixl.SUCCESS:
            raise RuntimeError(e.last_error())
        src = np.random.default_rng(2).integers(0, 256, top, dtype=np.uint8)
        back = np.zeros(top, np.uint8)
        local = np.zeros(top, np.uint8)  # the memcpy reference's destination, paired trial by trial
        for buf in (src, back):
            if e.register_mem(hixl.MemDesc(buf.ctypes.data, top))[0] != hixl.SUCCESS:
                raise RuntimeError(e.last_error())
        if e.connect(info["name"], 20000) != hixl.SUCCESS:
            raise RuntimeError(e.last_error())
        got = e.get_transport(info["name"])[1]
        if got != transport:
            raise RuntimeError("asked for %s, link uses %s" % (transport, got))
        out = {}
        for size in sizes:
            d = [hixl.TransferOpDesc(src.ctypes.data, info["addr"], size)]
            r = [hixl.TransferOpDesc(back.ctypes.data, info["addr"], size)]
            if e.transfer_sync(info["name"], hixl.WRITE, d, 60000) != hixl.SUCCESS or \
                    e.transfer_sync(info["name"], hixl.READ, r, 60000) != hixl.SUCCESS:
                raise RuntimeError(e.last_error())
            if not np.array_equal(back[:size], src[:size]):
                raise RuntimeError("%s: bytes read back differ at size %d" % (transport, size))

            def call(d=d):
                if e.transfer_sync(info["name"], hixl.WRITE, d, 60000) != hixl.SUCCESS:
                    raise RuntimeError(e.last_error())
            out[size] = measure(call, size, lat_iters, trials=7,
                                ref=lambda size=size: ctypes.memmove(local.ctypes.data, src.ctypes.data, size))
        return out
    finally:
        e.finalize()
        target.stdin.close()
        target.wait(30)
        target.stdout.close()


def bench_mooncake(sizes, lat_iters):
    sys.path.insert(0, str(HERE))
    try:
        import mooncake_ref
        res = mooncake_ref.run(sizes, lat_iters=lat_iters, do_read=False)
    except Exception as ex:  # not installed, or failed: reported, not fatal
        return None, "mooncake not measured: %s" % (ex,)
    out = {}
    for row in res["results"]:
        w = row["write"]
        out[row["size_bytes"]] = {"lat_median_us": w["lat_median_us"], "lat_p99_us": w["lat_p99_us"],
                                  "bw_mib_s": w["bw_mib_s"], "bw_iters": w["bw_iters"]}
    return out, "mooncake-transfer-engine %s, protocol tcp, P2PHANDSHAKE" % (res.get("meta", {}).get("mooncake_version"),)


def ratio(a, b):
    try:
        return a / b if b else math.nan
    except TypeError:
        return math.nan


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,4096,65536,1048576,16777216")
    ap.add_argument("--lat-iters", type=int, default=200)
    ap.add_argument("--json", default="host_sweep.json")
    ap.add_argument("--no-mooncake", action="store_true")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    runs = {"memcpy": bench_memcpy(sizes, a.lat_iters),
            "hixl_shm": bench_hixl("shm", sizes, a.lat_iters, memory="acl"),
            "hixl_shm_cma": bench_hixl("shm", sizes, a.lat_iters, memory="host"),
            "hixl_tcp": bench_hixl("tcp", sizes, a.lat_iters)}
    mc, mc_note = (None, "mooncake skipped (--no-mooncake)") if a.no_mooncake else bench_mooncake(sizes, a.lat_iters)
    if mc:
        runs["mooncake_tcp"] = mc
    rows = []
    for s in sizes:
        shm, tcp, cp = runs["hixl_shm"][s], runs["hixl_tcp"][s], runs["memcpy"][s]
        m = (mc or {}).get(s, {})
        rows.append({
            "size_bytes": s,
            "memcpy_bw_mib_s": cp["bw_mib_s"], "shm_bw_mib_s": shm["bw_mib_s"], "tcp_bw_mib_s": tcp["bw_mib_s"],
            "shm_cma_bw_mib_s": runs["hixl_shm_cma"][s]["bw_mib_s"],
            "shm_cma_vs_memcpy_bw": runs["hixl_shm_cma"][s]["vs_ref_bw"],
            "mooncake_bw_mib_s": m.get("bw_mib_s", math.nan),
            "shm_lat_median_us": shm["lat_median_us"], "shm_lat_p99_us": shm["lat_p99_us"],
            "tcp_lat_median_us": tcp["lat_median_us"], "tcp_lat_p99_us": tcp["lat_p99_us"],
            "mooncake_lat_median_us": m.get("lat_median_us", math.nan),
            "shm_vs_memcpy_bw": shm["vs_ref_bw"],
            "shm_vs_mooncake_bw": ratio(shm["bw_mib_s"], m.get("bw_mib_s")),
            "shm_vs_mooncake_lat": ratio(shm["lat_median_us"], m.get("lat_median_us")),
            "tcp_vs_mooncake_bw": ratio(tcp["bw_mib_s"], m.get("bw_mib_s")),
        })
    cols = [("size[B]", "size_bytes", "%10d"), ("memcpy[MiB/s]", "memcpy_bw_mib_s", "%13.0f"),
            ("shm[MiB/s]", "shm_bw_mib_s", "%10.0f"), ("shm_cma[MiB/s]", "shm_cma_bw_mib_s", "%14.0f"),
            ("tcp[MiB/s]", "tcp_bw_mib_s", "%10.0f"),
            ("mc_tcp[MiB/s]", "mooncake_bw_mib_s", "%13.0f"), ("shm_lat_med[us]", "shm_lat_median_us", "%15.1f"),
            ("shm_lat_p99[us]", "shm_lat_p99_us", "%15.1f"), ("tcp_lat_med[us]", "tcp_lat_median_us", "%15.1f"),
            ("mc_lat_med[us]", "mooncake_lat_median_us", "%14.1f"), ("shm/memcpy[x]", "shm_vs_memcpy_bw", "%13.2f"),
            ("cma/memcpy[x]", "shm_cma_vs_memcpy_bw", "%13.2f"),
            ("shm/mc_bw[x]", "shm_vs_mooncake_bw", "%12.2f"), ("shm/mc_lat[x]", "shm_vs_mooncake_lat", "%13.3f"),
            ("tcp/mc_bw[x]", "tcp_vs_mooncake_bw", "%12.2f")]
    print("  ".join(h for h, _, _ in cols))
    for r in rows:
        print("  ".join((f % r[k]).rjust(len(h)) if not (isinstance(r[k], float) and math.isnan(r[k]))
                        else "n/a".rjust(len(h)) for h, k, f in cols))
    big = [r for r in rows if r["size_bytes"] >= MiB]
    goals = {
        "shm_ge_0.8x_memcpy_at_1MiB_plus": all(r["shm_vs_memcpy_bw"] >= 0.8 for r in big) if big else None,
        "shm_ge_5x_mooncake_bw": (all(r["shm_vs_mooncake_bw"] >= 5 for r in big) if mc and big else None),
        "shm_le_0.2x_mooncake_lat": (all(r["shm_vs_mooncake_lat"] <= 0.2 for r in rows) if mc else None),
        "tcp_ge_1x_mooncake_bw_at_1MiB_plus": (all(r["tcp_vs_mooncake_bw"] >= 1 for r in big) if mc and big else None),
        "tcp_ge_1x_mooncake_bw_all_sizes": (all(r["tcp_vs_mooncake_bw"] >= 1 for r in rows) if mc else None),
    }
    print("goals (reported, not enforced):", json.dumps(goals))
    print(mc_note)

    def clean(o):
        if isinstance(o, float) and math.isnan(o):
            return None
        if isinstance(o, dict):
            return {str(k): clean(v) for k, v in o.items()}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o
    report = {"meta": {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count(),
                       "hixl": hixl.__version__, "mooncake": mc_note, "units": "latency us, bandwidth MiB/s (2^20)"},
              "rows": rows, "runs": runs, "goals": goals}
    Path(a.json).write_text(json.dumps(clean(report), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
