#!/usr/bin/env python3
"""WRITE latency / bandwidth sweep: hixl's C++ path vs perftest (ib_write_lat / ib_write_bw), same device, same run.

Run inside the rxe VM (`bash ci/rxe-vm.sh python3 bench/write_sweep.py`) or on a real RoCE/IB host.
perftest runs first, then ours, on the same device, both ends on one host (rxe loops back internally).
Units: latency in microseconds (half round trip, as ib_write_lat reports), bandwidth in MiB/s
(2^20 bytes/s, perftest's "MB/sec"). Only ratios from one run mean anything under QEMU TCG.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

import hixl
from hixl_tools import _perf

MiB = 1 << 20


def ratio(ours, ref):
    """ours / ref; NaN when the reference printed 0 (perftest rounds tiny 8 B bandwidths to 0.00)."""
    return ours / ref if ref else float("nan")


def _json_safe(obj):
    """NaN is not JSON: write null."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def pct(xs, q):
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else float("nan")


# -- perftest ---------------------------------------------------------------------------------
PIN = {"on": False}  # --pin: server/responder on CPU 1, client/initiator on CPU 0, for perftest and hixl alike


def _taskset(cpu):
    return ["taskset", "-c", str(cpu)] if PIN["on"] else []


def _pin_this_thread(cpu):
    if PIN["on"]:
        os.sched_setaffinity(0, {cpu})  # pid 0 = the calling thread on Linux


