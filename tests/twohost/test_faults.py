"""Faults on a real link: guest B of ci/two-vm against guest A's engines (tests/twohost/peer.py).

Every packet between the two crosses a QEMU network link, where ``tc netem`` (on B's NIC: B's egress,
which carries WRITE data and READ requests) and ``ip link`` inject faults, on rdma (each guest has
its own rxe0) and on tcp. What the user must see:

* under loss, delay, reordering, duplication and corruption: every transfer either COMPLETED with
  every byte verified (read back and compared), or FAILED/TIMEOUT within its timeout; never a hang,
  never silent corruption; notifies likewise. The effective bandwidth under each fault is recorded
  against the clean link ($TV_ST/faults.json, printed), with the goal >= 0.5x clean at 1 % loss on rdma
  with the defaults (on Soft-RoCE: 8 queue pairs per link, each with a 64 KiB send window, ACK timeout
  14, work requests of 16 KiB), and, for comparison, on further rdma engines of B's: one queue pair at ACK
  timeout 14 and 12 (14 and one queue pair are the defaults on hardware; with 4 MiB work requests there),
  4 queue pairs without a window (the Soft-RoCE default before), at ACK timeout 12, and with 4 MiB work
  requests (the one before that);
* the link down for 0.5 s: in-flight requests end (completed, or failed within their timeout); later
  transfers work, without a connect where the link survived, after one where it did not;
* the link down past the heartbeat bound: the link is closed on both ends (A: the heartbeat; B: the
  heartbeat on tcp, the device's port-down event on rdma); connect works once the link is back;
* the peer host frozen (guest A's QEMU stopped by the host: its NIC silent, its sockets open) mid-transfer:
  everything in flight on every engine of B's ends within its timeout, and B's links close; once A goes on,
  one connect per engine restores the links (bytes land on each, but for the ACK timeout 12 sides);
* the peer host removed (guest A killed by the host) mid-transfer: everything in flight ends FAILED
  or TIMEOUT within its timeout (on the sides with one queue pair per link: with 8 more queue pairs
  pushing, guest B's own QEMU 7.2 segfaulted in its stream netdev when A's went, 2 of 2 times).

Timings under TCG are only compared within this run.
"""
from __future__ import annotations

import json
import os
import subprocess
import time

import numpy as np
import pytest

import hixl
from hixl import READ, SUCCESS, WRITE, NotifyDesc, TransferStatus

pytestmark = pytest.mark.twohost

ST = os.environ.get("TV_ST", "")
NIC = os.environ.get("TV_NIC", "")
MYIP = os.environ.get("TV_MYIP", "192.168.88.2")
TRANSPORTS = ("rdma", "tcp")
# B's further rdma engines: the other settings of queue pairs per link x ACK timeout (4.096 us * 2^t: 12 is
# 16 ms, 14 67 ms) x bytes per work request x send window. "rdma" itself runs with the defaults, on rxe 8
# queue pairs with a 64 KiB send window each, ACK timeout 14 and work requests of 16 KiB (A's rdma engine
# allows 8 queue pairs). The 4 queue pair sides have no window (it is the default only on striped links).
OTHER_RDMA = {"rdma 1qp t=14": {"HixlRdmaQpsPerLink": "1", "HixlRdmaTimeout": "14",  # hardware's defaults
                                "HixlRdmaMaxWrBytes": str(4 << 20)},
              "rdma 1qp t=12": {"HixlRdmaQpsPerLink": "1", "HixlRdmaTimeout": "12"},
              "rdma 4qp": {"HixlRdmaQpsPerLink": "4", "HixlRdmaTimeout": "14",  # the rxe default before 8
                           "HixlRdmaSendWindowBytes": "0"},
              "rdma 4qp t=12": {"HixlRdmaQpsPerLink": "4", "HixlRdmaTimeout": "12", "HixlRdmaSendWindowBytes": "0"},
              "rdma 4qp 4MiB": {"HixlRdmaQpsPerLink": "4", "HixlRdmaTimeout": "14",  # the rxe default before that
                                "HixlRdmaMaxWrBytes": str(4 << 20), "HixlRdmaSendWindowBytes": "0"}}
