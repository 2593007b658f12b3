"""Faults on a real link (issue 18): guest B of ci/two-vm against guest A's engines (tests/twohost/peer.py).

Every packet between the two crosses a QEMU network link, where ``tc netem`` (on B's NIC: B's egress,
which carries WRITE data and READ requests) and ``ip link`` inject faults, on rdma (each guest has
its own rxe0) and on tcp. What the user must see:

* under loss, delay, reordering, duplication and corruption: every transfer either COMPLETED with
  every byte verified (read back and compared), or FAILED/TIMEOUT within its timeout; never a hang,
  never silent corruption; notifies likewise. The effective bandwidth under each fault is recorded
  against the clean link ($TV_ST/faults.json, printed), with the goal >= 0.5x clean at 1 % loss on rdma
  (measured with the default ACK timeout, and on further rdma engines of B's: with HixlRdmaTimeout=12, and
  with each link striped over 4 queue pairs, HixlRdmaQpsPerLink=4, with both ACK timeouts);
* the link down for 0.5 s: in-flight requests end (completed, or failed within their timeout); later
  transfers work, without a connect where the link survived, after one where it did not;
* the link down past the heartbeat bound: the link is closed on both ends (A: the heartbeat; B: the
  heartbeat on tcp, the device's port-down event on rdma); connect works once the link is back;
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
SHORT_TIMEOUT = 12  # HixlRdmaTimeout of the extra rdma side: 4.096 us * 2^12 = 16 ms (default 14: 67 ms)
SHORT = "rdma t=%d" % SHORT_TIMEOUT
STRIPED = {"rdma 4qp": {"HixlRdmaQpsPerLink": "4"},  # A's rdma engine allows 4 queue pairs per link
           "rdma 4qp t=%d" % SHORT_TIMEOUT: {"HixlRdmaQpsPerLink": "4", "HixlRdmaTimeout": str(SHORT_TIMEOUT)}}
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
    s[SHORT] = Side("rdma", peer, {"HixlRdmaTimeout": str(SHORT_TIMEOUT)}, listen=True)
    for name, opts in STRIPED.items():
        s[name] = Side("rdma", peer, opts, listen=True)
        assert s[name].e.get_link_info(s[name].remote)[1]["qps"] == 4
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


@pytest.mark.parametrize("fault", ["clean", "loss 1%"])
def test_a_shorter_ack_timeout_recovers_sooner_from_loss(sides, fault):
    """rdma with HixlRdmaTimeout=12 (16 ms instead of 67 ms): a loss rxe cannot recover by a NAK waits that
    long. 12 is as low as rxe takes here: at 11 and below its QP died now and then (IBV_WC_REM_INV_REQ_ERR)."""
    _under_fault(sides[SHORT], SHORT, fault)


@pytest.mark.parametrize("side", list(STRIPED))
@pytest.mark.parametrize("fault", ["clean", "loss 1%"])
def test_a_link_striped_over_four_queue_pairs_rides_out_loss(sides, side, fault):
    """rdma with each link's bytes striped over 4 queue pairs (HixlRdmaQpsPerLink=4): while one queue pair
    waits out a retransmission the others keep the link busy. ib_write_bw -q 4 across this link: 2-3x the
    bandwidth of one queue pair at 1% loss, ~1.5x clean."""
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
                goals.append({"goal": "%s bandwidth at 1%% loss >= 0.5x the clean link" % t, "value": ratio,
                              "met": ratio >= 0.5})
    text = "\n".join(lines + ["goal: %s: %s (%.2fx)" % (g["goal"], "met" if g["met"] else "MISSED", g["value"])
                              for g in goals])
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
    for name in ([SHORT, *STRIPED] if transport == "rdma" else []):  # A's count of heartbeat closes is per engine
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


def test_zz_the_peer_host_removed_mid_transfer_ends_everything_within_its_timeout(sides):
    for name in STRIPED:  # see the module's doc: the host's QEMU, not ours, fails with them
        sides.pop(name).close()
    for side in sides.values():
        side.ensure_linked()
        side.buf[: 16 * MIB] = 1
    reqs = []
    for side in sides.values():
        for i in range(16):
            rc, req = side.e.transfer_async(side.remote, WRITE, [hixl.TransferOpDesc(
                side.buf.ctypes.data + i * MIB, side.raddr + i * MIB, MIB)], timeout_in_millis=TIMEOUT_MS)
            if rc == SUCCESS:
                reqs.append((side, req))
    open(os.path.join(ST, "kill.A"), "w").close()  # the host removes guest A now
    _until(lambda: os.path.exists(os.path.join(ST, "killed.A")), 30, "the host to remove guest A")
    t_kill = time.monotonic()
    for side, req in reqs:
        rc, st = side.e.transfer_wait(req, TIMEOUT_MS + int(SLACK_S * 1000) + 5000)
        assert rc == SUCCESS and st != TransferStatus.WAITING
    took = time.monotonic() - t_kill
    assert took <= TIMEOUT_MS / 1000 + SLACK_S, took
    for side in sides.values():
        _until(lambda: not side.linked(), 10, "B to close its link to the removed host")
    with open(os.path.join(ST, "host-removed.json"), "w") as f:
        json.dump({"requests": len(reqs), "all_ended_within_s": took}, f)
