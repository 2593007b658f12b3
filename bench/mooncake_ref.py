#!/usr/bin/env python3
"""Reference benchmark: Mooncake Transfer Engine over TCP on loopback.

Gives baseline numbers to compare hixl against. Two Mooncake engines run in
two separate child processes (multiprocessing, "spawn" start method):

* target:    ``TransferEngine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")``,
             registers one buffer (``register_memory``) and reports its session
             id ``"<host>:<get_rpc_port()>"`` and buffer address to the parent.
* initiator: same initialization, registers a local source/destination buffer
             and drives one-sided transfers into / out of the target buffer.

The calling process never imports ``mooncake`` itself; it only orchestrates,
so ``run()`` can be called from another bench script in the same run.

What is measured, per transfer size (bytes) and per operation (WRITE = local ->
target with ``transfer_sync_write``; READ = target -> local with
``transfer_sync_read``):

* latency: wall time of one synchronous call, measured with
  ``time.perf_counter_ns`` around the call, ``lat_iters`` samples after
  ``warmup`` untimed calls. Reported as median and p99 (linear interpolation)
  in microseconds (``[us]``).
* bandwidth: ``n`` synchronous calls back-to-back (one transfer in flight at a
  time, no batching), ``bw = n * size / elapsed`` in MiB/s (1 MiB = 2**20 B).
  ``n = clamp(ceil(bw_bytes / size), bw_min_iters, bw_max_iters)`` with
  defaults 64 MiB, 20 and 2000, i.e. >= 64 MiB moved or >= 20 calls; the cap
  only bounds the run time for tiny sizes (for 8 B the number is essentially
  1/latency anyway). Median of ``bw_trials`` (default 3) trials.
* correctness, once per size before timing: a deterministic pseudo-random
  pattern is written, the target process hashes its memory (SHA-256) and the
  hash is compared; then the region is read back into a zeroed local buffer
  and compared byte for byte. A mismatch or any non-zero return code aborts
  the run with RuntimeError.

Usage::

    pip install mooncake-transfer-engine-non-cuda==0.3.13.post1
    python3 bench/mooncake_ref.py [--sizes 8,4096,65536,1048576,16777216]
        [--lat-iters 200] [--json out.json] [--timeout-s 300]

From another script (guard it with ``if __name__ == "__main__":``, as
required by the spawn start method)::

    from mooncake_ref import run
    ref = run([4096, 1 << 20], lat_iters=200)

Exit codes of the CLI: 0 ok, 1 benchmark failure, 2 mooncake not importable,
3 hard timeout (``--timeout-s``) hit; child processes are always killed.

Mooncake logs through glog; ``MC_LOG_LEVEL`` is set to ERROR in the children
unless already set in the environment (``--verbose`` keeps INFO). One
harmless "Local segment descriptor not found" error line per engine is
printed at initialization.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import mmap
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import platform
import random
import signal
import socket
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Optional

PIP_PACKAGE = "mooncake-transfer-engine-non-cuda"
PIP_SPEC = PIP_PACKAGE + "==0.3.13.post1"
DEFAULT_SIZES = (8, 4096, 65536, 1048576, 16777216)
MIB = 1 << 20

# Distributions that may provide the ``mooncake`` package (version lookup).
_DISTS = (PIP_PACKAGE, "mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")

EXIT_FAIL, EXIT_UNAVAILABLE, EXIT_TIMEOUT = 1, 2, 3


class MooncakeUnavailable(RuntimeError):
    """``mooncake.engine`` cannot be imported."""


class BenchTimeout(RuntimeError):
    """The hard overall timeout expired."""


def _unavailable_msg(detail: str) -> str:
    return (f"Mooncake transfer engine is not importable ({detail}); "
            f"install it with: pip install {PIP_SPEC}")


def _mooncake_version() -> Optional[str]:
    for dist in _DISTS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


# --------------------------------------------------------------------------
# Child-process helpers (everything below up to run() executes in children).
# --------------------------------------------------------------------------

def _child_setup(timeout_s: float, log_level: str) -> None:
    """Die with the parent, self-destruct after the timeout, quiet glog."""
    try:  # Linux: SIGKILL this child when the parent (thread) dies.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except Exception:  # pragma: no cover - non-Linux
        pass
    watchdog = threading.Timer(timeout_s + 10.0, os._exit, args=(124,))
    watchdog.daemon = True
    watchdog.start()
    # glog reads its level when engine.so is loaded, so set it before import.
    os.environ.setdefault("MC_LOG_LEVEL", log_level)


def _import_engine():
    try:
        from mooncake.engine import TransferEngine  # type: ignore
    except Exception as exc:  # ImportError, OSError from a broken .so, ...
        raise MooncakeUnavailable(_unavailable_msg(f"{type(exc).__name__}: {exc}")) from exc
    return TransferEngine


def _new_engine(host: str, metadata: str, protocol: str):
    engine = _import_engine()()
    ret = engine.initialize(host, metadata, protocol, "")
    if ret != 0:
        raise RuntimeError(f"TransferEngine.initialize({host!r}, {metadata!r}, "
                           f"{protocol!r}, '') returned {ret}")
    return engine


def _alloc(nbytes: int):
    """Page-aligned, zero-filled anonymous memory; returns (mmap, address)."""
    buf = mmap.mmap(-1, nbytes)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    return buf, addr


def _send_error(conn, exc: BaseException) -> None:
    kind = "unavailable" if isinstance(exc, MooncakeUnavailable) else "error"
    try:
        conn.send((kind, f"{type(exc).__name__}: {exc}"))
    except Exception:
        pass


def _target_main(parent_conn, ctrl_conn, capacity: int, host: str,
                 metadata: str, protocol: str, timeout_s: float,
                 log_level: str) -> None:
    """Target: register a buffer, publish it, then serve digest requests."""
    _child_setup(timeout_s, log_level)
    try:
        engine = _new_engine(host, metadata, protocol)
        buf, addr = _alloc(capacity)
        ret = engine.register_memory(addr, capacity)
        if ret != 0:
            raise RuntimeError(f"target register_memory returned {ret}")
        port = engine.get_rpc_port()
        parent_conn.send(("ready", {"session": f"{host}:{port}", "addr": addr,
                                    "capacity": capacity, "rpc_port": port}))
    except BaseException as exc:
        _send_error(parent_conn, exc)
        return
    parent_conn.close()
    try:
        while True:
            try:
                msg = ctrl_conn.recv()  # blocking; no polling
            except EOFError:
                break
            if msg[0] == "digest":
                _, off, n = msg
                ctrl_conn.send(hashlib.sha256(buf[off:off + n]).hexdigest())
            else:  # "stop"
                break
    finally:
        engine.unregister_memory(addr)


def _percentile(sorted_vals: list, q: float) -> float:
    if not sorted_vals:
        return math.nan
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _measure(fn: Callable, session: str, local: int, remote: int, size: int,
             cfg: dict) -> dict:
    """Latency + bandwidth of one synchronous op (fn) at one size."""
    for _ in range(cfg["warmup"]):
        ret = fn(session, local, remote, size)
        if ret != 0:
            raise RuntimeError(f"warm-up transfer (size {size}) returned {ret}")

    clock = time.perf_counter_ns
    samples = [0] * cfg["lat_iters"]
    for i in range(cfg["lat_iters"]):  # measured loop
        t0 = clock()
        ret = fn(session, local, remote, size)
        samples[i] = clock() - t0
        if ret != 0:
            raise RuntimeError(f"transfer (size {size}) returned {ret}")
    lat_us = sorted(s / 1e3 for s in samples)

    iters = max(cfg["bw_min_iters"],
                min(cfg["bw_max_iters"], math.ceil(cfg["bw_bytes"] / size)))
    trials = []
    for _ in range(cfg["bw_trials"]):
        rets = 0
        t0 = clock()
        for _ in range(iters):  # measured loop
            rets |= fn(session, local, remote, size)
        elapsed = (clock() - t0) / 1e9
        if rets != 0:
            raise RuntimeError(f"bandwidth transfer (size {size}) failed")
        trials.append(iters * size / elapsed / MIB)

    return {
        "lat_median_us": statistics.median(lat_us),
        "lat_p99_us": _percentile(lat_us, 99.0),
        "lat_mean_us": statistics.fmean(lat_us),
        "lat_min_us": lat_us[0] if lat_us else math.nan,
        "lat_max_us": lat_us[-1] if lat_us else math.nan,
        "lat_iters": cfg["lat_iters"],
        "bw_mib_s": statistics.median(trials),
        "bw_trials_mib_s": trials,
        "bw_iters": iters,
        "bw_bytes_per_trial": iters * size,
    }


def _initiator_main(parent_conn, ctrl_conn, target: dict, sizes: list,
                    cfg: dict) -> None:
    """Initiator: verify, then time WRITE (and READ) for every size."""
    _child_setup(cfg["timeout_s"], cfg["log_level"])
    try:
        engine = _new_engine(cfg["host"], cfg["metadata"], cfg["protocol"])
        cap = max(sizes)
        buf, base = _alloc(2 * cap)  # [0, cap): write source, [cap, 2cap): read dest
        ret = engine.register_memory(base, 2 * cap)
        if ret != 0:
            raise RuntimeError(f"initiator register_memory returned {ret}")
        src, dst = base, base + cap
        sess, raddr = target["session"], target["addr"]
        write = engine.transfer_sync_write
        read = getattr(engine, "transfer_sync_read", None) if cfg["do_read"] else None
        parent_conn.send(("meta", {"read_supported": hasattr(engine, "transfer_sync_read")}))

        for size in sizes:
            # --- correctness -------------------------------------------------
            pattern = random.Random(size).randbytes(size)
            buf[0:size] = pattern
            ret = write(sess, src, raddr, size)
            if ret != 0:
                raise RuntimeError(f"verify write (size {size}) returned {ret}")
            ctrl_conn.send(("digest", 0, size))
            if ctrl_conn.recv() != hashlib.sha256(pattern).hexdigest():
                raise RuntimeError(f"target memory mismatch after WRITE of {size} B")
            verify = {"write_target_sha256": True}
            if read is not None:
                buf[cap:cap + size] = bytes(size)
                ret = read(sess, dst, raddr, size)
                if ret != 0:
                    raise RuntimeError(f"verify read (size {size}) returned {ret}")
                if buf[cap:cap + size] != pattern:
                    raise RuntimeError(f"READ of {size} B returned wrong bytes")
                verify["read_back_equal"] = True

            rec = {"size_bytes": size, "verified": True, "verify": verify,
                   "write": _measure(write, sess, src, raddr, size, cfg),
                   "read": (_measure(read, sess, dst, raddr, size, cfg)
                            if read is not None else None)}
            parent_conn.send(("size", rec))

        ctrl_conn.send(("stop",))
        engine.unregister_memory(base)
        parent_conn.send(("done", None))
    except BaseException as exc:
        _send_error(parent_conn, exc)


# --------------------------------------------------------------------------
# Parent side.
# --------------------------------------------------------------------------

def _recv(conn, proc, deadline: float, what: str):
    """Block (no spinning) until conn has a message, proc died, or deadline."""
    remaining = deadline - time.monotonic()
    if remaining <= 0 or not mpc.wait([conn, proc.sentinel], remaining):
        raise BenchTimeout(f"hard timeout expired while waiting for {what}")
    if conn.poll():
        try:
            return conn.recv()
        except EOFError:
            pass
    proc.join(1.0)
    raise RuntimeError(f"{what}: child process exited unexpectedly "
                       f"(exitcode {proc.exitcode})")


def _raise_child(kind: str, msg: str) -> None:
    if kind == "unavailable":
        raise MooncakeUnavailable(msg.split(": ", 1)[-1])
    raise RuntimeError(f"mooncake child failed: {msg}")


def _reap(procs: Iterable) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
        p.join(2.0)


def run(sizes: Iterable[int] = DEFAULT_SIZES, lat_iters: int = 200, *,
        warmup: int = 20, bw_bytes: int = 64 * MIB, bw_min_iters: int = 20,
        bw_max_iters: int = 2000, bw_trials: int = 3, do_read: bool = True,
        host: str = "127.0.0.1", protocol: str = "tcp",
        metadata: str = "P2PHANDSHAKE", timeout_s: float = 300.0,
        log_level: str = "ERROR",
        progress: Optional[Callable[[dict], None]] = None) -> dict:
    """Measure Mooncake WRITE/READ latency and bandwidth; see module docstring.

    Returns a dict ``{"meta", "config", "results": [per-size dicts], ...}``.
    Latencies are in microseconds, bandwidth in MiB/s (2**20 B/s).
    Raises MooncakeUnavailable (a RuntimeError) if mooncake is not installed,
    BenchTimeout (a RuntimeError) after ``timeout_s`` seconds in total, and
    RuntimeError on any transfer/verification failure. Child processes are
    always killed before returning.
    """
    sizes = [int(s) for s in sizes]
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"sizes must be positive integers, got {sizes}")
    if lat_iters < 1 or bw_trials < 1 or bw_min_iters < 1 or bw_max_iters < bw_min_iters:
        raise ValueError("lat_iters, bw_trials, bw_min_iters must be >= 1 and "
                         "bw_max_iters >= bw_min_iters")
    if importlib.util.find_spec("mooncake") is None:
        raise MooncakeUnavailable(_unavailable_msg("no module named 'mooncake'"))

    cfg = {"warmup": warmup, "lat_iters": lat_iters, "bw_bytes": bw_bytes,
           "bw_min_iters": bw_min_iters, "bw_max_iters": bw_max_iters,
           "bw_trials": bw_trials, "do_read": do_read, "host": host,
           "protocol": protocol, "metadata": metadata, "timeout_s": timeout_s,
           "log_level": log_level}
    t_start = time.monotonic()
    deadline = t_start + timeout_s
    ctx = mp.get_context("spawn")
    procs = []
    results: list = []
    read_supported = None
    try:
        t_parent, t_child = ctx.Pipe(duplex=False)
        i_parent, i_child = ctx.Pipe(duplex=False)
        ctrl_t, ctrl_i = ctx.Pipe(duplex=True)

        target = ctx.Process(target=_target_main, name="mooncake-target", daemon=True,
                             args=(t_child, ctrl_t, max(sizes), host, metadata,
                                   protocol, timeout_s, log_level))
        target.start()
        procs.append(target)
        t_child.close()
        ctrl_t.close()
        kind, info = _recv(t_parent, target, deadline, "target engine start-up")
        if kind != "ready":
            _raise_child(kind, info)

        initiator = ctx.Process(target=_initiator_main, name="mooncake-initiator",
                                daemon=True,
                                args=(i_child, ctrl_i, info, sizes, cfg))
        initiator.start()
        procs.append(initiator)
        i_child.close()
        ctrl_i.close()
        while True:
            kind, payload = _recv(i_parent, initiator, deadline, "initiator results")
            if kind == "meta":
                read_supported = payload["read_supported"]
            elif kind == "size":
                results.append(payload)
                if progress is not None:
                    progress(payload)
            elif kind == "done":
                break
            else:
                _raise_child(kind, payload)
    finally:
        _reap(procs)

    return _report(cfg, sizes, info, read_supported, results, time.monotonic() - t_start)


def _report(cfg: dict, sizes: list, info: dict, read_supported: Optional[bool], results: list,
            elapsed_s: float) -> dict:
    """run()'s result: what was measured, with what, where."""
    protocol, metadata, host = cfg["protocol"], cfg["metadata"], cfg["host"]
    notes = []
    if read_supported is False:
        notes.append("this mooncake build has no transfer_sync_read; READ not measured")
    elif not cfg["do_read"]:
        notes.append("READ disabled by caller")
    return {
        "meta": {
            "library": "mooncake-transfer-engine",
            "mooncake_version": _mooncake_version(),
            "pip_package": PIP_PACKAGE,
            "protocol": protocol,
            "metadata_server": metadata,
            "host": host,
            "target_session": info["session"],
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "elapsed_s": elapsed_s,
            "mc_env": {k: v for k, v in os.environ.items() if k.startswith("MC_")},
            "api": "TransferEngine.transfer_sync_write / transfer_sync_read, "
                   "one call in flight, back-to-back",
            "units": {"size_bytes": "B", "lat_*_us": "us", "bw_*mib_s": "MiB/s (2^20 B/s)"},
        },
        "config": {k: v for k, v in cfg.items() if k != "log_level"} | {"sizes": sizes},
        "read_supported": read_supported,
        "notes": notes,
        "results": results,
    }




