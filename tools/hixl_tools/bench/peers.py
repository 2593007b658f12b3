"""Reference peers for ``hixl bench --vs``: perftest, Mooncake's transfer engine, NIXL (UCX backend).

Each peer is measured on the same sizes, in the same run, under the same CPU pinning as hixl:

* perftest (``ib_write_bw`` / ``ib_write_lat`` / ``ib_read_bw`` / ``ib_read_lat``, rdma only): the
  server half is started by the bench server (``hixl_tools.bench``), the client half here.
  ``*_lat``: ``t_typical`` (perftest's median) and its 99th percentile; ``ib_write_lat`` reports half
  a round trip of a write ping-pong, ``ib_read_lat`` the time of one read. ``*_bw``: ``BW average``
  (perftest's "MB/sec" is MiB/s, 2^20 B/s).
* Mooncake (PyPI ``mooncake-transfer-engine-non-cuda``): a target engine and an initiator engine in
  two processes (P2PHANDSHAKE metadata), protocol ``rdma`` (the same device and GID index as hixl)
  or ``tcp``. Latency: one ``transfer_sync_write/read`` call. Bandwidth: back-to-back
  ``batch_transfer_sync_write/read`` calls of ``window`` entries (Mooncake's own batching: the same
  number of transfers in flight as hixl's window).
* NIXL (PyPI ``nixl-cu12``, optional): two agents with the UCX backend in one process; ``UCX_TLS``
  chooses what UCX may use. Latency: one ``transfer`` + polling to DONE; bandwidth: ``window``
  descriptors per transfer, back to back.

Every loop is bounded by a time budget as well as an iteration count (a slow peer under QEMU TCG
must not stall the sweep): the iterations actually run are reported.

``python -m hixl_tools.bench.peers mooncake-target|mooncake-initiator|nixl ...`` are the child processes;
they speak one JSON object per line on stdout.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import json
import math
import mmap
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

MiB = 1 << 20

MOONCAKE_PIP = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
NIXL_PIP = "nixl-cu12 (pip install --no-deps nixl-cu12: it declares torch, which it needs only for tensors)"

PERFTEST_TOOLS = {("write", "lat"): "ib_write_lat", ("write", "bw"): "ib_write_bw",
                  ("read", "lat"): "ib_read_lat", ("read", "bw"): "ib_read_bw"}


# ------------------------------------------------------------------------------------------ helpers
def pct(xs: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation; NaN for no samples."""
    s = sorted(xs)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def lat_summary(samples_us: Sequence[float]) -> Dict[str, float]:
    return {"lat_med_us": statistics.median(samples_us) if samples_us else math.nan,
            "lat_p99_us": pct(samples_us, 99), "lat_iters": len(samples_us)}


def timed_latency(call: Callable[[], None], iters: int, budget_s: float, warmup: int = 3) -> List[float]:
    """Per-call wall time (us) of up to ``iters`` calls, stopping early once ``budget_s`` passed
    (at least 5 samples); the first ``warmup`` calls are not timed."""
    for _ in range(warmup):
        call()
    out: List[float] = []
    clock = time.perf_counter_ns
    stop = time.monotonic() + budget_s
    for i in range(iters):
        t0 = clock()
        call()
        out.append((clock() - t0) / 1e3)
        if i >= 4 and time.monotonic() > stop:
            break
    return out


def timed_bandwidth(call: Callable[[], None], bytes_per_call: int, target_bytes: int, trials: int,
                    budget_s: float) -> Dict[str, Any]:
    """``trials`` trials of back-to-back calls, each moving about ``target_bytes`` (>= 1 call) but
    cut short after ``budget_s / trials`` seconds. MiB/s per trial."""
    calls = max(1, math.ceil(target_bytes / bytes_per_call))
    rates = []
    done_calls = []
    for _ in range(trials):
        stop = time.monotonic() + budget_s / trials
        t0 = time.perf_counter()
        n = 0
        while n < calls:
            call()
            n += 1
            if time.monotonic() > stop:
                break
        rates.append(n * bytes_per_call / (time.perf_counter() - t0) / MiB)
        done_calls.append(n)
    return {"bw_med_MiBps": statistics.median(rates), "bw_min_MiBps": min(rates), "bw_trials_MiBps": rates,
            "bw_calls": done_calls}


def alloc(nbytes: int):
    """Page-aligned zeroed anonymous memory: (mmap, address)."""
    buf = mmap.mmap(-1, nbytes)
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _die_with_parent() -> None:
    try:  # Linux: SIGKILL this child when its parent dies
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001
        pass


