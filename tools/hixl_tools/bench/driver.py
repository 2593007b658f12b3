"""Runs a sweep: the bench server, our rows, the reference peers interleaved with them, the report; ``main``."""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import peers
from . import report
from .server import Ctl, Server
from .options import (
    GOAL_BW_ROUNDS, GOAL_BW_SIZES, KiB, MiB, PERFTEST_MIN_BW_ITERS, TRANSPORTS, Settings, UsageError, active_rdma,
    build_parser, parse_choice, parse_ints, parse_sizes, resolve)
from .sides import EndpointSide, EngineSide, PythonSide, Row, Side, build_rows, measure_row


def cpu_split(pin: bool) -> Tuple[Optional[set], Optional[set]]:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def start_local_server(s: Settings, cpus: Optional[set]) -> Tuple[subprocess.Popen, int]:
    a = s.args
    cmd = [sys.executable, "-m", "hixl_tools.bench", "--serve", "--once", "--listen", "127.0.0.1:0"]
    if a.device:
        cmd += ["--device", a.device]
    if a.gid_index is not None:
        cmd += ["--gid-index", str(a.gid_index)]
    if cpus:
        cmd += ["--cpus", ",".join(map(str, sorted(cpus)))]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    try:
        port = json.loads(line)["port"]
    except (ValueError, KeyError):
        proc.kill()
        raise RuntimeError("bench server did not start (printed %r)" % line) from None
    return proc, port


def peer_plan(s: Settings) -> List[Tuple[str, str]]:
    """(peer, protocol) pairs to run; protocol = the transport they stand against."""
    plan: List[Tuple[str, str]] = []
    for p in s.peers:
        if p == "perftest":
            plan.append(("perftest", "rdma"))
        elif p == "mooncake":
            plan += [("mooncake", "rdma" if t == "rdma" else "tcp") for t in s.transports]
        elif p == "mooncake-rdma":
            plan.append(("mooncake", "rdma"))
        elif p == "mooncake-tcp":
            plan.append(("mooncake", "tcp"))
        elif p == "nixl":
            plan += [("nixl", "rdma" if t == "rdma" else "tcp") for t in s.transports]
    out: List[Tuple[str, str]] = []
    for x in plan:
        if x not in out:
            out.append(x)
    return out


class Perftest:
    """perftest's client halves here, server halves on the bench server, one point at a time, so that
    they can interleave with ours: right after our endpoint path measured a size, perftest measures
    it too, and WRITE latencies <= 4 KiB alternate ours / perftest for ``lat_rounds`` rounds. Each
    side reports its best round (lowest median; all rounds are kept): under QEMU TCG, rxe work that
    a spinning CPU defers waits for the next timer tick (~4 ms) in phases that hit whichever tool
    runs then, and the best round is the one least hit, for both tools alike."""

    def __init__(self, ctl: Ctl, s: Settings, two_hosts: bool):
        why = peers.perftest_unavailable()
        if why:
            raise UsageError(why)
        self.ctl, self.s = ctl, s
        self.ip = ctl.server_ip if two_hosts else (s.args.data_ip or "127.0.0.1")
        self.port = 18515
        self.rows: Dict[Tuple[str, int], Dict[str, Any]] = {}

    def run(self, tool: str, dev: Tuple[str, int], size: int, iters: int) -> Dict[str, Any]:
        args = peers.perftest_args(tool, dev[0], dev[1], size, iters, self.port, self.s.window0)
        self.port += 1
        srv = self.ctl.call("perftest", args=args)
        try:
            out = peers.run_perftest_client(args, self.ip, 600)
        finally:
            self.ctl.call("perftest_wait", id=srv["id"], timeout_s=60)
        return peers.parse_perftest(tool, out, size)

    def point(self, op: str, size: int, dev: Tuple[str, int], hint: Dict[str, int]) -> Dict[str, Any]:
        row: Dict[str, Any] = {"peer": "perftest", "protocol": "rdma", "op": op, "size_B": size,
                               "window": self.s.window0}
        for kind in ("lat", "bw"):
            tool = peers.PERFTEST_TOOLS[(op, kind)]
            row.update(self.run(tool, dev, size, hint.get(kind, 1000)))
            row["tool_" + kind] = tool
        self.rows[(op, size)] = row
        return row

    def lat_round(self, op: str, size: int, dev: Tuple[str, int], iters: int) -> Dict[str, Any]:
        return self.run(peers.PERFTEST_TOOLS[(op, "lat")], dev, size, iters)