# --------------------------------------------------------------------------
# Output.
# --------------------------------------------------------------------------

_COLS = [("size[B]", 10), ("op", 5), ("lat_median[us]", 14), ("lat_p99[us]", 12),
         ("bw[MiB/s]", 11), ("bw_iters", 8), ("verified", 8)]


def _fmt(x: Any, width: int) -> str:
    if isinstance(x, float):
        s = "nan" if math.isnan(x) else (f"{x:.1f}" if abs(x) >= 10 else f"{x:.3f}")
    else:
        s = str(x)
    return s.rjust(width)


def format_table(res: dict) -> str:
    lines = ["  ".join(name.rjust(w) for name, w in _COLS)]
    lines.append("-" * len(lines[0]))
    for rec in res["results"]:
        for op in ("write", "read"):
            m = rec.get(op)
            if m is None:
                continue
            row = [rec["size_bytes"], op.upper(), m["lat_median_us"], m["lat_p99_us"],
                   m["bw_mib_s"], m["bw_iters"], "yes" if rec["verified"] else "NO"]
            lines.append("  ".join(_fmt(v, w) for v, (_, w) in zip(row, _COLS)))
    return "\n".join(lines)


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    return obj


def write_json(res: dict, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_nan_to_none(res), f, indent=2, allow_nan=False)
        f.write("\n")


