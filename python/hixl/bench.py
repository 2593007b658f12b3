"""``hixl bench``: sweep operation, message size, descriptors per call, outstanding requests, threads
and transport; compare with perftest, Mooncake and NIXL measured in the same run.

Two processes, as in production: this one (the initiator) and a bench server holding the targets
(a hixl engine, an RDMA endpoint, perftest's and Mooncake's server halves). Locally the server is a
child process (``python -m hixl.bench --serve``); across two hosts start it on the other host
(``hixl bench --serve --listen 0.0.0.0:18600``) and pass ``--server-ip``. With ``--pin`` (default on
>= 2 CPUs) the initiator runs on the first half of the CPUs and the server on the second half, and
every peer's halves inherit the same split.

Paths (``--path``):
  endpoint  C++ loops over one RC queue pair (``hixl.Endpoint``), rdma only: the floor of our stack.
  engine    C++ loops over the engine behind ``hixl.Hixl`` (transfer_async / transfer_sync), any transport.
  python    the same engine driven by a Python loop over ``hixl.Hixl`` (shows per-call Python cost).

Per configuration (transport, path, op, size, descs, window, threads):
  lat_med/p99[us]       one call alone (1 outstanding, 1 thread): submit -> completion seen by the caller
  half_rtt_med/p99[us]  rdma endpoint WRITE only: half the round trip of a write ping-pong, as ib_write_lat
  bw_med/min[MiB/s]     median / lowest trial of `window` requests kept in flight by each of `threads`
                        threads, `descs` descriptors of `size` bytes per request (MiB = 2^20 B)
  rate[Mdesc/s]         descriptors moved per second (median trial)
  req_p99[us]           a request's submit -> completion under that load (99th percentile)

With --vs perftest, perftest measures each size right after our endpoint path (one more trial of ours
follows, so ours brackets it), and WRITE latencies <= 4 KiB alternate ours / perftest for
--lat-rounds rounds, each tool's best round reported (see bench/README.md, "Under QEMU TCG").
--from-json writes the report of an earlier run again (plots where the measuring host had none).

Goals of issue 6 are evaluated when the data is there and reported (never an exit-code failure).
Exit codes: 0 done (even with goals missed or a peer skipped), 1 a measurement failed, 2 bad
arguments or an unusable environment (e.g. --transport rdma without an active device).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import bench_peers as peers
from . import bench_report as report
from .bench_server import Ctl, Server

MiB = 1 << 20
KiB = 1 << 10
OPS = ("write", "read", "write_imm")
TRANSPORTS = ("rdma", "shm", "tcp")
PATHS = ("endpoint", "engine", "python")
PEERS = ("perftest", "mooncake", "mooncake-rdma", "mooncake-tcp", "nixl")
FULL_SIZES = "8,64,512,4K,16K,64K,256K,1M,4M,16M,64M"
QUICK_SIZES = "8,4K,64K,1M,16M"
DEFAULT_PORT = 18600
OP_ALIASES = {"write": "write", "read": "read", "write_imm": "write_imm", "write-imm": "write_imm",
              "write-with-imm": "write_imm", "write_with_imm": "write_imm", "imm": "write_imm"}
GOAL_DESCS = 1000  # "1000 x 4 KiB descriptors in one call"
GOAL_BW_SIZES = (4 * 1024, 1 << 20)  # WRITE bandwidth goals are judged against ib_write_bw at these sizes
GOAL_BW_ROUNDS = 5
PERFTEST_MIN_BW_ITERS = 20  # ib_write_bw -n 8 printed "0.00" MiB/s at 1 MiB once


class UsageError(Exception):
    """Bad arguments or an environment that cannot run what was asked: exit code 2."""


# ------------------------------------------------------------------------------------ argument parsing
def parse_size(tok: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*", tok)
    if not m:
        raise UsageError("bad size %r (want e.g. 8, 4K, 1M, 64MiB)" % tok)
    return int(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": 1 << 30}[m.group(2).lower()]


def parse_sizes(spec: str) -> List[int]:
    """``8,4K,1M`` and ranges ``8-64M`` (powers of 2) or ``8-64M:x4`` (every 4x)."""
    out: List[int] = []
    for item in spec.split(","):
        if not item.strip():
            continue
        m = re.fullmatch(r"\s*([^-:]+)-([^:]+)(?::x(\d+))?\s*", item)
        if m:
            lo, hi, f = parse_size(m.group(1)), parse_size(m.group(2)), int(m.group(3) or 2)
            if f < 2 or lo > hi:
                raise UsageError("bad size range %r" % item)
            v = lo
            while v <= hi:
                out.append(v)
                v *= f
        else:
            out.append(parse_size(item))
    if not out:
        raise UsageError("no sizes given")
    for s in out:
        if not 1 <= s <= 1 << 30:
            raise UsageError("size %d B out of range (1 B .. 1 GiB)" % s)
    return sorted(set(out))


def parse_ints(spec: str, what: str, lo: int, hi: int) -> List[int]:
    try:
        vals = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise UsageError("%s: %r is not a comma-separated list of integers" % (what, spec)) from None
    if not vals or any(not lo <= v <= hi for v in vals):
        raise UsageError("%s must be integers in %d..%d, got %r" % (what, lo, hi, spec))
    return vals


def parse_choice(spec: str, what: str, allowed: Sequence[str], aliases: Optional[Dict[str, str]] = None) -> List[str]:
    out: List[str] = []
    for x in spec.split(","):
        x = x.strip().lower()
        if not x:
            continue
        x = (aliases or {}).get(x, x)
        if x not in allowed:
            raise UsageError("%s: unknown %r (choose from %s)" % (what, x, ", ".join(allowed)))
        if x not in out:
            out.append(x)
    if not out:
        raise UsageError("%s: empty list" % what)
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: same message style, exit 2
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="hixl bench", description=__doc__.split("\n\n")[0],
                 epilog="Units: B = bytes, KiB/MiB = 2^10/2^20 B, us = microseconds. See bench/README.md.",
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("what to sweep (comma-separated lists; every combination is measured)")
    g.add_argument("--transport", default=None, help="rdma,shm,tcp (default: rdma when a device is active, "
                                                       "else shm,tcp)")
    g.add_argument("--op", default="write", help="write,read,write_imm (write-with-immediate) [write]")
    g.add_argument("--sizes", default=None, help="bytes per descriptor: 8,4K,1M or ranges 8-64M[:x4] [%s]"
                                                 % FULL_SIZES)
    g.add_argument("--descs", default="1", help="descriptors per call, 1..4096 [1]")
    g.add_argument("--window", default="128", help="outstanding requests per thread, 1..4096 [128, perftest's "
                                                   "tx depth]")
    g.add_argument("--threads", default="1", help="initiator threads sharing the link, 1..64 [1]")
    g.add_argument("--path", default="auto", help="endpoint,engine,python [auto: rdma endpoint,engine; "
                                                   "shm/tcp engine]")
    g.add_argument("--quick", action="store_true", help="CI preset: sizes %s, fewer iterations, shorter "
                                                        "time budgets" % QUICK_SIZES)
    g.add_argument("--goals", action=argparse.BooleanOptionalAction, default=True,
                   help="add the configurations the issue-6 goals need and evaluate them [on]")
    p = ap.add_argument_group("peers")
    p.add_argument("--vs", default="", help="perftest,mooncake,mooncake-rdma,mooncake-tcp,nixl (mooncake = "
                                            "the protocol of the transport: rdma on rdma, tcp otherwise)")
    m = ap.add_argument_group("measurement")
    m.add_argument("--lat-iters", type=int, default=None, help="max calls per latency point [1000; quick 300]")
    m.add_argument("--bw-bytes", default=None, help="bytes per bandwidth trial [64M; quick 8M]")
    m.add_argument("--trials", type=int, default=None, help="bandwidth trials per point [3; quick 2]")
    m.add_argument("--budget-s", type=float, default=None, help="time budget per measurement, seconds "
                                                                "[4; quick 1.5]")
    m.add_argument("--lat-rounds", type=int, default=5, help="with --vs perftest: alternating ours/perftest "
                                                             "rounds of WRITE latency <= 4 KiB, best round "
                                                             "of each reported [5]")
    m.add_argument("--bw-rounds", type=int, default=3, help="with --vs perftest: alternating ours/perftest "
                                                            "bandwidth runs per size, the median of each "
                                                            "reported [3]")
    m.add_argument("--pin", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2,
                   help="initiator on the first half of the CPUs, server on the second [on with >= 2 CPUs]")
    m.add_argument("--target-mem", choices=("host", "acl"), default="host",
                   help="target memory of engine paths: numpy (host) or hixl.acl device memory (memfd) [host]")
    d = ap.add_argument_group("device and hosts")
    d.add_argument("--device", default=None, help="RDMA device [HIXL_DEVICE or the first active one]")
    d.add_argument("--gid-index", type=int, default=None, help="GID index [HIXL_GID_INDEX or RoCEv2 IPv4]")
    d.add_argument("--data-ip", default=None, help="address of the data side in local mode (engines, perftest, "
                                                   "Mooncake) [127.0.0.1]")
    d.add_argument("--server-ip", default=None, help="two hosts: the bench server's address (start it there "
                                                     "with --serve)")
    d.add_argument("--server-port", type=int, default=DEFAULT_PORT, help="two hosts: its port [%d]" % DEFAULT_PORT)
    d.add_argument("--serve", action="store_true", help="run the bench server (the target side) and wait")
    d.add_argument("--listen", default="0.0.0.0:%d" % DEFAULT_PORT, help="--serve: address:port to listen on")
    d.add_argument("--once", action="store_true", help=argparse.SUPPRESS)  # local child: exit after one client
    d.add_argument("--cpus", default=None, help=argparse.SUPPRESS)  # local child: its CPU set
    o = ap.add_argument_group("output")
    o.add_argument("--out", default=None, help="directory for the report files [bench-results; with --from-json: "
                                              "the JSON's directory]")
    o.add_argument("--name", default=None, help="file name prefix [hixl_bench; with --from-json: the JSON's name]")
    o.add_argument("--from-json", metavar="PATH", default=None,
                   help="measure nothing: write the report (table, CSV, ratios, goals, plots) again from the JSON "
                        "of an earlier run, e.g. on the host after a --no-plots run in the rxe VM")
    o.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True,
                   help="PNG plots with matplotlib [on; skipped with a message when missing]")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar [on]")
    return ap


@dataclass
class Settings:
    transports: List[str]
    ops: List[str]
    sizes: List[int]
    descs: List[int]
    windows: List[int]
    threads: List[int]
    paths: Dict[str, List[str]]
    peers: List[str]
    lat_iters: int
    bw_bytes: int
    trials: int
    budget_s: float
    goals: bool
    args: argparse.Namespace
    span: int = 0
    lat_rounds: int = 5
    bw_rounds: int = 3

    @property
    def window0(self) -> int:
        return 128 if 128 in self.windows else self.windows[0]


def active_rdma() -> bool:
    from .endpoint import has_active_device
    return has_active_device()


def resolve(a: argparse.Namespace) -> Settings:
    if a.transport:
        transports = parse_choice(a.transport, "--transport", TRANSPORTS)
    else:
        transports = (["rdma"] if active_rdma() else []) + ["shm", "tcp"]
    if "rdma" in transports and not a.server_ip and not active_rdma():
        raise UsageError("--transport rdma: no RDMA device with an ACTIVE port here (see `hixl devices`); "
                         "run it inside the rxe VM: bash ci/rxe-vm.sh python3 -m hixl.bench --transport rdma ...")
    ops = parse_choice(a.op, "--op", OPS, OP_ALIASES)
    sizes = parse_sizes(a.sizes or (QUICK_SIZES if a.quick else FULL_SIZES))
    descs = parse_ints(a.descs, "--descs", 1, 4096)
    windows = parse_ints(a.window, "--window", 1, 4096)
    threads = parse_ints(a.threads, "--threads", 1, 64)
    if a.path == "auto":
        paths = {t: (["endpoint", "engine"] if t == "rdma" else ["engine"]) for t in transports}
    else:
        want = parse_choice(a.path, "--path", PATHS)
        paths = {t: [p for p in want if p != "endpoint" or t == "rdma"] for t in transports}
        for t in transports:
            if not paths[t]:
                raise UsageError("--path endpoint is rdma only; transport %s needs engine or python" % t)
    vs = parse_choice(a.vs, "--vs", PEERS + ("all",)) if a.vs else []
    if "all" in vs:
        vs = ["perftest", "mooncake", "nixl"]
    for n, v in (("--lat-iters", a.lat_iters), ("--trials", a.trials), ("--lat-rounds", a.lat_rounds),
                 ("--bw-rounds", a.bw_rounds)):
        if v is not None and v < 1:
            raise UsageError("%s must be >= 1" % n)
    if a.budget_s is not None and a.budget_s <= 0:
        raise UsageError("--budget-s must be > 0")
    if a.server_ip and a.serve:
        raise UsageError("--serve and --server-ip exclude each other (server and client run on two hosts)")
    q = a.quick
    s = Settings(transports, ops, sizes, descs, windows, threads, paths, vs,
                 lat_iters=a.lat_iters or (300 if q else 1000),
                 bw_bytes=parse_size(a.bw_bytes) if a.bw_bytes else (16 * MiB if q else 64 * MiB),
                 trials=a.trials or (2 if q else 3), budget_s=a.budget_s or (1.5 if q else 4.0),
                 goals=a.goals, args=a, lat_rounds=a.lat_rounds, bw_rounds=a.bw_rounds)
    # Buffers: a ping-pong needs 2 x size; streams cycle descriptors through the span.
    s.span = max(32 * MiB, 2 * max(sizes))
    return s


def cpu_split(pin: bool) -> Tuple[Optional[set], Optional[set]]:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not pin or len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def start_local_server(s: Settings, cpus: Optional[set]) -> Tuple[subprocess.Popen, int]:
    a = s.args
    cmd = [sys.executable, "-m", "hixl.bench", "--serve", "--once", "--listen", "127.0.0.1:0"]
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


# -------------------------------------------------------------------------------------- our measurements
@dataclass
class Row:
    transport: str
    path: str
    op: str
    size: int
    descs: int
    window: int
    threads: int
    values: Dict[str, Any] = field(default_factory=dict)

    def key(self) -> Tuple:
        return (self.transport, self.path, self.op, self.size, self.descs, self.window, self.threads)


def _lat_stats(ns: Sequence[int]) -> Dict[str, float]:
    us = [x / 1e3 for x in ns]
    return {"lat_med_us": statistics.median(us), "lat_p99_us": peers.pct(us, 99), "lat_iters": len(us)}


def _calibrated(trial: Callable[[int], float], lo: int, hi: int, budget_s: float, first: int = 3) -> int:
    """How many iterations of `trial(n) -> seconds for n` fit in budget_s (lo..hi); warms up too."""
    n = max(1, min(lo, first))
    dt = trial(n)
    per = dt / n if dt > 0 else 1e-6
    return int(max(lo, min(hi, budget_s / per)))


class Side:
    """One measured path of one transport: the local half plus the server's half."""
    path = ""

    def latency(self, op: str, size: int, descs: int, iters: int) -> List[int]:
        raise NotImplementedError

    def stream(self, op: str, size: int, descs: int, iters: int, window: int, span: int) -> Dict[str, int]:
        raise NotImplementedError

    def verify(self) -> None:
        pass

    def imm(self, on: bool) -> None:
        pass

    def close(self) -> None:
        pass