def _best_round(v: Dict[str, Any], prefix: str, rounds: List[Tuple[float, float]]) -> None:
    """Per-round (median, p99) -> the round with the lowest median gives both; every round kept."""
    v[prefix + "_rounds_us"] = [m for m, _ in rounds]
    good = [r for r in rounds if r[0] == r[0]]
    if good:
        best = min(good)
        v[prefix + "_med_us"], v[prefix + "_p99_us"] = best
        v[prefix + "_rounds"] = len(rounds)


def interleaved_perftest(pt: Perftest, side: "EndpointSide", row: Row, s: Settings) -> Dict[str, Any]:
    """perftest at this row's (op, size) now; extra alternating latency rounds for small WRITEs."""
    v = row.values
    hint = {"lat": max(5, int(v.get("half_rtt_iters" if row.op == "write" else "lat_iters", 100))),
            "bw": max(PERFTEST_MIN_BW_ITERS, int(v.get("bw_iters", 100)))}
    dev = (side.device, side.gid_index)
    prow = pt.point(row.op, row.size, dev, hint)
    # Bandwidth rounds alternate: one trial of ours after each perftest run, then perftest again, so
    # our trials bracket perftest's (a shared host drifts, rxe under TCG stalls in phases). Each
    # side reports the median of its runs; every run is in the JSON.
    # Both run the same number of requests per run (perftest's, >= PERFTEST_MIN_BW_ITERS). The sizes
    # a goal is judged at get at least GOAL_BW_ROUNDS rounds: one round under TCG can be off by 20 %.
    n = int(hint["bw"])
    rounds = max(s.bw_rounds, GOAL_BW_ROUNDS) if row.op == "write" and row.size in GOAL_BW_SIZES else s.bw_rounds
    theirs = [prow["bw_med_MiBps"]]
    trials = list(v["bw_trials_MiBps"])
    for k in range(max(1, rounds)):
        r = side.stream(row.op, row.size, 1, n, min(row.window, n), s.span)
        trials.append(r["bytes"] / (r["elapsed_ns"] / 1e9) / MiB)
        if k + 1 < rounds:
            got = pt.run(peers.PERFTEST_TOOLS[(row.op, "bw")], dev, row.size, hint["bw"])
            theirs.append(got["bw_med_MiBps"])
            prow["bw_calls"] += got["bw_calls"]
    good = [x for x in theirs if x == x]
    prow.update({"bw_rounds_MiBps": theirs, "bw_med_MiBps": statistics.median(good) if good else math.nan,
                 "bw_min_MiBps": min(good) if good else math.nan})
    v.update({"bw_trials_MiBps": trials, "bw_med_MiBps": statistics.median(trials), "bw_min_MiBps": min(trials),
              "rate_Mdesc_s": statistics.median(trials) * MiB / row.size / 1e6})
    if row.op == "write" and row.size <= 4 * KiB and s.lat_rounds > 1 and "half_rtt_med_us" in v:
        ours = [(v["half_rtt_med_us"], v["half_rtt_p99_us"])]
        theirs = [(prow.get("lat_med_us", math.nan), prow.get("lat_p99_us", math.nan))]
        for _ in range(s.lat_rounds - 1):
            hr = [x / 1e3 for x in side.half_rtt(row.size, hint["lat"])]  # same iterations as the first
            ours.append((statistics.median(hr), peers.pct(hr, 99)))
            r = pt.lat_round(row.op, row.size, dev, hint["lat"])
            theirs.append((r.get("lat_med_us", math.nan), r.get("lat_p99_us", math.nan)))
        _best_round(v, "half_rtt", ours)
        _best_round(prow, "lat", theirs)
    return prow


