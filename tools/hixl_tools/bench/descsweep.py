"""``hixl bench --desc-sweep``: the cost of descriptor-heavy transfers from Python.

Two engines of this process (target and initiator, the transports asked for) move ``count``
descriptors of ``size`` bytes per call, 1 .. 100,000 descriptors, three ways:

* ``list``: CANN's list of ``TransferOpDesc`` (one Python object per descriptor, built beforehand),
* ``numpy``: a descriptor array (``(N, 3)`` uint64),
* ``prepped``: prepared lists (:meth:`hixl.Hixl.prep_descs`, once) and two index arrays per call;

and, where NIXL is installed and runs on the transport (its UCX over TCP on the host), NIXL's
prepared path (``prep_xfer_dlist`` once, ``make_prepped_xfer`` + ``transfer`` per call) between two
agents of a child process.

Per call: ``submit`` = the ``transfer_async`` call alone (validation, resolution, posting; above
64 KiB per call the bytes move on the link's worker thread or the NIC, so for large counts this is
the CPU cost excluding the copy), ``total`` = until the transfer completed. Reported: medians and
p99 in us, descriptors per second (10^6) through submit and in total. A single-descriptor section
compares a Python loop (``transfer_async`` + ``transfer_wait``, window 128, 8 B) with the C++ engine
loop in the same process, and three more loops of the same shape: over the engine's pybind11
methods (no Python layer), over pybind11 bindings of the same signatures that do nothing, and over
C calls of ``hixl.Hixl``'s kind (``_core.fast_call``'s, from ``_perf.perf_fast_floor``) that do nothing (the
interpreter's and the calls' cost per request: with the C++ loop's, the ceiling of a Python loop over such calls). Goals (printed, and in the JSON; never an exit code): prepped submit
>= 5 M descriptors/s for 64 B descriptors; a 100,000-descriptor prepped transfer's submit <= 20 ms;
the Python single-request loop >= 0.8x the C++ loop.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np

COUNTS = [1, 10, 100, 1000, 10000, 100000]
SIZES = [64, 4096, 65536]
MAX_CALL_BYTES = 64 << 20  # combinations moving more per call are left out
SPAN = MAX_CALL_BYTES


def _pct(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


class _Pair:
    def __init__(self, transport: str, span: int):
        import hixl
        self.h = hixl
        self.tgt, self.ini = hixl.Hixl(), hixl.Hixl()
        from .server import engine_opts
        for e in (self.tgt, self.ini):
            # The bench's own options (one queue pair per rdma link, 4 MiB work requests, no send window), not
            # Soft-RoCE's defaults: the rows stay comparable with the main sweep's.
            if e.initialize("127.0.0.1:0", engine_opts(transport, 1)) != hixl.SUCCESS:
                raise RuntimeError("initialize (%s): %s" % (transport, e.last_error()))
        self.tbuf, self.ibuf = np.zeros(span, np.uint8), np.ones(span, np.uint8)
        self.ta, self.ia = self.tbuf.ctypes.data, self.ibuf.ctypes.data
        for e, a in ((self.tgt, self.ta), (self.ini, self.ia)):
            if e.register_mem(hixl.MemDesc(a, span))[0] != hixl.SUCCESS:
                raise RuntimeError("register_mem: " + e.last_error())
        self.peer = self.tgt.local_engine
        if self.ini.connect(self.peer, 30000) != hixl.SUCCESS:
            raise RuntimeError("connect: " + self.ini.last_error())
        self.lists: Dict[int, tuple] = {}

    def prepped(self, size: int, span: int) -> tuple:
        if size not in self.lists:
            n = span // size
            lh = self.ini.prep_descs(self.ia + np.arange(n, dtype=np.uint64) * np.uint64(size), size)[1]
            rh = self.ini.prep_descs(self.ta + np.arange(n, dtype=np.uint64) * np.uint64(size), size,
                                     remote_engine=self.peer)[1]
            if not lh or not rh:
                raise RuntimeError("prep_descs: " + self.ini.last_error())
            self.lists[size] = (lh, rh)
        return self.lists[size]

    def close(self) -> None:
        self.ini.finalize()
        self.tgt.finalize()


def _measure(submit, wait, repeats: int, budget_s: float) -> Dict[str, float]:
    sub, tot = [], []
    t_end = time.monotonic() + budget_s
    for k in range(repeats):
        t0 = time.perf_counter_ns()
        req = submit()
        t1 = time.perf_counter_ns()
        wait(req)
        t2 = time.perf_counter_ns()
        if k:  # the first call warms up (page faults, scratch growth)
            sub.append((t1 - t0) / 1e3)
            tot.append((t2 - t0) / 1e3)
        if k >= 3 and time.monotonic() > t_end:
            break
    return {"submit_med_us": statistics.median(sub), "submit_p99_us": _pct(sub, 0.99),
            "total_med_us": statistics.median(tot), "total_p99_us": _pct(tot, 0.99), "calls": len(sub)}


def sweep_transport(transport: str, counts: List[int], sizes: List[int], repeats: int, budget_s: float,
                    progress=None) -> List[Dict[str, Any]]:
    p = _Pair(transport, SPAN)
    h, rows = p.h, []

    def wait(req: int) -> None:
        rc, st = p.ini.transfer_wait(req, 120000)
        if rc != h.SUCCESS or st != h.TransferStatus.COMPLETED:
            raise RuntimeError("transfer_wait: %s %s" % (st, p.ini.last_error()))

    def checked(rc_req):
        rc, req = rc_req
        if rc != h.SUCCESS:
            raise RuntimeError("transfer: " + p.ini.last_error())
        return req
    try:
        for size in sizes:
            for count in counts:
                if count * size > MAX_CALL_BYTES:
                    continue
                off = np.arange(count, dtype=np.uint64) * np.uint64(size)
                arr = np.stack([p.ia + off, p.ta + off[::-1], np.full(count, size, np.uint64)], axis=1)
                lh, rh = p.prepped(size, SPAN)
                idx = np.arange(count, dtype=np.uint64)
                ridx = idx[::-1].copy()
                ways = {
                    "numpy": lambda: checked(p.ini.transfer_async(p.peer, h.WRITE, arr)),
                    "prepped": lambda: checked(p.ini.transfer_prepped_async(h.WRITE, lh, idx, rh, ridx)),
                }
                if count <= 10000:  # 100,000 Python objects per call measure Python, not us
                    lst = [h.TransferOpDesc(int(a), int(b), int(c)) for a, b, c in arr]
                    ways["list"] = lambda: checked(p.ini.transfer_async(p.peer, h.WRITE, lst))
                for way, submit in ways.items():
                    m = _measure(submit, wait, repeats, budget_s)
                    rows.append({"transport": transport, "way": way, "size_B": size, "count": count, **m,
                                 "submit_Mdesc_s": count / m["submit_med_us"],
                                 "total_Mdesc_s": count / m["total_med_us"]})
                    if progress:
                        progress(rows[-1])
        if not np.array_equal(p.tbuf[:sizes[0]], p.ibuf[:sizes[0]]):
            raise RuntimeError("the target's bytes differ from what was written")
    finally:
        p.close()
    return rows


def single_request(transport: str, iters: int = 20000, window: int = 128) -> Dict[str, Any]:
    """8 B, 1 descriptor per request, `window` outstanding: the C++ engine loop and a Python loop."""
    from .. import _perf
    p = _Pair(transport, 1 << 20)
    h = p.h
    try:
        cpp = []
        for _ in range(3):
            r = _perf.perf_engine_stream(p.ini._engine, p.peer, 1, -1, p.ia, p.ta, 1 << 20, 8, 1, iters, window, 60000)
            cpp.append(r["requests"] / (r["elapsed_ns"] / 1e9) / 1e6)
        descs = [[h.TransferOpDesc(p.ia + 8 * k, p.ta + 8 * k, 8)] for k in range(64)]
        e, peer, WRITE = p.ini, p.peer, h.WRITE
        eng = e._engine
        ia, ta = p.ia, p.ta

        slots = [(ia + 8 * k, ta + 8 * k) for k in range(64)]
        completed, COMPLETED, SUCCESS = int(h.TransferStatus.COMPLETED), h.TransferStatus.COMPLETED, h.SUCCESS
        floor_async, floor_wait = _perf.perf_call_floor_async, _perf.perf_call_floor_wait
        mask = window - 1  # a ring of the requests in flight (window: a power of two)

        # Three loops of one shape, each written out (a Python function per call would add its own cost),
        # with what a careful loop keeps in locals: the bound methods, the constants, a ring of requests.
        def hixl_api() -> None:  # CANN's API: hixl.Hixl, a one-descriptor list per call
            ta, tw, reqs = e.transfer_async, e.transfer_wait, [0] * window
            for i in range(iters):
                j = i & mask
                if i >= window and tw(reqs[j], 60000)[1] != COMPLETED:
                    raise RuntimeError("transfer_wait: " + e.last_error())
                rc, reqs[j] = ta(peer, WRITE, descs[i & 63])
                if rc != SUCCESS:
                    raise RuntimeError("transfer_async: " + e.last_error())
            for j in range(min(iters, window)):
                tw(reqs[j], 60000)

        def binding() -> None:  # the pybind11 methods under it, no Python layer
            ta, tw, reqs = eng.transfer_async_one, eng.transfer_wait, [0] * window
            for i in range(iters):
                j = i & mask
                if i >= window and tw(reqs[j], 60000)[1] != completed:
                    raise RuntimeError("transfer_wait: " + eng.last_error())
                la, ra = slots[i & 63]
                rc, reqs[j] = ta(peer, 1, la, ra, 8)
                if rc != 0:
                    raise RuntimeError("transfer_async_one: " + eng.last_error())
            for j in range(min(iters, window)):
                tw(reqs[j], 60000)

        def floor() -> None:  # bindings of the same signatures that do nothing (GIL released, as those)
            ta, tw, reqs = floor_async, floor_wait, [0] * window
            for i in range(iters):
                j = i & mask
                if i >= window and tw(reqs[j], 60000)[1] != 0:
                    raise RuntimeError("floor")
                la, ra = slots[i & 63]
                rc, reqs[j] = ta(peer, 1, la, ra, 8)
                if rc != 0:
                    raise RuntimeError("floor")
            for j in range(min(iters, window)):
                tw(reqs[j], 60000)

        def over_c_floor(call: Any) -> Callable[[], None]:
            # hixl.Hixl's C per-request calls (hixl/engine.py) doing nothing: their floor. One body for both
            # floors; the call is bound to locals once per run, so each request costs what a written-out loop does.
            def run() -> None:
                ta, tw, reqs = call, call, [0] * window
                for i in range(iters):
                    j = i & mask
                    if i >= window and tw(reqs[j], 60000)[1] != 0:
                        raise RuntimeError("floor")
                    rc, reqs[j] = ta(peer, WRITE, descs[i & 63])
                    if rc != SUCCESS:
                        raise RuntimeError("floor")
                for j in range(min(iters, window)):
                    tw(reqs[j], 60000)
            return run

        c_floor = over_c_floor(_perf.perf_fast_floor())  # GIL released, as the engine's calls
        # the GIL kept: what the GIL's two handovers per request cost
        c_floor_gil = over_c_floor(_perf.perf_fast_floor(release_gil=False))

        loops = {"python": hixl_api, "binding": binding, "floor": floor, "c_floor": c_floor,
                 "c_floor_gil": c_floor_gil}
        rates: Dict[str, List[float]] = {k: [] for k in loops}
        for _ in range(3):
            for k, run in loops.items():
                t0 = time.perf_counter_ns()
                run()
                rates[k].append(iters / ((time.perf_counter_ns() - t0) / 1e9) / 1e6)
    finally:
        p.close()
    c = statistics.median(cpp)
    y, b, f, cf, cg = (statistics.median(rates[k]) for k in ("python", "binding", "floor", "c_floor", "c_floor_gil"))
    # A Python loop costs at least the C++ loop's time per request plus the floor's: 1/c + 1/f.
    return {"transport": transport, "cpp_Mreq_s": c, "python_Mreq_s": y, "python/cpp": y / c,
            "binding_Mreq_s": b, "binding/cpp": b / c, "floor_Mreq_s": f, "ceiling/cpp": f / (f + c),
            "c_floor_Mreq_s": cf, "c_ceiling/cpp": cf / (cf + c),
            "c_floor_gil_Mreq_s": cg, "c_ceiling_gil/cpp": cg / (cg + c),
            "cpp_trials": cpp, "python_trials": rates["python"], "binding_trials": rates["binding"],
            "floor_trials": rates["floor"], "c_floor_trials": rates["c_floor"],
            "c_floor_gil_trials": rates["c_floor_gil"]}


def _nixl_rows(counts: List[int], sizes: List[int], repeats: int, budget_s: float) -> List[Dict[str, Any]]:
    """NIXL's prepared path (UCX over TCP) in a child process: one JSON line per point."""
    import subprocess
    import sys
    from .peers import nixl_unavailable
    why = nixl_unavailable()
    if why:
        return [{"skipped": why}]
    cmd = [sys.executable, "-m", "hixl_tools.bench.descsweep", json.dumps({"counts": counts, "sizes": sizes,
                                                                      "repeats": repeats, "budget_s": budget_s})]
    env = dict(__import__("os").environ, UCX_TLS="tcp,self")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode != 0 and not rows:
        return [{"skipped": "NIXL child failed: " + (r.stderr.strip().splitlines() or ["?"])[-1]}]
    return rows