class EndpointSide(Side):
    path = "endpoint"

    def __init__(self, ctl: Ctl, s: Settings):
        from .endpoint import Endpoint
        from . import _core
        self._core = _core
        self.ctl, self.span = ctl, s.span
        self.ep = Endpoint(s.args.device, gid_index=s.args.gid_index)
        self.buf = np.zeros(self.span, np.uint8)
        self.mr = self.ep.register(self.buf)
        t = ctl.call("endpoint_target", bytes=self.span)
        self.tid, self.raddr, self.rkey = t["id"], t["addr"], t["rkey"]
        self.ep.connect_tcp(t["host"], t["port"], 30000)
        ctl.call("join", id=self.tid)
        info = self.ep.info()
        self.device, self.gid_index = info["device"], info["gid_index"]

    def verify(self) -> None:
        n = 4096
        self.buf[:n] = np.arange(n, dtype=np.uint32).astype(np.uint8)
        self.ep.wait_ok(self.ep.write([(self.mr.addr, self.raddr, n)], self.rkey))
        self.ep.wait_ok(self.ep.read([(self.mr.addr + n, self.raddr, n)], self.rkey))
        if not np.array_equal(self.buf[:n], self.buf[n:2 * n]):
            raise RuntimeError("endpoint: bytes written and read back differ")

    def imm(self, on: bool) -> None:
        self.ctl.call("drain_imm", id=self.tid, on=on)

    def half_rtt(self, size: int, iters: int) -> List[int]:
        self.buf[:2 * size] = 0
        self.ctl.call("pingpong", id=self.tid, size=size, iters=iters, peer_addr=self.mr.addr, peer_rkey=self.mr.rkey)
        try:
            rtt = self._core.perf_write_pingpong(self.ep.raw, self.mr.addr, self.raddr + size, self.rkey, size,
                                                 iters, True, 60000)
        finally:
            self.ctl.call("join", id=self.tid)
        return [x // 2 for x in rtt]

    def latency(self, op: str, size: int, descs: int, iters: int) -> List[int]:
        n = min(descs, self.span // size)  # descriptors side by side (latency needs no cycling)
        return self._core.perf_op_latency(self.ep.raw, _rdma_op(op), self.mr.addr, self.raddr, self.rkey, size, n,
                                          iters, 60000)

    def stream(self, op: str, size: int, descs: int, iters: int, window: int, span: int, off: int = 0) -> Dict[str, int]:
        return self._core.perf_write_stream(self.ep.raw, _rdma_op(op), self.mr.addr + off, self.raddr + off,
                                            self.rkey, span, size, descs, iters, window)

    def close(self) -> None:
        self.ctl.call("close", id=self.tid)
        self.ep.close()


def _rdma_op(op: str) -> int:
    return {"read": 0, "write": 1, "write_imm": 2}[op]


class EngineSide(Side):
    path = "engine"

    def __init__(self, ctl: Ctl, s: Settings, transport: str, local_ip: str):
        import hixl
        from . import _core
        self.hixl, self._core = hixl, _core
        self.ctl, self.span = ctl, s.span
        self.e = hixl.Hixl()
        opts = {"HixlTransport": transport}
        if s.args.device:
            opts["HixlDevice"] = s.args.device
        if s.args.gid_index is not None:
            opts["HixlGidIndex"] = str(s.args.gid_index)
        if self.e.initialize(local_ip, opts) != hixl.SUCCESS:
            raise RuntimeError("Hixl.initialize(%s, %s): %s" % (local_ip, opts, self.e.last_error()))
        self.buf = np.zeros(self.span, np.uint8)
        self.addr = self.buf.ctypes.data
        if self.e.register_mem(hixl.MemDesc(self.addr, self.span))[0] != hixl.SUCCESS:
            raise RuntimeError("register_mem: " + self.e.last_error())
        t = ctl.call("engine_target", transport=transport, bytes=self.span, mem=s.args.target_mem)
        self.tid, self.remote, self.raddr = t["id"], t["name"], t["addr"]
        if self.e.connect(self.remote, 30000) != hixl.SUCCESS:
            raise RuntimeError("connect %s: %s" % (self.remote, self.e.last_error()))
        rc, got = self.e.get_transport(self.remote)
        if got != transport:
            raise RuntimeError("asked for transport %s, the link uses %r" % (transport, got))

    def verify(self) -> None:
        h, n = self.hixl, 4096
        self.buf[:n] = (np.arange(n) * 7 % 251).astype(np.uint8)
        w = [h.TransferOpDesc(self.addr, self.raddr, n)]
        r = [h.TransferOpDesc(self.addr + n, self.raddr, n)]
        if self.e.transfer_sync(self.remote, h.WRITE, w, 30000) != h.SUCCESS or \
                self.e.transfer_sync(self.remote, h.READ, r, 30000) != h.SUCCESS:
            raise RuntimeError("engine verify: " + self.e.last_error())
        if not np.array_equal(self.buf[:n], self.buf[n:2 * n]):
            raise RuntimeError("engine: bytes written and read back differ")

    @staticmethod
    def _op_flag(op: str) -> Tuple[int, int]:
        return (0, -1) if op == "read" else (1, 7 if op == "write_imm" else -1)

    def latency(self, op: str, size: int, descs: int, iters: int) -> List[int]:
        o, flag = self._op_flag(op)
        n = min(descs, self.span // size)
        return self._core.perf_engine_latency(self.e._engine, self.remote, o, flag, self.addr, self.raddr, size, n,
                                              iters, 60000)

    def stream(self, op: str, size: int, descs: int, iters: int, window: int, span: int, off: int = 0) -> Dict[str, int]:
        o, flag = self._op_flag(op)
        return self._core.perf_engine_stream(self.e._engine, self.remote, o, flag, self.addr + off,
                                             self.raddr + off, span, size, descs, iters, window, 60000)

    def close(self) -> None:
        self.e.finalize()
        self.ctl.call("close", id=self.tid)


class PythonSide(EngineSide):
    """The engine driven from Python through the public hixl.Hixl API."""
    path = "python"

    def _descs(self, size: int, n: int, off: int = 0, start: int = 0, span: int = 0) -> list:
        h, span = self.hixl, span or self.span
        slots = span // size
        return [h.TransferOpDesc(self.addr + off + ((start + k) % slots) * size,
                                 self.raddr + off + ((start + k) % slots) * size, size) for k in range(n)]

    def latency(self, op: str, size: int, descs: int, iters: int) -> List[int]:
        h, e = self.hixl, self.e
        o, flag = self._op_flag(op)
        d = self._descs(size, min(descs, self.span // size))
        out, clock = [], time.perf_counter_ns
        for _ in range(iters):
            t0 = clock()
            if e.transfer_sync(self.remote, o, d, 60000, flag=None if flag < 0 else flag) != h.SUCCESS:
                raise RuntimeError("transfer_sync: " + e.last_error())
            out.append(clock() - t0)
        return out

    def stream(self, op: str, size: int, descs: int, iters: int, window: int, span: int, off: int = 0) -> Dict[str, int]:
        h, e = self.hixl, self.e
        o, flag = self._op_flag(op)
        f = None if flag < 0 else flag
        calls = [self._descs(size, descs, off, i * descs, span) for i in range(min(iters, 64))]
        inflight: List[Tuple[int, int]] = []
        lat: List[int] = []
        clock = time.perf_counter_ns

        def reap() -> None:
            req, ts = inflight.pop(0)
            rc, st = e.transfer_wait(req, 60000)
            if rc != h.SUCCESS or st != h.TransferStatus.COMPLETED:
                raise RuntimeError("transfer_wait: %s %s" % (st, e.last_error()))
            lat.append(clock() - ts)
        t0 = clock()
        for i in range(iters):
            if len(inflight) >= window:
                reap()
            ts = clock()
            rc, req = e.transfer_async(self.remote, o, calls[i % len(calls)], flag=f)
            if rc != h.SUCCESS:
                raise RuntimeError("transfer_async: " + e.last_error())
            inflight.append((req, ts))
        while inflight:
            reap()
        lat.sort()
        return {"elapsed_ns": clock() - t0, "bytes": iters * descs * size, "requests": iters,
                "req_p50_ns": lat[(len(lat) - 1) // 2], "req_p99_ns": lat[min(len(lat) - 1, int(len(lat) * 0.99))]}


def measure_row(side: Side, row: Row, s: Settings, cache: Dict[Tuple, Dict[str, Any]]) -> None:
    v = row.values
    op, size, descs = row.op, row.size, row.descs
    lat_key = (row.transport, row.path, op, size, descs)
    if lat_key not in cache:
        lat_vals: Dict[str, Any] = {}
        hi = s.lat_iters

        def lat_trial(n: int) -> float:
            t0 = time.perf_counter()
            side.latency(op, size, descs, n)
            return time.perf_counter() - t0
        first = 1 if size * descs >= MiB else 3  # a big message is its own warm-up
        iters = _calibrated(lat_trial, 5, hi, s.budget_s / 2, first)
        lat_vals.update(_lat_stats(side.latency(op, size, descs, iters)))
        if isinstance(side, EndpointSide) and op == "write" and descs == 1:
            iters = _calibrated(lambda n: sum(side.half_rtt(size, n)) * 2 / 1e9, 5, hi, s.budget_s / 2, first)
            hr = [x / 1e3 for x in side.half_rtt(size, iters)]
            lat_vals.update({"half_rtt_med_us": statistics.median(hr), "half_rtt_p99_us": peers.pct(hr, 99),
                             "half_rtt_iters": len(hr)})
        cache[lat_key] = lat_vals
    v.update(cache[lat_key])

    per_req = size * descs
    window, nthreads = row.window, row.threads
    span = s.span // nthreads if s.span // nthreads >= size else s.span

    def offset(t: int) -> int:
        return t * span if span * nthreads <= s.span else 0

    def bw_trial(n: int) -> float:
        r = side.stream(op, size, descs, n, min(window, n), span)
        return r["elapsed_ns"] / 1e9
    want = max(1, math.ceil(s.bw_bytes / per_req))
    iters = _calibrated(bw_trial, min(want, max(2, window)), want, s.budget_s / s.trials)
    iters = max(1, iters // nthreads)
    rates, p50s, p99s = [], [], []
    for _ in range(s.trials):
        if nthreads == 1:
            res = [side.stream(op, size, descs, iters, min(window, iters), span)]
            wall = res[0]["elapsed_ns"]
        else:
            res = [None] * nthreads  # type: ignore[list-item]
            barrier = threading.Barrier(nthreads)
            errors: List[BaseException] = []

            def work(t: int) -> None:
                try:
                    barrier.wait()
                    res[t] = side.stream(op, size, descs, iters, min(window, iters), span, offset(t))
                except BaseException as ex:  # noqa: BLE001
                    errors.append(ex)
            ts = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
            t0 = time.perf_counter_ns()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            if errors:
                raise errors[0]
            wall = max(time.perf_counter_ns() - t0, max(r["elapsed_ns"] for r in res))
        moved = sum(r["bytes"] for r in res)
        rates.append(moved / (wall / 1e9) / MiB)
        p50s.append(max(r["req_p50_ns"] for r in res) / 1e3)
        p99s.append(max(r["req_p99_ns"] for r in res) / 1e3)
    mid = sorted(range(len(rates)), key=lambda i: rates[i])[(len(rates) - 1) // 2]
    v.update({"bw_med_MiBps": statistics.median(rates), "bw_min_MiBps": min(rates), "bw_trials_MiBps": rates,
              "rate_Mdesc_s": statistics.median(rates) * MiB / size / 1e6, "req_med_us": p50s[mid],
              "req_p99_us": p99s[mid], "bw_iters": iters * nthreads})


def build_rows(s: Settings) -> List[Row]:
    rows: List[Row] = []
    seen = set()

    def add(r: Row) -> None:
        if r.key() not in seen:
            seen.add(r.key())
            rows.append(r)
    for t in s.transports:
        for p, op, size, nd, w, th in itertools.product(s.paths[t], s.ops, s.sizes, s.descs, s.windows, s.threads):
            add(Row(t, p, op, size, nd, w, th))
        if s.goals and t == "rdma" and "write" in s.ops:
            add(Row(t, s.paths[t][0], "write", 4096, 1, s.window0, 1))
            for p in s.paths[t]:  # one call of 1000 descriptors: the C++ paths
                if p != "python":
                    add(Row(t, p, "write", 4096, GOAL_DESCS, s.window0, 1))
    return rows


# ------------------------------------------------------------------------------------------------ peers
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
    plan = peer_plan(s)
    n_peer = sum(len(s.sizes) * len([o for o in s.ops if o in ("write", "read")]) for _ in plan)
    prog = Progress(len(rows) + n_peer, a.progress)
    notes: List[str] = []
    peer_rows: List[Dict[str, Any]] = []
    dev: Tuple[str, int] = (a.device or "", a.gid_index if a.gid_index is not None else -1)
    server_info = ctl.call("hello")
    pt: Optional[Perftest] = None
    pt_failed = False

    def note(msg: str) -> None:
        notes.append(msg)
        prog.note(msg)
    try:
        cache: Dict[Tuple, Dict[str, Any]] = {}
        if "perftest" in s.peers and "rdma" in s.transports:
            try:
                pt = Perftest(ctl, s, two_hosts)
            except UsageError as ex:
                note("perftest skipped: %s" % ex)
                pt_failed = True
        for t in s.transports:
            for p in s.paths[t]:
                todo = [r for r in rows if r.transport == t and r.path == p]
                if not todo:
                    continue
                side: Side
                if p == "endpoint":
                    side = EndpointSide(ctl, s)
                    dev = (side.device, side.gid_index)  # type: ignore[attr-defined]
                elif p == "engine":
                    side = EngineSide(ctl, s, t, local_ip)
                else:
                    side = PythonSide(ctl, s, t, local_ip)
                try:
                    side.verify()
                    for r in todo:
                        imm = r.op == "write_imm" and p == "endpoint"
                        if imm:
                            side.imm(True)
                        try:
                            measure_row(side, r, s, cache)
                        finally:
                            if imm:
                                side.imm(False)
                        prog.tick("%s/%s %s %d B x%d w%d t%d" % (t, p, r.op, r.size, r.descs, r.window, r.threads))
                        if pt is not None and not pt_failed and p == "endpoint" and r.op in ("write", "read") \
                                and r.descs == 1 and r.threads == 1 and r.window == s.window0:
                            try:  # perftest right now, on the same size: the same phase of the VM
                                peer_rows.append(interleaved_perftest(pt, side, r, s))  # type: ignore[arg-type]
                                cache[(t, p, r.op, r.size, 1)].update(
                                    {k: r.values[k] for k in r.values if k.startswith("half_rtt")})
                                prog.tick("perftest %s %d B" % (r.op, r.size))
                            except (RuntimeError, subprocess.SubprocessError, OSError) as ex:
                                note("perftest failed: %s" % ex)
                                pt_failed = True
                finally:
                    side.close()
        if "rdma" in s.transports and dev[0] == "":
            from .endpoint import Endpoint
            with Endpoint(a.device, gid_index=a.gid_index) as ep:
                info = ep.info()
                dev = (info["device"], info["gid_index"])
        hints = _perftest_hints(rows, s)
        for peer, proto in plan:
            label = peer if peer == "perftest" else "%s-%s" % (peer, proto)
            try:
                if peer == "perftest":
                    if "rdma" not in s.transports:
                        raise UsageError("perftest compares with rdma only (add --transport rdma)")
                    if pt is None or pt_failed:
                        continue
                    for op in [o for o in s.ops if o in ("write", "read")]:
                        for size in s.sizes:  # the points our endpoint path did not already pair with
                            if (op, size) not in pt.rows:
                                peer_rows.append(pt.point(op, size, dev, hints.get((op, size), {})))
                                prog.tick("perftest %s %d B" % (op, size))
                elif peer == "mooncake":
                    peer_rows += run_mooncake(ctl, s, proto, dev, local_ip, prog.tick)
                elif peer == "nixl":
                    if two_hosts:
                        raise UsageError("nixl runs both agents in one process: local mode only")
                    peer_rows += run_nixl(s, proto, dev, prog.tick)
            except (UsageError, RuntimeError, subprocess.SubprocessError, OSError) as ex:
                note("%s skipped: %s" % (label, ex) if isinstance(ex, UsageError) else "%s failed: %s" % (label, ex))
    finally:
        t_measured = time.monotonic()
        prog.stop()
        ctl.close()
        if server is not None:
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(5)
            if server.stdout:
                server.stdout.close()
    import hixl
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
                         "trials": s.trials, "budget_s": s.budget_s, "span_B": s.span, "quick": a.quick}}
    return {"meta": meta, "rows": rows, "peers": peer_rows, "notes": notes}


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


if __name__ == "__main__":
    sys.exit(main())