def run_mooncake(ctl: Ctl, s: Settings, protocol: str, dev: Tuple[str, int], local_ip: str,
                 tick: Callable[[str], None]) -> List[Dict[str, Any]]:
    why = peers.mooncake_unavailable()
    if why:
        raise UsageError(why)
    env = {"MC_GID_INDEX": str(dev[1])} if protocol == "rdma" else {}
    env.setdefault("MC_LOG_LEVEL", os.environ.get("MC_LOG_LEVEL", "ERROR"))
    ops = [o for o in s.ops if o in ("write", "read")]
    span = max(s.span, 2 * max(s.sizes))
    t = ctl.call("mooncake_target", protocol=protocol, bytes=span, device=dev[0], env=env)
    try:
        proc = peers.spawn(["mooncake-initiator", "--protocol", protocol, "--host", local_ip, "--device", dev[0],
                            "--session", t["session"], "--addr", str(t["addr"]), "--ops", ",".join(ops),
                            "--sizes", ",".join(map(str, s.sizes)), "--span", str(span), "--window",
                            str(s.window0), "--lat-iters", str(s.lat_iters), "--bw-bytes", str(s.bw_bytes),
                            "--trials", str(s.trials), "--budget-s", str(s.budget_s)], env)
        try:
            got = peers.read_json_lines(proc, 120 + 4 * s.budget_s * len(ops) * len(s.sizes),
                                        on_row=lambda r: tick("mooncake-%s %s %d B" % (protocol, r["op"], r["size_B"])))
        finally:
            peers.stop(proc)
    finally:
        ctl.call("close", id=t["id"])
    return [{"peer": "mooncake", "protocol": protocol, "window": s.window0, **r} for r in got]


def run_nixl(s: Settings, protocol: str, dev: Tuple[str, int], tick: Callable[[str], None]) -> List[Dict[str, Any]]:
    why = peers.nixl_unavailable()
    if why:
        raise UsageError(why)
    if protocol == "rdma":
        why = peers.nixl_rdma_unsupported(dev[0])
        if why:
            raise UsageError(why)
    tls = "rc_verbs,ud_verbs,self" if protocol == "rdma" else "tcp,self"
    env = {"UCX_TLS": tls}
    if protocol == "rdma":
        env["UCX_NET_DEVICES"] = "%s:1" % dev[0]
        env["UCX_IB_GID_INDEX"] = str(dev[1])

    ops = [o for o in s.ops if o in ("write", "read")]
    proc = peers.spawn(["nixl", "--ops", ",".join(ops), "--sizes", ",".join(map(str, s.sizes)),
                        "--span", str(s.span), "--window", str(s.window0), "--lat-iters", str(s.lat_iters),
                        "--bw-bytes", str(s.bw_bytes), "--trials", str(s.trials), "--budget-s", str(s.budget_s)],
                       env)
    try:
        got = peers.read_json_lines(proc, 120 + 4 * s.budget_s * len(ops) * len(s.sizes),
                                    on_row=lambda r: tick("nixl-%s %s %d B" % (protocol, r["op"], r["size_B"])))
    finally:
        peers.stop(proc)
    return [{"peer": "nixl", "protocol": protocol, "ucx_tls": tls, "window": s.window0, **r} for r in got]