def _emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def dist_version(*names: str) -> Optional[str]:
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# ----------------------------------------------------------------------------------------- perftest
def perftest_unavailable() -> Optional[str]:
    missing = [t for t in sorted(set(PERFTEST_TOOLS.values())) if shutil.which(t) is None]
    if missing:
        return "perftest not installed (%s missing; apt-get install perftest)" % ", ".join(missing)
    return None


def perftest_args(tool: str, device: str, gid_index: int, size: int, iters: int, port: int,
                  tx_depth: Optional[int] = None) -> List[str]:
    """Arguments shared by both halves (the client appends the server's address)."""
    args = [tool, "-d", device, "-x", str(gid_index), "-s", str(size), "-n", str(max(5, iters)), "-F",
            "-p", str(port)]
    if tx_depth and tool.endswith("_bw"):
        args += ["-t", str(tx_depth)]
    return args


def parse_perftest(tool: str, out: str, size: int) -> Dict[str, float]:
    """The result line of a perftest client: ``#bytes #iterations ...``."""
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 5 and f[0] == str(size) and re.fullmatch(r"\d+", f[1]):
            # perftest prints "inf" when a run is too short for its percentiles: not a number we keep
            v = [float(x) if math.isfinite(float(x)) else math.nan for x in f[2:]]
            if tool.endswith("_lat"):  # t_min t_max t_typical t_avg t_stdev 99% 99.9%
                return {"lat_med_us": v[2], "lat_p99_us": v[5], "lat_iters": int(f[1])}
            # BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]; MB = 2^20 B
            return {"bw_med_MiBps": v[1], "bw_peak_MiBps": v[0], "msg_rate_Mpps": v[2], "bw_calls": [int(f[1])]}
    raise RuntimeError("could not parse %s output:\n%s" % (tool, out[-2000:]))


def run_perftest_client(args: List[str], server_ip: str, timeout_s: float) -> str:
    cp = subprocess.run(args + [server_ip], capture_output=True, text=True, timeout=timeout_s)
    if cp.returncode != 0:
        raise RuntimeError("%s %s failed (rc=%d):\n%s\n%s" % (" ".join(args), server_ip, cp.returncode,
                                                               cp.stdout[-1500:], cp.stderr[-1500:]))
    return cp.stdout


# ----------------------------------------------------------------------------------------- Mooncake
def mooncake_unavailable() -> Optional[str]:
    if importlib.util.find_spec("mooncake") is None:
        return "Mooncake transfer engine not importable (pip install %s)" % MOONCAKE_PIP
    return None


def mooncake_version() -> Optional[str]:
    return dist_version("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine")


def _mc_engine(host: str, protocol: str, device: str):
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from mooncake.engine import TransferEngine  # noqa: WPS433 (lazy: heavy, optional)
    e = TransferEngine()
    rc = e.initialize(host, "P2PHANDSHAKE", protocol, device if protocol == "rdma" else "")
    if rc != 0:
        raise RuntimeError("TransferEngine.initialize(%r, 'P2PHANDSHAKE', %r, %r) returned %d"
                           % (host, protocol, device, rc))
    return e


def mooncake_target_main(a: argparse.Namespace) -> int:
    """Registers a buffer, prints {"session", "addr"}, serves until stdin closes."""
    _die_with_parent()
    try:
        e = _mc_engine(a.host, a.protocol, a.device)
        buf, addr = alloc(a.bytes)
        if e.register_memory(addr, a.bytes) != 0:
            raise RuntimeError("register_memory(%d B) failed" % a.bytes)
        _emit({"session": "%s:%d" % (a.host, e.get_rpc_port()), "addr": addr, "len": a.bytes})
    except Exception as ex:  # noqa: BLE001
        _emit({"error": "%s: %s" % (type(ex).__name__, ex)})
        return 1
    sys.stdin.read()
    e.unregister_memory(addr)
    del buf
    return 0