def _parse_size(tok: str) -> int:
    tok = tok.strip()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(tok[-1:].lower(), 1)
    return int(tok[:-1] if mult > 1 else tok) * mult


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(
        description="Mooncake transfer engine (TCP, loopback) reference benchmark.")
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                    help="comma-separated transfer sizes in bytes (K/M/G suffixes ok)")
    ap.add_argument("--lat-iters", type=int, default=200, help="timed calls per latency point")
    ap.add_argument("--warmup", type=int, default=20, help="untimed calls before timing")
    ap.add_argument("--bw-bytes", type=int, default=64 * MIB,
                    help="target bytes moved per bandwidth trial")
    ap.add_argument("--bw-min-iters", type=int, default=20)
    ap.add_argument("--bw-max-iters", type=int, default=2000,
                    help="cap on calls per bandwidth trial (bounds tiny sizes)")
    ap.add_argument("--bw-trials", type=int, default=3, help="trials; median reported")
    ap.add_argument("--no-read", action="store_true", help="skip READ measurements")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--json", metavar="PATH", help="write results as JSON to PATH")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="hard overall timeout")
    ap.add_argument("--verbose", action="store_true", help="keep Mooncake INFO logs")
    args = ap.parse_args(argv)

    # Turn SIGTERM (e.g. from CI) into a normal exit so children get reaped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    try:
        sizes = [_parse_size(t) for t in args.sizes.split(",") if t.strip()]
        res = run(sizes, args.lat_iters, warmup=args.warmup, bw_bytes=args.bw_bytes,
                  bw_min_iters=args.bw_min_iters, bw_max_iters=args.bw_max_iters,
                  bw_trials=args.bw_trials, do_read=not args.no_read, host=args.host,
                  timeout_s=args.timeout_s,
                  log_level="INFO" if args.verbose else "ERROR",
                  progress=lambda r: print(f"  done {r['size_bytes']} B",
                                           file=sys.stderr, flush=True))
    except MooncakeUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except BenchTimeout as exc:
        print(f"error: {exc} (--timeout-s {args.timeout_s})", file=sys.stderr)
        return EXIT_TIMEOUT
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAIL

    m = res["meta"]
    print(f"Mooncake {m['mooncake_version']}  protocol={m['protocol']}  "
          f"metadata={m['metadata_server']}  host={m['host']}  "
          f"python={m['python_version']}  ({m['elapsed_s']:.1f} s)")
    print(format_table(res))
    for note in res["notes"]:
        print(f"note: {note}")
    if args.json:
        write_json(res, args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
