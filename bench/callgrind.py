#!/usr/bin/env python3
"""User-space instructions per request, counted by callgrind on both sides.

Instruction counts do not care how loaded the machine is, so they judge a change to the request
path where timings (under QEMU TCG, on a shared 2-core host) cannot. Measured, for 8 B WRITEs,
one descriptor per request, window 128 (perftest's tx depth), on an RDMA device (rxe0 in the VM):

* ``perftest``: ``ib_write_bw`` server and client, each whole process under callgrind, run with
  1,000 and 20,000 iterations (PERFTEST_ITERS): per request = (Ir(20000) - Ir(1000)) / 19000
  (start-up cancels out). The spread is wide because perftest calibrates its clock at start by
  spinning on gettimeofday() for a fixed time, whose instruction count varies by +-200,000 from run
  to run under callgrind: over 400 requests (CI's n1/n2 for our side) that noise even made the
  per-request count negative once; over 19,000 it is +-10 per request. Requests are cheap here
  (a few hundred instructions each), so the wide spread costs no time;
* ``endpoint``: our C++ loop over one queue pair (``hixl_tools._perf.perf_write_stream``);
* ``engine``: our C++ loop over the engine behind ``hixl.Hixl`` (``perf_engine_stream``);
* ``python``: a Python loop over ``hixl.Hixl`` (``transfer_async`` + ``transfer_wait``).

Our sides are long-lived processes under callgrind, driven over stdin/stdout: the counters are
zeroed (``callgrind_control -z``) right before a stream of N requests and dumped (``-d``) right
after, for N1 and N2; per request = the difference / (N2 - N1), target and initiator added.

    bash ci/rxe-vm.sh python3 bench/callgrind.py --out ci-artifacts/callgrind    # in the rxe VM
    python3 bench/callgrind.py --paths engine --transport shm                   # on any host (no perftest)

Writes a table (instructions per request: each side, both, and ours / perftest's) and JSON.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

PATHS = ("endpoint", "engine", "python")
SIZE = 8
WINDOW = 128
SPAN = 1 << 20
PERFTEST_ITERS = (1000, 20000)  # see above: wide, so that perftest's start-up noise averages out


# ------------------------------------------------------------------------------ our two sides
def _side_main(role: str, path: str, transport: str) -> int:
    """A target or initiator, under callgrind; one command per stdin line, one JSON reply per line."""
    import numpy as np
    import hixl
    from hixl_tools import _perf
    out = sys.stdout

    def reply(**kw):
        out.write(json.dumps(kw) + "\n")
        out.flush()
    buf = np.zeros(SPAN, np.uint8)
    addr = buf.ctypes.data
    if path == "endpoint":
        ep = hixl.Endpoint()
        mr = ep.register(buf)
        if role == "target":
            port = ep.listen("127.0.0.1", 0)
            reply(port=port, addr=addr, rkey=mr.rkey)
            ep.accept(60000)
        else:
            peer = json.loads(sys.stdin.readline())
            ep.connect_tcp("127.0.0.1", peer["port"], 60000)
            reply(ready=True)
    else:
        e = hixl.Hixl()
        # One queue pair, as perftest (on Soft-RoCE the engine's default is 4: a lossy link's).
        if e.initialize("127.0.0.1:0", {"HixlTransport": transport, "HixlRdmaQpsPerLink": "1"}) != hixl.SUCCESS:
            reply(error="initialize: " + e.last_error())
            return 1
        if e.register_mem(hixl.MemDesc(addr, SPAN))[0] != hixl.SUCCESS:
            reply(error="register_mem: " + e.last_error())
            return 1
        if role == "target":
            reply(name=e.local_engine, addr=addr)
        else:
            peer = json.loads(sys.stdin.readline())
            if e.connect(peer["name"], 60000) != hixl.SUCCESS:
                reply(error="connect: " + e.last_error())
                return 1
            descs = [[hixl.TransferOpDesc(addr + SIZE * k, peer["addr"] + SIZE * k, SIZE)] for k in range(64)]
            reply(ready=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("quit"):
            break
        n = int(cmd["iters"])
        if role == "target":
            reply(done=True)
            continue
        if path == "endpoint":
            _perf.perf_write_stream(ep.raw, 1, addr, peer["addr"], peer["rkey"], SPAN, SIZE, 1, n, WINDOW, 0)
        elif path == "engine":
            _perf.perf_engine_stream(e._engine, peer["name"], 1, -1, addr, peer["addr"], SPAN, SIZE, 1, n, WINDOW,
                                     60000)
        else:
            inflight: List[int] = []
            for i in range(n):
                if len(inflight) >= WINDOW:
                    e.transfer_wait(inflight.pop(0), 60000)
                inflight.append(e.transfer_async(peer["name"], hixl.WRITE, descs[i & 63])[1])
            for r in inflight:
                e.transfer_wait(r, 60000)
        reply(done=True)
    return 0


def _local_dir() -> Optional[str]:
    """A local file system for vgdb's pipes and callgrind's files (in the rxe VM /tmp is 9p, where
    vgdb's shared memory cannot be mapped)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class _Proc:
    def __init__(self, args: List[str], out_dir: str, tag: str):
        self.out_file = os.path.join(out_dir, "cg.%s.out" % tag)
        self.prefix = os.path.join(tempfile.mkdtemp(prefix="hixl-vgdb-", dir=_local_dir()), "vgdb")
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=" + self.out_file, "--vgdb=yes",
               "--vgdb-prefix=" + self.prefix] + args
        # OpenBLAS's idle worker threads spin for a while and callgrind counts every thread: one thread.
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)

    def send(self, obj) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def recv(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("side exited: " + self.p.stderr.read()[-2000:])
        d = json.loads(line)
        if "error" in d:
            raise RuntimeError(d["error"])
        return d

    def control(self, flag: str) -> None:
        subprocess.run(["callgrind_control", "--vgdb-prefix=" + self.prefix, flag, str(self.p.pid)], check=True,
                       capture_output=True, timeout=600)

    def close(self) -> None:
        try:
            self.send({"quit": True})
            self.p.wait(120)
        except Exception:  # noqa: BLE001
            self.p.kill()


def _total_ir(path: str) -> int:
    """The instruction count (Ir) of a callgrind output file: its 'totals:' or 'summary:' line."""
    for line in Path(path).read_text(errors="replace").splitlines():
        m = re.match(r"(?:totals|summary):\s+(\d+)", line)
        if m:
            return int(m.group(1))
    raise RuntimeError("no totals in " + path)


def _dump_ir(proc: _Proc, before: set) -> int:
    """Ir of the dump callgrind_control -d just wrote (all threads' files of that dump)."""
    time.sleep(0.2)
    new = sorted(set(glob.glob(proc.out_file + "*")) - before)
    return sum(_total_ir(f) for f in new if re.search(r"\.\d+(-\d+)?$", f) or f.endswith(".out"))


def measure_ours(path: str, transport: str, n1: int, n2: int, out_dir: str) -> Dict[str, float]:
    me = [sys.executable, os.path.abspath(__file__)]
    tgt = _Proc(me + ["--side", "target", "--path", path, "--transport", transport], out_dir, path + ".target")
    ini = _Proc(me + ["--side", "initiator", "--path", path, "--transport", transport], out_dir, path + ".initiator")
    try:
        ini.send(tgt.recv())
        ini.recv()
        ini.send({"iters": 200})  # warm-up: first-touch, scratch growth, lazy binding
        ini.recv()
        per = {}
        for n in (n1, n2):
            for pr in (tgt, ini):
                pr.control("-z")
            ini.send({"iters": n})
            ini.recv()
            ir = {}
            for name, pr in (("target", tgt), ("initiator", ini)):
                before = set(glob.glob(pr.out_file + "*"))
                pr.control("-d")
                ir[name] = _dump_ir(pr, before)
            per[n] = ir
        return {side: (per[n2][side] - per[n1][side]) / (n2 - n1) for side in ("target", "initiator")}
    finally:
        ini.close()
        tgt.close()


def measure_perftest(device: str, gid: int, out_dir: str, n1: int = PERFTEST_ITERS[0],
                     n2: int = PERFTEST_ITERS[1]) -> Dict[str, float]:
    totals: Dict[int, Dict[str, int]] = {}
    for k, n in enumerate((n1, n2)):
        port = 18700 + k
        base = ["ib_write_bw", "-d", device, "-x", str(gid), "-s", str(SIZE), "-n", str(n), "-t", str(WINDOW), "-F",
                "-p", str(port)]
        files = {s: os.path.join(out_dir, "cg.perftest.%s.%d.out" % (s, n)) for s in ("target", "initiator")}
        vg = ["valgrind", "--tool=callgrind", "--vgdb=no"]
        srv = subprocess.Popen(vg + ["--callgrind-out-file=" + files["target"]] + base,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(8)  # the server is slow to start under callgrind
        for attempt in range(30):
            cli = subprocess.run(vg + ["--callgrind-out-file=" + files["initiator"]] + base
                                 + ["127.0.0.1"], capture_output=True, text=True, timeout=1200)
            if cli.returncode == 0:
                break
            time.sleep(2)
        else:
            srv.kill()
            raise RuntimeError("ib_write_bw client failed: " + cli.stdout[-500:] + cli.stderr[-500:])
        srv.wait(600)
        totals[n] = {s: _total_ir(f) for s, f in files.items()}
    return {s: (totals[n2][s] - totals[n1][s]) / (n2 - n1) for s in ("target", "initiator")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default="endpoint,engine,python", help="endpoint,engine,python [all]")
    ap.add_argument("--transport", default="rdma", help="rdma (with perftest), shm or tcp [rdma]")
    ap.add_argument("--n1", type=int, default=1000, help="requests of the first stream [1000]")
    ap.add_argument("--n2", type=int, default=3000, help="requests of the second stream [3000]")
    ap.add_argument("--device", default=os.environ.get("RXE_DEV", "rxe0"))
    ap.add_argument("--gid-index", type=int, default=int(os.environ.get("RXE_GID_INDEX", "1")))
    ap.add_argument("--out", default="bench-results/callgrind")
    ap.add_argument("--keep", action="store_true", help="keep callgrind's own files (in --out/raw) for "
                                                         "callgrind_annotate")
    ap.add_argument("--side", choices=("target", "initiator"), help=argparse.SUPPRESS)
    ap.add_argument("--path", default="engine", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        return _side_main(a.side, a.path, a.transport)
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        print("callgrind.py: valgrind (with callgrind_control) is not installed", file=sys.stderr)
        return 2
    paths = [p for p in a.paths.split(",") if p]
    if any(p not in PATHS for p in paths) or ("endpoint" in paths and a.transport != "rdma"):
        print("callgrind.py: --paths from %s (endpoint needs rdma)" % (PATHS,), file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = str(out / "raw") if a.keep else tempfile.mkdtemp(prefix="hixl-cg-", dir=_local_dir())
    os.makedirs(work, exist_ok=True)
    rows: List[dict] = []
    ref: Optional[float] = None
    if a.transport == "rdma":
        pt = measure_perftest(a.device, a.gid_index, work)
        ref = pt["target"] + pt["initiator"]
        rows.append({"path": "perftest (ib_write_bw)", **pt, "both": ref})
    for p in paths:
        r = measure_ours(p, a.transport, a.n1, a.n2, work)
        rows.append({"path": p, **r, "both": r["target"] + r["initiator"]})
    for r in rows:
        r["vs_perftest"] = r["both"] / ref if ref else None
    head = "%-24s %18s %18s %16s %16s" % ("path", "initiator[Ir/req]", "target[Ir/req]", "both[Ir/req]",
                                            "ours/perftest[x]")
    lines = ["callgrind, %s, %d B WRITE, 1 descriptor/request, window %d; Ir = user-space instructions, per request "
             "= (Ir(N2) - Ir(N1)) / (N2 - N1), ours N = %d, %d; perftest's %d, %d"
             % (a.transport, SIZE, WINDOW, a.n1, a.n2, *PERFTEST_ITERS), head, "-" * len(head)]
    for r in rows:
        lines.append("%-24s %18.0f %18.0f %16.0f %16s" % (r["path"], r["initiator"], r["target"], r["both"],
                                                       "-" if r["vs_perftest"] is None else "%.2f" % r["vs_perftest"]))
    eng = next((r for r in rows if r["path"] == "engine"), None)
    if eng and ref:
        lines.append("goal: engine path <= 2x perftest's instructions per request: %s (%.2fx)"
                     % ("met" if eng["vs_perftest"] <= 2 else "MISSED", eng["vs_perftest"]))
    text = "\n".join(lines)
    print(text)
    (out / "callgrind.txt").write_text(text + "\n")
    (out / "callgrind.json").write_text(json.dumps({"rows": rows, "n1": a.n1, "n2": a.n2, "size_B": SIZE,
                                                    "window": WINDOW, "transport": a.transport,
                                                    "perftest_iters": list(PERFTEST_ITERS)}, indent=1))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