def mooncake_initiator_main(a: argparse.Namespace) -> int:
    """Measures every (op, size) against the target; prints one JSON line per size, then {"done"}."""
    _die_with_parent()
    try:
        e = _mc_engine(a.host, a.protocol, a.device)
        span = a.span
        buf, base = alloc(span)
        if e.register_memory(base, span) != 0:
            raise RuntimeError("register_memory(%d B) failed" % span)
        sess, raddr = a.session, a.addr
        for op in a.ops.split(","):
            single = e.transfer_sync_write if op == "write" else e.transfer_sync_read
            batch = e.batch_transfer_sync_write if op == "write" else e.batch_transfer_sync_read
            for size in [int(s) for s in a.sizes.split(",")]:
                # correctness once: a pattern written (or read) must arrive intact
                pattern = bytes((i * 131 + size) & 0xFF for i in range(min(size, 4096)))
                if op == "write":
                    buf[0:len(pattern)] = pattern
                    if single(sess, base, raddr, size) != 0:
                        raise RuntimeError("verify write of %d B failed" % size)
                    buf[0:len(pattern)] = bytes(len(pattern))
                    if e.transfer_sync_read(sess, base, raddr, size) != 0 or buf[0:len(pattern)] != pattern:
                        raise RuntimeError("read-back of a %d B write differs" % size)

                def one(size=size, single=single):
                    if single(sess, base, raddr, size) != 0:
                        raise RuntimeError("transfer of %d B failed" % size)
                lat = timed_latency(one, a.lat_iters, a.budget_s)
                n = max(1, min(a.window, span // size))
                locs = [base + (k * size) % (span - size + 1) for k in range(n)]
                rems = [raddr + (k * size) % (span - size + 1) for k in range(n)]
                lens = [size] * n

                def many(locs=locs, rems=rems, lens=lens, batch=batch):
                    if batch(sess, locs, rems, lens) != 0:
                        raise RuntimeError("batch transfer failed")
                bw = timed_bandwidth(many, n * size, a.bw_bytes, a.trials, a.budget_s)
                _emit({"op": op, "size_B": size, "batch": n, **lat_summary(lat), **bw})
        e.unregister_memory(base)
        _emit({"done": True})
    except Exception as ex:  # noqa: BLE001
        _emit({"error": "%s: %s" % (type(ex).__name__, ex)})
        return 1
    return 0


# --------------------------------------------------------------------------------------------- NIXL
def _nixl_api():
    for mod in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            if importlib.util.find_spec(mod.split(".")[0]) is None:
                continue
            m = __import__(mod, fromlist=["nixl_agent"])
            return m
        except Exception:  # noqa: BLE001 - a broken install is "not available" too
            continue
    return None


def nixl_unavailable() -> Optional[str]:
    """None when NIXL's Python API imports, else why not (a stray ``nixl/`` directory on sys.path is a
    namespace package, not NIXL: only a real import counts)."""
    if _nixl_api() is not None:
        return None
    return "NIXL not importable (%s)" % NIXL_PIP


def nixl_rdma_unsupported(device: str) -> Optional[str]:
    """Why NIXL (the nixl-cu12 wheel) cannot drive `device`, or None.

    The wheel bundles its own libibverbs (rdma-core 48, providers looked up under /usr/lib64) with
    only the mlx5 provider inside. This system's providers register with this system's libibverbs,
    not the bundled one, so UCX in the wheel sees no other device (seen on rxe0: "transport
    'rc_verbs' is not available")."""
    drv = "/sys/class/infiniband/%s/device/driver" % device
    driver = os.path.basename(os.path.realpath(drv)) if os.path.exists(drv) else None
    if driver == "mlx5_core":
        return None
    return ("NIXL from PyPI (nixl-cu12) bundles libibverbs with the mlx5 provider only; %s (driver %s) is "
            "invisible to its UCX: NIXL over RDMA needs an mlx5 NIC here" % (device, driver or "rxe/unknown"))


def nixl_agents(prefix: str, span: int):
    """Two UCX agents of this process, each with `span` bytes of DRAM registered, the initiator
    knowing the target: (initiator, target, the target's name, (lbuf, lbase), (rbuf, rbase))."""
    import logging
    logging.getLogger("nixl").setLevel(logging.WARNING)
    api = _nixl_api()
    if api is None:
        raise RuntimeError(nixl_unavailable() or "NIXL import failed")
    cfg = api.nixl_agent_config(backends=["UCX"])
    ini, tgt = api.nixl_agent(prefix + "-initiator", cfg), api.nixl_agent(prefix + "-target", cfg)
    local, remote = alloc(span), alloc(span)
    ini.register_memory([(local[1], span, 0, "")], "DRAM")
    tgt.register_memory([(remote[1], span, 0, "")], "DRAM")
    return ini, tgt, ini.add_remote_agent(tgt.get_agent_metadata()), local, remote


def nixl_main(a: argparse.Namespace) -> int:
    """Two UCX agents in this process, initiator -> target; one JSON line per size."""
    _die_with_parent()
    try:
        span = a.span
        ini, tgt, peer, (lbuf, lbase), (rbuf, rbase) = nixl_agents("hixl-bench", span)
        for op in a.ops.split(","):
            for size in [int(s) for s in a.sizes.split(",")]:
                def xfer(n, size=size, op=op):
                    slots = [(k * size) % (span - size + 1) for k in range(n)]
                    ld = ini.get_xfer_descs([(lbase + o, size, 0) for o in slots], "DRAM")
                    rd = tgt.get_xfer_descs([(rbase + o, size, 0) for o in slots], "DRAM")
                    h = ini.initialize_xfer(op.upper(), ld, rd, peer)

                    def run():
                        st = ini.transfer(h)
                        while st == "PROC":
                            st = ini.check_xfer_state(h)
                        if st != "DONE":
                            raise RuntimeError("NIXL transfer of %d x %d B: %s" % (n, size, st))
                    return h, run
                h1, one = xfer(1)
                if op == "write":
                    lbuf[0:min(size, 4096)] = bytes((i * 7 + 1) & 0xFF for i in range(min(size, 4096)))
                    one()
                    if rbuf[0:min(size, 4096)] != lbuf[0:min(size, 4096)]:
                        raise RuntimeError("NIXL write of %d B: target bytes differ" % size)
                lat = timed_latency(one, a.lat_iters, a.budget_s)
                n = max(1, min(a.window, span // size))
                hn, many = xfer(n)
                bw = timed_bandwidth(many, n * size, a.bw_bytes, a.trials, a.budget_s)
                for h in (h1, hn):
                    ini.release_xfer_handle(h)
                _emit({"op": op, "size_B": size, "batch": n, **lat_summary(lat), **bw})
        _emit({"done": True})
    except Exception as ex:  # noqa: BLE001
        _emit({"error": "%s: %s" % (type(ex).__name__, ex)})
        return 1
    return 0


# ---------------------------------------------------------------------------- child-process plumbing
def read_json_lines(proc: subprocess.Popen, timeout_s: float, on_row: Optional[Callable[[dict], None]] = None,
                    stop_on: str = "done") -> List[dict]:
    """Rows a child prints until ``{stop_on: ...}``; raises with the child's stderr on error/timeout."""
    rows: List[dict] = []
    deadline = time.monotonic() + timeout_s
    timer = threading.Timer(timeout_s, proc.kill)
    timer.daemon = True
    timer.start()
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            line = line.strip()
            if not line.startswith("{"):
                continue
            obj = json.loads(line)
            if "error" in obj:
                raise RuntimeError(obj["error"])
            if stop_on in obj:
                return rows
            rows.append(obj)
            if on_row:
                on_row(obj)
    finally:
        timer.cancel()
    if time.monotonic() >= deadline:
        raise RuntimeError("timed out after %.0f s" % timeout_s)
    err = proc.stderr.read()[-2000:] if proc.stderr else ""  # type: ignore[union-attr]
    raise RuntimeError("child exited (rc=%s) before finishing: %s" % (proc.poll(), err))


def spawn(args: List[str], env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "hixl_tools.bench.peers", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)


def stop(proc: Optional[subprocess.Popen], timeout_s: float = 10.0) -> None:
    if proc is None:
        return
    try:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    for f in (proc.stdout, proc.stderr):
        if f:
            f.close()


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hixl_tools.bench.peers", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("mooncake-target")
    i = sub.add_parser("mooncake-initiator")
    n = sub.add_parser("nixl")
    for p in (t, i):
        p.add_argument("--protocol", default="tcp")
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--device", default="")
    t.add_argument("--bytes", type=int, required=True)
    i.add_argument("--session", required=True)
    i.add_argument("--addr", type=int, required=True)
    for p in (i, n):
        p.add_argument("--ops", default="write")
        p.add_argument("--sizes", required=True)
        p.add_argument("--span", type=int, required=True)
        p.add_argument("--window", type=int, default=1)
        p.add_argument("--lat-iters", type=int, default=200)
        p.add_argument("--bw-bytes", type=int, default=64 * MiB)
        p.add_argument("--trials", type=int, default=3)
        p.add_argument("--budget-s", type=float, default=5.0, help="time budget per measurement")
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    a = _parser().parse_args(argv)
    return {"mooncake-target": mooncake_target_main, "mooncake-initiator": mooncake_initiator_main,
            "nixl": nixl_main}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
