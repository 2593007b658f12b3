"""Our side of a measurement: the endpoint, engine and python paths, one configuration (a row) at a time."""
from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence, Tuple

import numpy as np

from . import peers
from .server import Ctl, engine_opts
from .options import GOAL_DESCS, MiB, Settings


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
        from hixl.endpoint import Endpoint
        from .. import _perf
        self._perf = _perf
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
            rtt = self._perf.perf_write_pingpong(self.ep.raw, self.mr.addr, self.raddr + size, self.rkey, size,
                                                 iters, True, 60000)
        finally:
            self.ctl.call("join", id=self.tid)
        return [x // 2 for x in rtt]

    def latency(self, op: str, size: int, descs: int, iters: int) -> List[int]:
        n = min(descs, self.span // size)  # descriptors side by side (latency needs no cycling)
        return self._perf.perf_op_latency(self.ep.raw, _rdma_op(op), self.mr.addr, self.raddr, self.rkey, size, n,
                                          iters, 60000)

    def stream(self, op: str, size: int, descs: int, iters: int, window: int, span: int, off: int = 0) -> Dict[str, int]:
        return self._perf.perf_write_stream(self.ep.raw, _rdma_op(op), self.mr.addr + off, self.raddr + off,
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
        from .. import _perf
        self.hixl, self._perf = hixl, _perf
        self.ctl, self.span = ctl, s.span
        self.e = hixl.Hixl()
        qps = getattr(s.args, "qps", 1)
        opts = engine_opts(transport, qps)  # as the target's (server.py)
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
        t = ctl.call("engine_target", transport=transport, bytes=self.span, mem=s.args.target_mem, qps=qps)
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
        return self._perf.perf_engine_latency(self.e._engine, self.remote, o, flag, self.addr, self.raddr, size, n,
                                              iters, 60000)

    def stream(self, op: str, size: int, descs: int, iters: int, window: int, span: int, off: int = 0) -> Dict[str, int]:
        o, flag = self._op_flag(op)
        return self._perf.perf_engine_stream(self.e._engine, self.remote, o, flag, self.addr + off,
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
