"""``hixl bench``'s options: what can be swept, how sizes and lists are written, and the settings a run resolves them to."""
from __future__ import annotations

import argparse
import importlib
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence




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
    doc = importlib.import_module(__package__).__doc__ or ""  # the package's: what the bench measures
    ap = _Parser(prog="hixl bench", description=doc.split("\n\n")[0],
                 epilog="Units: B = bytes, KiB/MiB = 2^10/2^20 B, us = microseconds. See bench/README.md.",
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("what to sweep (comma-separated lists; every combination is measured)")
    g.add_argument("--transport", default=None, help="rdma,shm,tcp (default: rdma when a device is active, "
                                                       "else shm,tcp)")
    g.add_argument("--op", default="write", help="write,read,write_imm (write-with-immediate) [write]")
    g.add_argument("--sizes", default=None, help="bytes per descriptor: 8,4K,1M or ranges 8-64M[:x4] [%s]"
                                                 % FULL_SIZES)
    g.add_argument("--descs", default=None, help="descriptors per call, 1..4096 [1; --desc-sweep: 1..100,000, "
                                                 "default 1,10,100,1000,10000,100000]")
    g.add_argument("--desc-sweep", action="store_true",
                   help="instead: descriptors per call 1..100,000 from Python (TransferOpDesc lists, numpy "
                        "descriptor arrays, prepared lists; NIXL's prepared path with --vs nixl) on --transport")
    g.add_argument("--window", default="128", help="outstanding requests per thread, 1..4096 [128, perftest's "
                                                   "tx depth]")
    g.add_argument("--threads", default="1", help="initiator threads sharing the link, 1..64 [1]")
    g.add_argument("--qps", type=int, default=1, help="rdma engine path: queue pairs per link the bytes are "
                                                      "striped over (HixlRdmaQpsPerLink, both ends), 1..16 [1]")
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
    from hixl.endpoint import has_active_device
    return has_active_device()


def resolve(a: argparse.Namespace) -> Settings:
    if a.transport:
        transports = parse_choice(a.transport, "--transport", TRANSPORTS)
    else:
        transports = (["rdma"] if active_rdma() else []) + ["shm", "tcp"]
    if "rdma" in transports and not a.server_ip and not active_rdma():
        raise UsageError("--transport rdma: no RDMA device with an ACTIVE port here (see `hixl devices`); "
                         "run it inside the rxe VM: bash ci/rxe-vm.sh python3 -m hixl_tools.bench --transport rdma ...")
    ops = parse_choice(a.op, "--op", OPS, OP_ALIASES)
    sizes = parse_sizes(a.sizes or (QUICK_SIZES if a.quick else FULL_SIZES))
    descs = parse_ints(a.descs or "1", "--descs", 1, 4096)
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
    if not 1 <= a.qps <= 16:
        raise UsageError("--qps must be 1..16")
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