HEARTBEAT = {"HixlHeartbeatMs": "200", "HixlHeartbeatMisses": "10"}  # as peer.py: a dead link after 2 s
MIB = 1 << 20
TIMEOUT_MS = 20000  # each transfer's
SLACK_S = 10.0      # what an end may take past its timeout (an abort waits for the peer's confirmation)
FAULTS = [  # (name, netem arguments; None: a clean link)
    ("clean", None),
    ("loss 1%", "loss 1%"),
    ("loss 10%", "loss 10%"),
    ("delay 5ms", "delay 5ms"),
    ("delay 5ms +-2ms", "delay 5ms 2ms distribution normal"),  # netem's jitter reorders packets too
    ("reorder 25%", "delay 2ms reorder 25% 50%"),
    ("duplicate 5%", "duplicate 5%"),
    ("corrupt 1%", "corrupt 1%"),
]
RESULTS: dict = {}


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def _netem(args):
    subprocess.run(["tc", "qdisc", "del", "dev", NIC, "root"], capture_output=True)
    if args:
        _sh("tc", "qdisc", "add", "dev", NIC, "root", "netem", *args.split())


def _peer() -> dict:
    path = os.path.join(ST, "peer.json")
    deadline = time.monotonic() + 120
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "guest A never wrote peer.json"
        time.sleep(0.2)
    with open(path) as f:
        return json.load(f)


def _peer_closed(transport: str, cause: str) -> float:
    try:
        with open(os.path.join(ST, "peer-metrics.json")) as f:
            m = json.load(f)[transport]
    except (OSError, ValueError, KeyError):
        return 0.0
    return sum(s["value"] for s in m["hixl_link_closed_total"] if s["labels"]["cause"] == cause)


def _port_active() -> bool:
    return "PORT_ACTIVE" in subprocess.run(["ibv_devinfo", "-d", "rxe0"], capture_output=True, text=True).stdout


def _until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "timed out (%ss) waiting for %s" % (timeout_s, what)
        time.sleep(0.05)


class Side:
    """B's engine for one transport, connected to A's, with a local buffer."""

    def __init__(self, transport: str, peer: dict, options=None, listen: bool = False):
        self.transport, self.remote = transport, peer[transport]["engine"]
        self.raddr, self.rlen = peer[transport]["addr"], peer[transport]["len"]
        self.e = hixl.Hixl()
        opts = {"HixlTransport": transport, **HEARTBEAT, **(options or {})}
        # A second engine of B's on one of A's engines must listen: client-only ones are told apart by IP.
        assert self.e.initialize(MYIP + (":0" if listen else ""), opts) == SUCCESS, self.e.last_error()
        self.buf = np.zeros(32 * MIB, np.uint8)
        self.back = np.zeros(32 * MIB, np.uint8)
        for b in (self.buf, self.back):
            assert self.e.register_mem(hixl.MemDesc(b.ctypes.data, b.nbytes))[0] == SUCCESS, self.e.last_error()
        self.connect()

    def linked(self) -> bool:
        return self.e.get_transport(self.remote)[0] == SUCCESS

    def connect(self) -> None:
        if self.transport == "rdma":
            _until(_port_active, 30, "rxe0 ACTIVE")
        rc = self.e.connect(self.remote, 20000)
        assert rc in (SUCCESS, hixl.ALREADY_CONNECTED), self.e.last_error()

    def ensure_linked(self) -> bool:
        """Connects once if the link is gone; True if it had to."""
        if self.linked():
            return False
        self.connect()
        return True

    def write_batch(self, n: int, size: int, seed: int):
        """n async WRITEs of `size` bytes (random), then waited: [(status, seconds to its end)] and
        the seconds for the batch."""
        self.buf[: n * size] = np.random.default_rng(seed).integers(0, 256, n * size, dtype=np.uint8)
        t0 = time.monotonic()
        reqs = []
        for i in range(n):
            rc, req = self.e.transfer_async(self.remote, WRITE, [hixl.TransferOpDesc(
                self.buf.ctypes.data + i * size, self.raddr + i * size, size)], timeout_in_millis=TIMEOUT_MS)
            reqs.append((rc, req, time.monotonic()))
        out = []
        for rc, req, t_sub in reqs:
            if rc != SUCCESS:
                out.append(("refused:%d" % rc, 0.0))
                continue
            rc, st = self.e.transfer_wait(req, TIMEOUT_MS + int(SLACK_S * 1000) + 5000)
            assert rc == SUCCESS and st != TransferStatus.WAITING, "a transfer still WAITING past its bound"
            out.append((st.name, time.monotonic() - t_sub))
        return out, time.monotonic() - t0

    def verify(self, lo: int, hi: int) -> bool:
        """Reads [lo, hi) of A's buffer back and compares it with what was written there."""
        self.back[lo:hi] = 0
        rc = self.e.transfer_sync(self.remote, READ, [hixl.TransferOpDesc(
            self.back.ctypes.data + lo, self.raddr + lo, hi - lo)], 60000)
        if rc != SUCCESS:
            return False
        return bool(np.array_equal(self.back[lo:hi], self.buf[lo:hi]))

    def close(self) -> None:
        self.e.finalize()