def run_perftest(tool, size, iters, device, gid_index, server_ip, port, extra=()):
    base = [tool, "-d", device, "-x", str(gid_index), "-s", str(size), "-n", str(iters), "-F", "-p", str(port), *extra]
    srv = subprocess.Popen(_taskset(1) + base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    try:
        cli = subprocess.run(_taskset(0) + base + [server_ip], capture_output=True, text=True, timeout=600)
    finally:
        try:
            srv.wait(60)
        except subprocess.TimeoutExpired:
            srv.kill()
    out = cli.stdout
    if cli.returncode != 0:
        raise RuntimeError(f"{' '.join(base)} {server_ip} failed (rc={cli.returncode}):\n{out}\n{cli.stderr}")
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 5 and f[0] == str(size) and re.fullmatch(r"\d+", f[1]):
            return [float(x) for x in f[2:]]
    raise RuntimeError(f"could not parse {tool} output:\n{out}")


def perftest_lat(size, iters, a):
    # columns: t_min t_max t_typical t_avg t_stdev p99 p99.9
    v = run_perftest("ib_write_lat", size, iters, a.device, a.gid_index, a.server_ip, a.port_base)
    a.port_base += 1
    return {"typical_us": v[2], "p99_us": v[5]}


def perftest_bw(size, iters, a):
    # columns: BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]; MB = 2^20 (perftest: "MiB/sec")
    v = run_perftest("ib_write_bw", size, iters, a.device, a.gid_index, a.server_ip, a.port_base)
    a.port_base += 1
    return {"avg_MiBps": v[1], "peak_MiBps": v[0]}


# -- hixl (C++ path through the public Endpoint) -----------------------------------------------
class Pair:
    def __init__(self, device, gid_index, span):
        kw = dict(device=device, gid_index=gid_index)
        self.a, self.b = hixl.Endpoint(**kw), hixl.Endpoint(**kw)
        self.a.connect(self.b.info())
        self.b.connect(self.a.info())
        self.buf_a = np.zeros(2 * span, np.uint8)
        self.buf_b = np.zeros(2 * span, np.uint8)
        self.ma, self.mb = self.a.register(self.buf_a), self.b.register(self.buf_b)

    def latency(self, size, iters):
        out = {}

        def responder():
            _pin_this_thread(1)
            out["resp"] = _perf.perf_write_pingpong(self.b.raw, self.mb.addr, self.ma.addr + size, self.ma.rkey,
                                                    size, iters, False, 60000)

        self.buf_a[:] = 0
        self.buf_b[:] = 0
        t = threading.Thread(target=responder)
        t.start()
        _pin_this_thread(0)
        rtt = _perf.perf_write_pingpong(self.a.raw, self.ma.addr, self.mb.addr + size, self.mb.rkey, size, iters,
                                        True, 60000)
        t.join()
        half_us = [x / 2000.0 for x in rtt[max(1, iters // 10):]]  # drop warm-up
        return {"typical_us": statistics.median(half_us), "p99_us": pct(half_us, 99)}

    def bandwidth(self, size, iters, window, trials, descs_per_req=1, span=None):
        rates = []
        for _ in range(trials):
            r = _perf.perf_write_stream(self.a.raw, 1, self.ma.addr, self.mb.addr, self.mb.rkey,
                                        span or self.ma.length // 2, size, descs_per_req, iters, window)
            rates.append(r["bytes"] / (r["elapsed_ns"] / 1e9) / MiB)
        return {"avg_MiBps": statistics.median(rates), "p99_low_MiBps": pct(rates, 1)}

    def python_overhead(self, iters):
        """Per-call cost of one 8 B write + wait from Python vs the same loop in C++."""
        d = [(self.ma.addr, self.mb.addr, 8)]
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            self.a.wait_ok(self.a.write(d, self.mb.rkey))
        py_us = (time.perf_counter_ns() - t0) / iters / 1000
        r = _perf.perf_write_stream(self.a.raw, 1, self.ma.addr, self.mb.addr, self.mb.rkey, 4096, 8, 1, iters, 1)
        cpp_us = r["elapsed_ns"] / iters / 1000
        return {"python_write_wait_us": py_us, "cpp_write_wait_us": cpp_us, "python_overhead_us": py_us - cpp_us}

    def close(self):
        self.a.close()
        self.b.close()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="rxe0")
    ap.add_argument("--gid-index", type=int, default=1)
    ap.add_argument("--server-ip", default="192.168.77.1", help="the device's own address (perftest's OOB)")
    ap.add_argument("--sizes", default="8,64,512,4096,65536,1048576,16777216")
    ap.add_argument("--lat-iters", type=int, default=1000)
    ap.add_argument("--bw-bytes", type=int, default=64 * MiB, help="bytes per bandwidth measurement and size")
    ap.add_argument("--window", type=int, default=128, help="outstanding requests (perftest's tx-depth default)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--port-base", type=int, default=18515)
    ap.add_argument("--skip-perftest", action="store_true")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2,
                    help="pin both ends to CPUs 1 and 0, perftest and hixl alike (default: on with >= 2 CPUs)")
    ap.add_argument("--json", default="bench/results/write_sweep.json")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    PIN["on"] = a.pin
    span = max(max(sizes), 4 * MiB)

    rows = []
    for size in sizes:
        lat_iters = a.lat_iters if size <= 65536 else max(20, a.lat_iters // 20)
        bw_iters = max(5, min(5000, a.bw_bytes // size))
        row = {"size_B": size, "lat_iters": lat_iters, "bw_iters": bw_iters}
        if not a.skip_perftest:
            row["perftest_lat"] = perftest_lat(size, lat_iters, a)
            row["perftest_bw"] = perftest_bw(size, bw_iters, a)
        rows.append(row)
        print(f"perftest done for {size} B", file=sys.stderr, flush=True)

    pair = Pair(a.device, a.gid_index, span)
    try:
        for row in rows:
            size = row["size_B"]
            row["hixl_lat"] = pair.latency(size, row["lat_iters"])
            row["hixl_bw"] = pair.bandwidth(size, row["bw_iters"], min(a.window, row["bw_iters"]), a.trials)
            if "perftest_lat" in row:
                row["lat_ratio"] = ratio(row["hixl_lat"]["typical_us"], row["perftest_lat"]["typical_us"])
                row["bw_ratio"] = ratio(row["hixl_bw"]["avg_MiBps"], row["perftest_bw"]["avg_MiBps"])
            print(f"hixl done for {size} B", file=sys.stderr, flush=True)
        overhead = pair.python_overhead(500)
    finally:
        pair.close()

    hdr = (f"{'size[B]':>9} | {'ib_write_lat typ[us]':>20} {'hixl typ[us]':>12} {'hixl p99[us]':>12} {'lat ratio':>9} | "
           f"{'ib_write_bw[MiB/s]':>18} {'hixl[MiB/s]':>11} {'bw ratio':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        pl = r.get("perftest_lat", {}).get("typical_us", float("nan"))
        pb = r.get("perftest_bw", {}).get("avg_MiBps", float("nan"))
        print(f"{r['size_B']:>9} | {pl:>20.2f} {r['hixl_lat']['typical_us']:>12.2f} {r['hixl_lat']['p99_us']:>12.2f} "
              f"{r.get('lat_ratio', float('nan')):>9.2f} | {pb:>18.2f} {r['hixl_bw']['avg_MiBps']:>11.2f} "
              f"{r.get('bw_ratio', float('nan')):>8.2f}")
    print(f"python per-call overhead (8 B write+wait): python {overhead['python_write_wait_us']:.1f} us, "
          f"C++ {overhead['cpp_write_wait_us']:.1f} us, overhead {overhead['python_overhead_us']:.1f} us/call")
    report = {"device": a.device, "pinned": a.pin, "units": {"latency": "us (half round trip)", "bandwidth": "MiB/s (2^20 B/s)"},
              "rows": rows, "python_overhead": overhead}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(_json_safe(report), indent=2))
    print(f"JSON: {a.json}")


if __name__ == "__main__":
    main()