def _nixl_child(cfg: Dict[str, Any]) -> int:
    from .peers import nixl_agents
    ini, _tgt, peer, (_lbuf, lbase), (_rbuf, rbase) = nixl_agents("sweep", SPAN)
    for size in cfg["sizes"]:
        n = SPAN // size
        lp = ini.prep_xfer_dlist("NIXL_INIT_AGENT", [(lbase + k * size, size, 0) for k in range(n)], "DRAM")
        rp = ini.prep_xfer_dlist(peer, [(rbase + k * size, size, 0) for k in range(n)], "DRAM")
        for count in cfg["counts"]:
            if count * size > MAX_CALL_BYTES:
                continue
            idx = np.arange(count)
            ridx = idx[::-1].copy()

            def submit():
                hdl = ini.make_prepped_xfer("WRITE", lp, idx, rp, ridx)
                st = ini.transfer(hdl)
                if st == "ERR":
                    raise RuntimeError("NIXL transfer failed")
                return hdl

            def wait(hdl):
                st = ini.check_xfer_state(hdl)
                while st == "PROC":
                    st = ini.check_xfer_state(hdl)
                if st != "DONE":
                    raise RuntimeError("NIXL transfer: " + st)
                ini.release_xfer_handle(hdl)
            m = _measure(submit, wait, cfg["repeats"], cfg["budget_s"])
            print(json.dumps({"transport": "tcp", "way": "nixl-prepped", "size_B": size, "count": count, **m,
                              "submit_Mdesc_s": count / m["submit_med_us"],
                              "total_Mdesc_s": count / m["total_med_us"]}), flush=True)
    return 0