@pytest.fixture(scope="module")
def sides():
    peer = _peer()
    s = {t: Side(t, peer) for t in TRANSPORTS}
    info = s["rdma"].e.get_link_info(s["rdma"].remote)[1]
    assert (info["qps"], info["rdma_timeout"], info["rdma_max_wr_bytes"], info["rdma_send_window_bytes"]) == (
        8, 14, 16384, 64 << 10), info  # rxe's defaults
    for name, opts in OTHER_RDMA.items():
        s[name] = Side("rdma", peer, opts, listen=True)
        info = s[name].e.get_link_info(s[name].remote)[1]
        assert (info["qps"], info["rdma_timeout"], info["rdma_max_wr_bytes"]) == (
            int(opts["HixlRdmaQpsPerLink"]), int(opts["HixlRdmaTimeout"]),
            int(opts.get("HixlRdmaMaxWrBytes", 16384))), (name, info)
        assert info["rdma_send_window_bytes"] == int(opts.get("HixlRdmaSendWindowBytes", 0)), (name, info)
    yield s
    for side in s.values():
        side.close()
    _netem(None)


def _check_ends(results, what):
    for status, took in results:
        assert status in ("COMPLETED", "FAILED", "TIMEOUT") or status.startswith("refused"), (what, status)
        assert took <= TIMEOUT_MS / 1000 + SLACK_S, "%s: a transfer ended %.1f s after its submission" % (what, took)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("fault", [f[0] for f in FAULTS])
def test_under_each_fault_every_transfer_completes_verified_or_fails_in_time(sides, transport, fault):
    _under_fault(sides[transport], transport, fault)


@pytest.mark.compare
@pytest.mark.parametrize("side", list(OTHER_RDMA))
@pytest.mark.parametrize("fault", ["clean", "loss 1%"])
def test_the_other_rdma_settings_under_loss_for_comparison(sides, side, fault):
    """Why rxe's defaults are 8 queue pairs with a send window and 16 KiB work requests, and why its ACK
    timeout stays 14. A loss rxe cannot recover by a NAK waits out the ACK timeout (16 ms at 12, 67 ms at
    14); at 11 and below its QP died now and then (IBV_WC_REM_INV_REQ_ERR), and at 12 now and then on a
    clean link under load. With a
    link's bytes striped over 4 queue pairs, one waiting out a retransmission leaves the others busy
    (ib_write_bw -q 4 across this link: 2-3x the bandwidth of one queue pair at 1 % loss, ~1.5x clean).
    rxe asks for an ACK at the end of each work request (else every 65th packet) and ignores a second NAK
    until one came: smaller work requests shorten that stretch ("4qp 4MiB" is the default before "4qp").
    The default's window bounds the bytes in flight per queue pair (go-back-N resends less per loss), and
    its 8 queue pairs keep as many bytes in flight on the link as "4qp" without one."""
    _under_fault(sides[side], side, fault)