# ------------------------------------------------------------------------------------------------ driver
class Progress:
    """rich.progress on stderr, refreshed between measurements only (no refresh thread competing with
    the measured loops); a plain line per step when rich is missing or --no-progress."""

    def __init__(self, total: int, enabled: bool):
        self.p = None
        self.enabled = enabled
        if enabled:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress as RP, TextColumn, TimeElapsedColumn
                self.p = RP(TextColumn("{task.description:<44}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=Console(stderr=True), auto_refresh=False, transient=False)
                self.p.start()
                self.task = self.p.add_task("hixl bench", total=total)
            except ImportError:
                self.p = None

    def tick(self, what: str, advance: int = 1) -> None:
        if self.p is not None:
            self.p.update(self.task, advance=advance, description=what[:44])
            self.p.refresh()
        elif self.enabled:
            print("  done: " + what, file=sys.stderr, flush=True)

    def note(self, msg: str) -> None:
        if self.p is not None:
            self.p.console.print(msg)
            self.p.refresh()
        else:
            print(msg, file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.p is not None:
            self.p.stop()


def run(s: Settings) -> Dict[str, Any]:
    a = s.args
    t_start = time.monotonic()
    mine, theirs = cpu_split(a.pin)
    saved = os.sched_getaffinity(0) if mine else None
    if mine:
        os.sched_setaffinity(0, mine)  # this thread; the threads and processes it starts inherit it
    try:
        return _run(s, t_start, mine, theirs)
    finally:
        if saved:
            os.sched_setaffinity(0, saved)


class _RunState:
    """What one run gathers besides its rows: notes, the peers' rows, the RDMA device measured on,
    perftest (started once, dropped at its first failure), the progress bar and the row cache."""

    def __init__(self, s: Settings, prog: Progress) -> None:
        a = s.args
        self.prog = prog
        self.notes: List[str] = []
        self.peer_rows: List[Dict[str, Any]] = []
        self.dev: Tuple[str, int] = (a.device or "", a.gid_index if a.gid_index is not None else -1)
        self.pt: Optional[Perftest] = None
        self.pt_failed = False
        self.cache: Dict[Tuple, Dict[str, Any]] = {}

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        self.prog.note(msg)

    def perftest_ok(self) -> bool:
        return self.pt is not None and not self.pt_failed


def _side(p: str, ctl: Ctl, s: Settings, t: str, local_ip: str, st: _RunState) -> Side:
    if p == "endpoint":
        side = EndpointSide(ctl, s)
        st.dev = (side.device, side.gid_index)  # type: ignore[attr-defined]
        return side
    if p == "engine":
        return EngineSide(ctl, s, t, local_ip)
    return PythonSide(ctl, s, t, local_ip)


def _measure_ours(rows: List[Row], ctl: Ctl, s: Settings, local_ip: str, st: _RunState) -> None:
    """Every row of ours, path by path; beside each endpoint WRITE/READ point, perftest on the same size
    right away (the same phase of the VM)."""
    for t in s.transports:
        for p in s.paths[t]:
            todo = [r for r in rows if r.transport == t and r.path == p]
            if not todo:
                continue
            side = _side(p, ctl, s, t, local_ip, st)
            try:
                side.verify()
                for r in todo:
                    imm = r.op == "write_imm" and p == "endpoint"
                    if imm:
                        side.imm(True)
                    try:
                        measure_row(side, r, s, st.cache)
                    finally:
                        if imm:
                            side.imm(False)
                    st.prog.tick("%s/%s %s %d B x%d w%d t%d" % (t, p, r.op, r.size, r.descs, r.window, r.threads))
                    if st.perftest_ok() and p == "endpoint" and r.op in ("write", "read") \
                            and r.descs == 1 and r.threads == 1 and r.window == s.window0:
                        try:
                            st.peer_rows.append(interleaved_perftest(st.pt, side, r, s))  # type: ignore[arg-type]
                            st.cache[(t, p, r.op, r.size, 1)].update(
                                {k: r.values[k] for k in r.values if k.startswith("half_rtt")})
                            st.prog.tick("perftest %s %d B" % (r.op, r.size))
                        except (RuntimeError, subprocess.SubprocessError, OSError) as ex:
                            st.note("perftest failed: %s" % ex)
                            st.pt_failed = True
            finally:
                side.close()


def _measure_peers(rows: List[Row], ctl: Ctl, s: Settings, local_ip: str, two_hosts: bool, st: _RunState) -> None:
    """The reference peers (perftest's points not yet paired with ours, Mooncake, NIXL)."""
    hints = _perftest_hints(rows, s)
    for peer, proto in peer_plan(s):
        label = peer if peer == "perftest" else "%s-%s" % (peer, proto)
        try:
            if peer == "perftest":
                if "rdma" not in s.transports:
                    raise UsageError("perftest compares with rdma only (add --transport rdma)")
                if not st.perftest_ok():
                    continue
                for op in [o for o in s.ops if o in ("write", "read")]:
                    for size in s.sizes:  # the points our endpoint path did not already pair with
                        if (op, size) not in st.pt.rows:  # type: ignore[union-attr]
                            st.peer_rows.append(st.pt.point(op, size, st.dev, hints.get((op, size), {})))  # type: ignore[union-attr]
                            st.prog.tick("perftest %s %d B" % (op, size))
            elif peer == "mooncake":
                st.peer_rows += run_mooncake(ctl, s, proto, st.dev, local_ip, st.prog.tick)
            elif peer == "nixl":
                if two_hosts:
                    raise UsageError("nixl runs both agents in one process: local mode only")
                st.peer_rows += run_nixl(s, proto, st.dev, st.prog.tick)
        except (UsageError, RuntimeError, subprocess.SubprocessError, OSError) as ex:
            st.note("%s skipped: %s" % (label, ex) if isinstance(ex, UsageError) else "%s failed: %s" % (label, ex))


def _stop_server(server: Optional[subprocess.Popen]) -> None:
    if server is None:
        return
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait(5)
    if server.stdout:
        server.stdout.close()


def _run(s: Settings, t_start: float, mine: Optional[set], theirs: Optional[set]) -> Dict[str, Any]:
    a = s.args
    two_hosts = bool(a.server_ip)
    server = None
    if two_hosts:
        ctl = Ctl(a.server_ip, a.server_port)
        local_ip = ctl.local_ip
    else:
        server, port = start_local_server(s, theirs)
        ctl = Ctl("127.0.0.1", port)
        local_ip = a.data_ip or "127.0.0.1"
    rows = build_rows(s)
    n_peer = sum(len(s.sizes) * len([o for o in s.ops if o in ("write", "read")]) for _ in peer_plan(s))
    st = _RunState(s, Progress(len(rows) + n_peer, a.progress))
    server_info = ctl.call("hello")
    try:
        if "perftest" in s.peers and "rdma" in s.transports:
            try:
                st.pt = Perftest(ctl, s, two_hosts)
            except UsageError as ex:
                st.note("perftest skipped: %s" % ex)
                st.pt_failed = True
        _measure_ours(rows, ctl, s, local_ip, st)
        if "rdma" in s.transports and st.dev[0] == "":
            from hixl.endpoint import Endpoint
            with Endpoint(a.device, gid_index=a.gid_index) as ep:
                info = ep.info()
                st.dev = (info["device"], info["gid_index"])
        _measure_peers(rows, ctl, s, local_ip, two_hosts, st)
    finally:
        t_measured = time.monotonic()
        st.prog.stop()
        ctl.close()
        _stop_server(server)
    import hixl
    dev = st.dev
    meta = {"hixl": hixl.__version__, "host": platform.node(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "pinned": bool(mine), "initiator_cpus": sorted(mine) if mine else None,
            "server": server_info, "two_hosts": two_hosts, "server_ip": a.server_ip,
            "rdma_device": dev[0] or None, "gid_index": dev[1] if dev[0] else None,
            "mooncake": peers.mooncake_version(), "argv": sys.argv[1:],
            "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "elapsed_s": round(time.monotonic() - t_start, 1),
            "measure_s": round(t_measured - t_start, 1),
            "settings": {"sizes": s.sizes, "ops": s.ops, "descs": s.descs, "windows": s.windows,
                         "threads": s.threads, "paths": s.paths, "lat_iters": s.lat_iters, "bw_bytes": s.bw_bytes,
                         "trials": s.trials, "budget_s": s.budget_s, "span_B": s.span, "quick": a.quick,
                         "rdma_qps_per_link": a.qps}}
    return {"meta": meta, "rows": rows, "peers": st.peer_rows, "notes": st.notes}


def _perftest_hints(rows: List[Row], s: Settings) -> Dict[Tuple[str, int], Dict[str, int]]:
    """perftest iterations: as many as our own measurement of that point ran (same bytes, same time)."""
    out: Dict[Tuple[str, int], Dict[str, int]] = {}
    for r in rows:
        if r.transport == "rdma" and r.path == "endpoint" and r.descs == 1 and r.threads == 1 \
                and r.window == s.window0 and r.op in ("write", "read"):
            lat = r.values.get("half_rtt_iters" if r.op == "write" else "lat_iters", 100)
            out[(r.op, r.size)] = {"lat": max(5, int(lat)),
                                   "bw": max(PERFTEST_MIN_BW_ITERS, int(r.values.get("bw_iters", 100)))}
    return out


def report_from_json(a: argparse.Namespace) -> int:
    """The report of an earlier run again (plots included), from its JSON."""
    path = Path(a.from_json)
    try:
        doc = json.loads(path.read_text())
        meta, rows, peer_rows = doc["meta"], doc["rows"], doc["peers"]
    except (OSError, ValueError, KeyError) as ex:
        raise UsageError("--from-json %s: not a hixl bench JSON (%s)" % (path, ex)) from None
    a.out = a.out or str(path.parent)
    a.name = a.name or path.stem
    windows = meta.get("settings", {}).get("windows") or [128]
    s = Settings(transports=sorted({r["transport"] for r in rows}), ops=[], sizes=[], descs=[], windows=windows,
                 threads=[], paths={}, peers=sorted({p["peer"] for p in peer_rows}),
                 lat_iters=0, bw_bytes=0, trials=0, budget_s=0, goals=bool(doc.get("goals")), args=a)
    report.emit({"meta": meta, "rows": rows, "peers": peer_rows, "notes": doc.get("notes", [])}, s)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    try:
        try:
            a = ap.parse_args(argv)
        except SystemExit as ex:  # --help
            return int(ex.code or 0)
        if a.serve and a.server_ip:
            raise UsageError("--serve and --server-ip exclude each other (server and client run on two hosts)")
        if a.serve:
            return Server(a).serve()
        if a.from_json:
            return report_from_json(a)
        if a.desc_sweep:
            from . import descsweep
            transports = parse_choice(a.transport, "--transport", TRANSPORTS) if a.transport else \
                (["rdma"] if active_rdma() else ["shm", "tcp"])
            vs = [v.strip() for v in (a.vs or "").split(",") if v.strip()]
            counts = parse_ints(a.descs, "--descs", 1, 100000) if a.descs else None
            sizes = parse_sizes(a.sizes) if a.sizes else None
            return descsweep.main_sweep(transports, "nixl" in vs, a.out or "bench-results", a.name or "hixl_descs",
                                        a.quick, counts, sizes)
        a.out = a.out or "bench-results"
        a.name = a.name or "hixl_bench"
        s = resolve(a)
    except UsageError as ex:
        print("%s: error: %s" % (ap.prog, ex), file=sys.stderr)
        print("usage: see `%s --help`" % ap.prog, file=sys.stderr)
        return 2
    try:
        res = run(s)
    except UsageError as ex:
        print("%s: error: %s" % (ap.prog, ex), file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as ex:
        print("%s: measurement failed: %s" % (ap.prog, ex), file=sys.stderr)
        return 1
    report.emit(res, s)
    return 0
