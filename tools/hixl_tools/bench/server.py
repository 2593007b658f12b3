"""The two halves of ``hixl bench`` that talk to each other: the bench server (the target side:
a hixl engine, an RDMA endpoint, perftest's and Mooncake's server halves) and its JSON-lines client.

Locally the server is a child process of the bench (``python -m hixl_tools.bench --serve --once``); across
two hosts it is started by hand on the target host (``hixl bench --serve``). One command per line,
one JSON answer per line; ``{"error": ...}`` on failure. Long jobs (accepting a queue pair, the
responder half of a ping-pong) run in a background thread that ``join`` waits for.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List

import numpy as np

from . import peers


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until a TCP socket listens on `port` (read from /proc/net/tcp*), the process exits, or timeout."""
    want = ":%04X" % port
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for f in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(f) as fh:
                    next(fh)
                    for line in fh:
                        cols = line.split()
                        if cols[1].endswith(want) and cols[3] == "0A":  # local address, state LISTEN
                            return
            except OSError:
                continue
        time.sleep(0.05)


# -------------------------------------------------------------------------------------- control channel
class Ctl:
    """JSON-lines client of the bench server."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock = socket.create_connection((host, port), timeout=timeout_s)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.sock.settimeout(None)
        self.f = self.sock.makefile("rw", encoding="utf-8")
        self.local_ip = self.sock.getsockname()[0]
        self.server_ip = host

    def call(self, cmd: str, **kw: Any) -> Dict[str, Any]:
        self.f.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.f.flush()
        line = self.f.readline()
        if not line:
            raise RuntimeError("bench server closed the connection during %r" % cmd)
        r = json.loads(line)
        if "error" in r:
            raise RuntimeError("bench server: %s: %s" % (cmd, r["error"]))
        return r

    def close(self) -> None:
        try:
            self.call("bye")
        except Exception:  # noqa: BLE001
            pass
        self.f.close()
        self.sock.close()


# ----------------------------------------------------------------------------------------- bench server
# What a client may ask the server to run: the server half of a perftest tool with the flags
# peers.perftest_args writes, each value a plain token, and Mooncake's MC_* settings. The server
# has no authentication (as perftest itself); these checks keep a client to what the bench needs:
# no other program, option, environment variable (LD_PRELOAD, PATH) or unbounded buffer.
PERFTEST_FLAGS_WITH_VALUE = {"-d", "-x", "-s", "-n", "-p", "-t"}
PERFTEST_FLAGS = {"-F"}
_TOKEN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_TARGET_BYTES = 16 << 30


def checked_perftest_args(args: Any) -> List[str]:
    tools = set(peers.PERFTEST_TOOLS.values())
    if not isinstance(args, list) or not args or args[0] not in tools:
        raise ValueError("perftest: the command must be one of %s" % ", ".join(sorted(tools)))
    out, i = [args[0]], 1
    while i < len(args):
        flag = args[i]
        if flag in PERFTEST_FLAGS:
            out.append(flag)
            i += 1
        elif flag in PERFTEST_FLAGS_WITH_VALUE and i + 1 < len(args) and isinstance(args[i + 1], str) \
                and _TOKEN.fullmatch(args[i + 1]):
            out += [flag, args[i + 1]]
            i += 2
        else:
            raise ValueError("perftest: argument %r not allowed (flags: %s)"
                             % (flag, " ".join(sorted(PERFTEST_FLAGS | PERFTEST_FLAGS_WITH_VALUE))))
    if "-p" not in out:
        raise ValueError("perftest: -p PORT is required")
    return out


def checked_mooncake_env(env: Any) -> Dict[str, str]:
    if not isinstance(env, dict):
        raise ValueError("mooncake env must be a JSON object")
    for k, v in env.items():
        if not (isinstance(k, str) and re.fullmatch(r"MC_[A-Z0-9_]{1,40}", k) and isinstance(v, str)
                and (v == "" or _TOKEN.fullmatch(v))):
            raise ValueError("mooncake env: %r=%r not allowed (MC_* names, plain values only)" % (k, v))
    return dict(env)


def checked_bytes(n: Any) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_TARGET_BYTES:
        raise ValueError("bytes must be an integer in 1..%d, got %r" % (MAX_TARGET_BYTES, n))
    return n


def engine_opts(transport: str, qps: int) -> Dict[str, str]:
    """The bench's engine options, the same on both ends. Set explicitly: on Soft-RoCE the engine's own
    defaults are 8 queue pairs with a 64 KiB send window each and 16 KiB work requests (a lossy link),
    and perftest runs one queue pair (with -q N, N of them), one work request per message, no window."""
    return {"HixlTransport": transport, "HixlRdmaQpsPerLink": str(qps), "HixlRdmaMaxWrBytes": str(4 << 20),
            "HixlRdmaSendWindowBytes": "0"}


class Server:
    """The target side: answers one JSON command per line (see Ctl.call)."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.objs: Dict[int, Dict[str, Any]] = {}
        self.next_id = 1
        self.peer_ip = "127.0.0.1"

    # -- plumbing
    def serve(self) -> int:
        if self.a.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {int(c) for c in self.a.cpus.split(",")})
        host, _, port = self.a.listen.rpartition(":")
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((host or "0.0.0.0", int(port)))
        ls.listen(1)
        print(json.dumps({"port": ls.getsockname()[1]}), flush=True)
        if not self.a.once:
            print("hixl bench server listening on %s:%d" % ls.getsockname()[:2], file=sys.stderr, flush=True)
        while True:
            c, _ = ls.accept()
            self.peer_ip = c.getsockname()[0]  # the address the client reached us at: our data side
            try:
                self.session(c)
            finally:
                self.close_all()
                c.close()
            if self.a.once:
                return 0

    def session(self, c: socket.socket) -> None:
        f = c.makefile("rw", encoding="utf-8")
        for line in f:
            req = json.loads(line)
            cmd = req.pop("cmd")
            try:
                rep = getattr(self, "do_" + cmd)(**req)
            except Exception as ex:  # noqa: BLE001 - reported to the client
                rep = {"error": "%s: %s" % (type(ex).__name__, ex)}
            f.write(json.dumps(rep) + "\n")
            f.flush()
            if cmd == "bye":
                return

    def _add(self, **obj: Any) -> int:
        i = self.next_id
        self.next_id += 1
        self.objs[i] = obj
        return i

    def close_all(self) -> None:
        for i in list(self.objs):
            try:
                self.do_close(i)
            except Exception as ex:  # noqa: BLE001
                print("bench server: closing %d: %s" % (i, ex), file=sys.stderr)

    # -- commands
    def do_hello(self) -> Dict[str, Any]:
        import hixl
        return {"hixl": hixl.__version__, "cpus": os.cpu_count(), "pid": os.getpid(),
                "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}

    def do_bye(self) -> Dict[str, Any]:
        return {"ok": True}

    def do_close(self, id: int) -> Dict[str, Any]:  # noqa: A002 - protocol field name
        o = self.objs.pop(id, None)
        if o is None:
            return {"ok": False}
        if "stop" in o:
            o["stop"].set()
        for t in o.get("threads", []):
            t.join(30)
        if "proc" in o:
            peers.stop(o["proc"])
        if "engine" in o:
            o["engine"].finalize()
        if "ep" in o:
            o["ep"].close()
        return {"ok": True}

    def _run_bg(self, id: int, fn: Callable[[], Any]) -> None:  # noqa: A002
        o = self.objs[id]
        box: Dict[str, Any] = {}

        def run() -> None:
            try:
                box["result"] = fn()
            except Exception as ex:  # noqa: BLE001
                box["error"] = "%s: %s" % (type(ex).__name__, ex)
        t = threading.Thread(target=run, daemon=True)
        o["bg"], o["box"] = t, box
        t.start()

    def do_join(self, id: int, timeout_s: float = 120.0) -> Dict[str, Any]:  # noqa: A002
        o = self.objs[id]
        t = o.pop("bg", None)
        if t is None:
            return {"ok": True}
        t.join(timeout_s)
        if t.is_alive():
            raise RuntimeError("background job still running after %.0f s" % timeout_s)
        box = o.pop("box")
        if "error" in box:
            raise RuntimeError(box["error"])
        return {"ok": True}

    def do_endpoint_target(self, bytes: int) -> Dict[str, Any]:  # noqa: A002
        from hixl.endpoint import Endpoint
        ep = Endpoint(self.a.device, gid_index=self.a.gid_index)
        buf = np.zeros(checked_bytes(bytes), np.uint8)
        mr = ep.register(buf)
        port = ep.listen(self.peer_ip, 0)
        i = self._add(ep=ep, buf=buf, mr=mr, threads=[], stop=threading.Event())
        self._run_bg(i, lambda: ep.accept(30000))
        info = ep.info()
        return {"id": i, "host": self.peer_ip, "port": port, "addr": mr.addr, "rkey": mr.rkey, "len": mr.length,
                "device": info["device"], "gid_index": info["gid_index"]}

    def do_pingpong(self, id: int, size: int, iters: int, peer_addr: int, peer_rkey: int,  # noqa: A002
                    timeout_ms: int = 60000) -> Dict[str, Any]:
        from .. import _perf
        o = self.objs[id]
        if not isinstance(size, int) or not 1 <= size <= len(o["buf"]) // 2:  # send half + inbox half
            raise ValueError("pingpong: size must be in 1..%d (half the target buffer), got %r"
                             % (len(o["buf"]) // 2, size))
        o["buf"][:2 * size] = 0
        self._run_bg(id, lambda: _perf.perf_write_pingpong(o["ep"].raw, o["mr"].addr, peer_addr + size, peer_rkey,
                                                           size, iters, False, timeout_ms))
        return {"ok": True}

    def do_drain_imm(self, id: int, on: bool) -> Dict[str, Any]:  # noqa: A002
        """on: consume the client's immediates until told to stop (replenishes receives)."""
        from .. import _perf
        o = self.objs[id]
        if on:
            o["stop"] = stop = threading.Event()
            count = {"n": 0}

            def drain() -> None:
                while not stop.is_set():
                    count["n"] += _perf.perf_drain_imm(o["ep"].raw, 1 << 62, 50)
            t = threading.Thread(target=drain, daemon=True)
            o["drain"], o["drained"] = t, count
            t.start()
            return {"ok": True}
        o["stop"].set()
        o["drain"].join(30)
        return {"ok": True, "received": o["drained"]["n"]}

    def do_engine_target(self, transport: str, bytes: int, mem: str = "host", qps: int = 1) -> Dict[str, Any]:  # noqa: A002
        import hixl
        bytes = checked_bytes(bytes)  # noqa: A001
        if transport not in ("rdma", "shm", "tcp") or mem not in ("host", "acl"):
            raise ValueError("engine target: transport must be rdma, shm or tcp and mem host or acl")
        if not isinstance(qps, int) or not 1 <= qps <= 16:
            raise ValueError("engine target: qps must be 1..16")
        e = hixl.Hixl()
        opts = engine_opts(transport, qps)
        if self.a.device:
            opts["HixlDevice"] = self.a.device
        if self.a.gid_index is not None:
            opts["HixlGidIndex"] = str(self.a.gid_index)
        if e.initialize("%s:0" % self.peer_ip, opts) != hixl.SUCCESS:
            raise RuntimeError("initialize: " + e.last_error())
        keep: Any = None
        if mem == "acl":
            from hixl import acl
            rc, addr = acl.aclrtMalloc(bytes, acl.ACL_MEM_MALLOC_NORMAL_ONLY)
            if rc != acl.ACL_SUCCESS:
                raise RuntimeError("aclrtMalloc(%d): %d" % (bytes, rc))
            mt = hixl.MemType.MEM_DEVICE
        else:
            keep = np.zeros(bytes, np.uint8)
            addr, mt = keep.ctypes.data, hixl.MemType.MEM_HOST
        if e.register_mem(hixl.MemDesc(addr, bytes), mt)[0] != hixl.SUCCESS:
            raise RuntimeError("register_mem: " + e.last_error())
        stop = threading.Event()

        def drain_flags() -> None:  # completion flags of write_imm: consume them as a receiver would
            while not stop.is_set():
                e.wait_flags(100)
        t = threading.Thread(target=drain_flags, daemon=True)
        t.start()
        i = self._add(engine=e, buf=keep, stop=stop, threads=[t])
        return {"id": i, "name": e.local_engine, "addr": addr, "len": bytes}

    def do_perftest(self, args: List[str]) -> Dict[str, Any]:
        """Starts perftest's server half (args from peers.perftest_args, device/GID are ours)."""
        args = checked_perftest_args(args)
        for flag, val in (("-d", self.a.device), ("-x", self.a.gid_index)):
            if val is not None and flag in args:
                args[args.index(flag) + 1] = str(val)
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        port = int(args[args.index("-p") + 1])
        _wait_listening(port, proc, 10.0)  # perftest prints nothing until a client connects
        if proc.poll() is not None:
            raise RuntimeError("%s exited at once: %s" % (args[0], proc.stdout.read()[-1500:]))  # type: ignore
        return {"id": self._add(proc=proc)}

    def do_perftest_wait(self, id: int, timeout_s: float = 60.0) -> Dict[str, Any]:  # noqa: A002
        o = self.objs.pop(id)
        try:
            out, _ = o["proc"].communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            o["proc"].kill()
            out, _ = o["proc"].communicate()
        return {"rc": o["proc"].returncode, "out": out[-3000:]}

    def do_mooncake_target(self, protocol: str, bytes: int, device: str, env: Dict[str, str]) -> Dict[str, Any]:  # noqa: A002
        env = checked_mooncake_env(env)
        bytes = checked_bytes(bytes)  # noqa: A001
        if protocol not in ("rdma", "tcp") or not _TOKEN.fullmatch(device or "-"):
            raise ValueError("mooncake target: protocol must be rdma or tcp and device a plain name")
        if self.a.gid_index is not None and protocol == "rdma":  # this side's own settings win
            env["MC_GID_INDEX"] = str(self.a.gid_index)
        proc = peers.spawn(["mooncake-target", "--protocol", protocol, "--host", self.peer_ip, "--device",
                            self.a.device or device, "--bytes", str(bytes)], env)
        line = ""
        while not line.startswith("{"):
            line = proc.stdout.readline().strip()  # type: ignore[union-attr]
            if not line and proc.poll() is not None:
                raise RuntimeError("mooncake target exited: " + proc.stderr.read()[-1500:])  # type: ignore
        info = json.loads(line)
        if "error" in info:
            peers.stop(proc)
            raise RuntimeError(info["error"])
        return {"id": self._add(proc=proc), **info}