def _under_fault(side, transport, fault):
    args = dict(FAULTS)[fault]
    # The goal's phases (clean, 1% loss) move 16 MiB: 4 MiB took well under a second under TCG, too short
    # for a ratio that runs could agree on (last stop: 0.19x-0.92x at 1% loss across runs).
    n, size = (2, MIB) if fault == "loss 10%" else (16, MIB) if fault in ("clean", "loss 1%") else (4, MIB)
    side.ensure_linked()
    _netem(args)
    try:
        results, secs = side.write_batch(n, size, seed=hash((transport, fault)) & 0xFFFF)
        # Many descriptors in one request: 1024 x 1 KiB, behind the batch.
        lo = n * size
        side.buf[lo: lo + MIB] = np.random.default_rng(7).integers(0, 256, MIB, dtype=np.uint8)
        descs = np.array([[side.buf.ctypes.data + lo + k * 1024, side.raddr + lo + k * 1024, 1024]
                          for k in range(1024)], np.uint64)
        t0 = time.monotonic()
        rc = side.e.transfer_sync(side.remote, WRITE, descs, TIMEOUT_MS)
        many = ("COMPLETED" if rc == SUCCESS else "rc=%d" % rc, time.monotonic() - t0)
        # Notifies: acknowledged, or an error within their timeout.
        t0 = time.monotonic()
        nrc = side.e.send_notify(side.remote, NotifyDesc("fault", fault), 5000) if side.linked() else -1
        assert time.monotonic() - t0 <= 5 + SLACK_S
    finally:
        _netem(None)
    _check_ends(results, fault)
    assert many[1] <= TIMEOUT_MS / 1000 + SLACK_S, many
    # Every completed transfer's bytes are there (read back over a clean link, connecting again if
    # a failure closed it): a fault never corrupts silently.
    side.ensure_linked()
    for i, (status, _) in enumerate(results):
        if status == "COMPLETED":
            assert side.verify(i * size, (i + 1) * size), "%s %s: transfer %d COMPLETED but its bytes differ" % (
                transport, fault, i)
    if rc == SUCCESS:
        assert side.verify(lo, lo + MIB), "%s %s: the 1024-descriptor write COMPLETED but its bytes differ" % (
            transport, fault)
    done = sum(size for status, _ in results if status == "COMPLETED")
    RESULTS.setdefault(transport, {})[fault] = {
        "MiB_per_s": done / MIB / secs if secs > 0 else 0.0, "statuses": [s for s, _ in results],
        "many_descriptors": many[0], "notify_rc": nrc}
    _report()