def evaluate(rows: List[Dict[str, Any]], single: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    goals = []

    def find(t, way, size, count):
        return next((r for r in rows if r.get("transport") == t and r.get("way") == way and r.get("size_B") == size
                     and r.get("count") == count), None)
    for t in sorted({r["transport"] for r in rows if "transport" in r and r.get("way") != "nixl-prepped"}):
        r = find(t, "prepped", 64, 100000) or find(t, "prepped", 64, 10000)
        goals.append({"goal": "%s prepped 64 B: submit >= 5 M desc/s" % t, "value": r and r["submit_Mdesc_s"],
                      "met": bool(r and r["submit_Mdesc_s"] >= 5.0)})
        r = find(t, "prepped", 64, 100000)
        goals.append({"goal": "%s prepped 100,000 x 64 B: submit <= 20 ms" % t,
                      "value": r and r["submit_med_us"] / 1e3, "met": bool(r and r["submit_med_us"] <= 20000)})
    for s in single:
        goals.append({"goal": "%s python single-request loop >= 0.8x C++ engine loop" % s["transport"],
                      "value": s["python/cpp"], "met": s["python/cpp"] >= 0.8})
    return goals


def _table(rows: List[Dict[str, Any]]) -> str:
    cols = [("transport", "transport", "%s"), ("way", "way", "%s"), ("size[B]", "size_B", "%d"),
            ("count[#desc]", "count", "%d"), ("submit_med[us]", "submit_med_us", "%.1f"),
            ("submit_p99[us]", "submit_p99_us", "%.1f"), ("total_med[us]", "total_med_us", "%.1f"),
            ("total_p99[us]", "total_p99_us", "%.1f"), ("submit_rate[Mdesc/s]", "submit_Mdesc_s", "%.3f"),
            ("total_rate[Mdesc/s]", "total_Mdesc_s", "%.3f"), ("calls[#]", "calls", "%d")]
    body = [[fmt % r[k] for _, k, fmt in cols] for r in rows if "way" in r]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, (h, _, _) in enumerate(cols)]
    lines = ["  ".join(h.rjust(w) for (h, _, _), w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def main_sweep(transports: List[str], vs_nixl: bool, out: str, name: str, quick: bool,
               counts: Optional[List[int]] = None, sizes: Optional[List[int]] = None) -> int:
    counts = counts or COUNTS
    sizes = sizes or SIZES
    repeats, budget = (12, 1.0) if quick else (40, 3.0)
    rows: List[Dict[str, Any]] = []
    single: List[Dict[str, Any]] = []
    for t in transports:
        rows += sweep_transport(t, counts, sizes, repeats, budget)
        single.append(single_request(t, iters=5000 if quick else 20000))
    notes = []
    if vs_nixl:
        for r in _nixl_rows(counts, sizes, repeats, budget):
            if "skipped" in r:
                notes.append("nixl-prepped skipped: " + r["skipped"])
            else:
                rows.append(r)
    goals = evaluate(rows, single)
    text = ["hixl bench --desc-sweep: descriptors per call from Python (submit = the transfer_async call; "
            "total = until completed); Mdesc/s = 10^6 descriptors per second; us = microseconds", "",
            _table(rows), "", "single request (8 B, window 128): C++ engine loop vs Python loop [Mreq/s = 10^6 "
            "requests per second]"]
    for s in single:
        text.append("  %-4s  cpp %.3f Mreq/s  python %.3f Mreq/s  python/cpp %.2fx  |  pybind11 methods %.3f Mreq/s "
                    "(%.2fx)  no-op pybind11 %.3f Mreq/s: ceiling %.2fx  |  no-op C calls %.3f Mreq/s: ceiling %.2fx"
                    "  |  no-op C calls keeping the GIL %.3f Mreq/s: ceiling %.2fx"
                    % (s["transport"], s["cpp_Mreq_s"], s["python_Mreq_s"], s["python/cpp"], s["binding_Mreq_s"],
                       s["binding/cpp"], s["floor_Mreq_s"], s["ceiling/cpp"], s["c_floor_Mreq_s"],
                       s["c_ceiling/cpp"], s["c_floor_gil_Mreq_s"], s["c_ceiling_gil/cpp"]))
    if single:
        text.append("  (python: hixl.Hixl.transfer_async + transfer_wait, which an initialized engine runs as C calls; "
                    "pybind11 methods: the engine's bindings, no Python layer; no-op pybind11 / no-op C calls: the "
                    "same loop over calls of the same signatures that only release the GIL (keeping the GIL: that "
                    "do nothing at all); ceiling = the C++ loop's time per request plus the no-op loop's, against the "
                    "C++ loop's)")
    for n in notes:
        text.append("note: " + n)
    text += ["", "goals:"]
    for g in goals:
        v = g["value"]
        text.append("  %-6s %s  [%s]" % ("met" if g["met"] else "MISSED", g["goal"],
                                         "not measured" if v is None else "%.3f" % v))
    report = "\n".join(text)
    print(report)
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / (name + ".txt")).write_text(report + "\n")
    (d / (name + ".json")).write_text(json.dumps({"rows": rows, "single": single, "goals": goals, "notes": notes},
                                                 indent=1))
    print("files: %s, %s" % (d / (name + ".txt"), d / (name + ".json")))
    return 0


if __name__ == "__main__":  # the NIXL child
    import sys
    sys.exit(_nixl_child(json.loads(sys.argv[1])))