def _report() -> None:
    lines = ["%-6s %-18s %12s %10s  %s" % ("link", "fault", "bw[MiB/s]", "vs clean", "statuses")]
    goals = []
    for t, faults in RESULTS.items():
        clean = faults.get("clean", {}).get("MiB_per_s") or 0.0
        for name, r in faults.items():
            ratio = r["MiB_per_s"] / clean if clean else float("nan")
            r["vs_clean"] = ratio
            lines.append("%-6s %-18s %12.2f %10.2f  %s" % (t, name, r["MiB_per_s"], ratio, ",".join(r["statuses"])))
            if t.startswith("rdma") and name == "loss 1%":
                goals.append({"goal": "%s bandwidth at 1%% loss >= 0.5x the clean link" % (
                    "rdma (defaults)" if t == "rdma" else t), "value": ratio, "met": ratio >= 0.5,
                    "is_goal": t == "rdma"})
    text = "\n".join(lines + ["%s: %s: %s (%.2fx)" % ("goal" if g["is_goal"] else "compare", g["goal"],
                                                      "met" if g["met"] else "MISSED", g["value"]) for g in goals])
    with open(os.path.join(ST, "faults.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(ST, "faults.json"), "w") as f:
        json.dump({"results": RESULTS, "goals": goals}, f, indent=1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_half_second_link_flap_ends_inflight_requests_and_one_connect_at_most_restores(sides, transport):
    side = sides[transport]
    side.ensure_linked()
    side.buf[: 8 * MIB] = np.random.default_rng(11).integers(0, 256, 8 * MIB, dtype=np.uint8)
    reqs = []
    for i in range(8):
        rc, req = side.e.transfer_async(side.remote, WRITE, [hixl.TransferOpDesc(
            side.buf.ctypes.data + i * MIB, side.raddr + i * MIB, MIB)], timeout_in_millis=TIMEOUT_MS)
        assert rc == SUCCESS, side.e.last_error()
        reqs.append((req, time.monotonic()))
    _sh("ip", "link", "set", NIC, "down")
    time.sleep(0.5)
    _sh("ip", "link", "set", NIC, "up")
    ends = []
    for req, t_sub in reqs:
        rc, st = side.e.transfer_wait(req, TIMEOUT_MS + int(SLACK_S * 1000) + 5000)
        assert rc == SUCCESS and st != TransferStatus.WAITING
        ends.append((st.name, time.monotonic() - t_sub))
    _check_ends(ends, "flap")
    reconnected = side.ensure_linked()  # at most one connect
    for i, (status, _) in enumerate(ends):
        if status == "COMPLETED":
            assert side.verify(i * MIB, (i + 1) * MIB), "flap: transfer %d COMPLETED but its bytes differ" % i
    results, _ = side.write_batch(2, MIB, seed=12)
    assert [s for s, _ in results] == ["COMPLETED", "COMPLETED"], results
    assert side.verify(0, 2 * MIB)
    RESULTS.setdefault(transport, {})["flap 0.5 s"] = {"MiB_per_s": 0.0, "statuses": [s for s, _ in ends],
                                                       "reconnected": reconnected}
    _report()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_link_down_past_the_heartbeat_bound_is_closed_on_both_ends_and_connect_works_after(sides, transport):
    side = sides[transport]
    side.ensure_linked()
    for name in (list(OTHER_RDMA) if transport == "rdma" else []):  # A's count of heartbeat closes is per engine
        other = sides[name]
        if other.linked():
            assert other.e.disconnect(other.remote) == SUCCESS
            _until(lambda: not other.linked(), 10, "the link of B's engine %r to go" % name)
    before_a = _peer_closed(transport, "heartbeat")
    _sh("ip", "link", "set", NIC, "down")
    try:
        _until(lambda: not side.linked(), 10, "B to close its link (bound 2 s)")
        _until(lambda: _peer_closed(transport, "heartbeat") > before_a, 10, "A to close its link by the heartbeat")
    finally:
        _sh("ip", "link", "set", NIC, "up")
    m = side.e.metrics()
    causes = {s["labels"]["cause"]: s["value"] for s in m["hixl_link_closed_total"] if s["value"]}
    assert causes.get("heartbeat" if transport == "tcp" else "async_event", 0) + causes.get("heartbeat", 0) >= 1, causes
    side.connect()
    results, _ = side.write_batch(1, MIB, seed=13)
    assert results[0][0] == "COMPLETED", results
    assert side.verify(0, MIB)


def _push(sides, n: int):
    """n async 1 MiB WRITEs from each side: [(side, request)]."""
    reqs = []
    for side in sides.values():
        side.ensure_linked()
        side.buf[: n * MIB] = 1
        for i in range(n):
            rc, req = side.e.transfer_async(side.remote, WRITE, [hixl.TransferOpDesc(
                side.buf.ctypes.data + i * MIB, side.raddr + i * MIB, MIB)], timeout_in_millis=TIMEOUT_MS)
            if rc == SUCCESS:
                reqs.append((side, req))
    return reqs


def _host(verb: str, wait_for: str) -> float:
    """Asks the host to act on guest A ($TV_ST/<verb>.A, see ci/two-vm/two-vm.sh); when it did."""
    open(os.path.join(ST, verb + ".A"), "w").close()
    _until(lambda: os.path.exists(os.path.join(ST, wait_for + ".A")), 30, "the host to %s guest A" % verb)
    return time.monotonic()


def test_z_a_frozen_peer_host_ends_everything_within_its_timeout_and_connect_works_after(sides):
    """A host that hangs rather than vanishes: its NIC stops answering, its TCP connections stay open. B's
    engines push 16 x 1 MiB each into the frozen host: every request ends within its timeout, each link
    closes (heartbeat, or the queue pair's retries running out). Once, each wait took its turn behind the
    others (463 s for 80 waits with the links closed in ~2 s); a request's link is now released after the
    request table's lock (engine/requests.cc)."""
    names = {id(side): name for name, side in sides.items()}
    for side in sides.values():
        side.ensure_linked()
    t_stop = _host("stop", "stopped")
    try:
        reqs = _push(sides, 16)
        ends = {}
        for side, req in reqs:
            rc, st = side.e.transfer_wait(req, TIMEOUT_MS + int(SLACK_S * 1000) + 5000)
            assert rc == SUCCESS and st != TransferStatus.WAITING
            ends.setdefault((names[id(side)], st.name), []).append(time.monotonic() - t_stop)
        took = time.monotonic() - t_stop
        for name, side in sides.items():
            _until(lambda: not side.linked(), 10, "B's engine %r to close its link to the frozen host" % name)
        closed = time.monotonic() - t_stop
    finally:
        _host("cont", "resumed")
    summary = {"%s %s" % k: [len(v), round(max(v), 3)] for k, v in ends.items()}
    with open(os.path.join(ST, "host-frozen.json"), "w") as f:
        json.dump({"requests": len(reqs), "all_ended_within_s": took, "links_closed_within_s": closed,
                   "ends": summary}, f)
    assert took <= TIMEOUT_MS / 1000 + SLACK_S, (took, summary)
    # Nothing written over rdma completes without the frozen host's acknowledgement.
    assert not [k for k in ends if k[0].startswith("rdma") and k[1] == "COMPLETED"], summary
    # A goes on: one connect per engine restores its link, and bytes move and land. Not held to the last:
    # the ACK timeout 12 sides, on which rxe fails a queue pair now and then on a clean link ("remote
    # invalid request", README options; seen here once, on the first write after the resume).
    for name, side in sides.items():
        side.connect()
        if "t=12" in name:
            continue
        results, _ = side.write_batch(1, MIB, seed=14)
        assert results[0][0] == "COMPLETED", (name, results)
        assert side.verify(0, MIB), name


def test_zz_the_peer_host_removed_mid_transfer_ends_everything_within_its_timeout(sides):
    for name in ("rdma", "rdma 4qp", "rdma 4qp t=12", "rdma 4qp 4MiB"):  # several queue pairs per link: the module's doc (B's QEMU)
        sides.pop(name).close()
    reqs = _push(sides, 16)
    t_kill = _host("kill", "killed")  # the host removes guest A now
    for side, req in reqs:
        rc, st = side.e.transfer_wait(req, TIMEOUT_MS + int(SLACK_S * 1000) + 5000)
        assert rc == SUCCESS and st != TransferStatus.WAITING
    took = time.monotonic() - t_kill
    assert took <= TIMEOUT_MS / 1000 + SLACK_S, took
    for side in sides.values():
        _until(lambda: not side.linked(), 10, "B to close its link to the removed host")
    with open(os.path.join(ST, "host-removed.json"), "w") as f:
        json.dump({"requests": len(reqs), "all_ended_within_s": took}, f)
