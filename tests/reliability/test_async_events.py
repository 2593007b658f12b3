"""Reliability: the RDMA device's async events end the affected links at once.

The engine watches its device's async events (``ibv_get_async_event``, one reader thread per device,
asleep in poll()): a QP error ends the link of that QP, a port or device error every RDMA link, each
with the event's name as the reason and ``hixl_link_closed_total{cause="async_event"}``. Without it, a
link whose port went down lingered until a transfer on it failed or the heartbeat gave up.

rdma only (rxe0 in the CI VM). The port test takes the rxe device's netdev down for real (rxe reports
IBV_EVENT_PORT_ERR) and brings it back up; the QP tests hand the engine an event as its device would
(a QP fatal error cannot be provoked on demand), which runs the same handler.
"""
from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

import hixl
from hixl import SUCCESS, NotifyDesc

from .helpers import engine as _engine, linked as _linked, until as _until

pytestmark = pytest.mark.rdma

IBV_EVENT_QP_FATAL, IBV_EVENT_COMM_EST, IBV_EVENT_PORT_ERR = 1, 4, 10


def _closed_by(e: hixl.Hixl, cause: str) -> float:
    return sum(s["value"] for s in e.metrics()["hixl_link_closed_total"] if s["labels"]["cause"] == cause)


@pytest.fixture
def ab():
    a, b = _engine("rdma"), _engine("rdma")
    assert a.connect(b.local_engine, 20000) == SUCCESS, a.last_error()
    _until(lambda: _linked(b, a.local_engine), 10, "b's end of the link")
    yield a, b
    a.finalize()
    b.finalize()


def test_a_qp_error_ends_that_qps_link_only(ab, capfd):
    a, b = ab
    c = _engine("rdma")
    try:
        assert a.connect(c.local_engine, 20000) == SUCCESS, a.last_error()
        qpn = a.get_link_info(b.local_engine)[1]["qpn"]
        # Events that are no error, and an error of a QP that is not ours: nothing closes.
        assert a._engine._inject_async_event(IBV_EVENT_COMM_EST, qpn, 0) == SUCCESS
        assert a._engine._inject_async_event(IBV_EVENT_QP_FATAL, 0xFFFFFF, 0) == SUCCESS
        assert _linked(a, b.local_engine) and _linked(a, c.local_engine)
        assert a._engine._inject_async_event(IBV_EVENT_QP_FATAL, qpn, 0) == SUCCESS
        assert not _linked(a, b.local_engine)  # at once: the handler ran before the call returned
        assert _linked(a, c.local_engine)
        assert _closed_by(a, "async_event") == 1
        assert a.send_notify(c.local_engine, NotifyDesc("still", "up"), 5000) == SUCCESS
        # The peer learns it as for any closed link (the connection ends).
        _until(lambda: not _linked(b, a.local_engine), 10, "b to see the link closed")
        err = capfd.readouterr().err
        assert re.search(r"reported IBV_EVENT_QP_FATAL.* on QP 0x%x" % qpn, err), err[-2000:]
    finally:
        c.finalize()


def test_a_qp_error_on_any_queue_pair_of_a_striped_link_ends_it():
    """A link striped over 4 queue pairs (HixlRdmaQpsPerLink): an error on its last one ends the link."""
    a, b = _engine("rdma", HixlRdmaQpsPerLink=4), _engine("rdma", HixlRdmaQpsPerLink=4)
    try:
        assert a.connect(b.local_engine, 20000) == SUCCESS, a.last_error()
        rc, info = a.get_link_info(b.local_engine)
        assert rc == SUCCESS and info["qps"] == 4 and len(set(info["qpns"])) == 4, info
        assert info["qpns"][0] == info["qpn"]
        assert a._engine._inject_async_event(IBV_EVENT_QP_FATAL, info["qpns"][-1], 0) == SUCCESS
        assert not _linked(a, b.local_engine)
        assert _closed_by(a, "async_event") == 1
        _until(lambda: not _linked(b, a.local_engine), 10, "b to see the link closed")
    finally:
        a.finalize()
        b.finalize()


def _netdev(dev: str) -> str:
    out = subprocess.run(["rdma", "link", "show", dev + "/1"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"netdev (\S+)", out)
    assert m, out
    return m.group(1)


def _port_active(dev: str) -> bool:
    out = subprocess.run(["ibv_devinfo", "-d", dev], capture_output=True, text=True).stdout
    return "PORT_ACTIVE" in out


@pytest.mark.exclusive  # the device's port goes down for every engine on this host: runs alone
@pytest.mark.skipif(os.geteuid() != 0, reason="takes the rxe device's netdev down (root, in the CI VM)")
def test_the_port_going_down_ends_every_rdma_link_at_once_and_connect_works_when_it_is_back(ab):
    a, b = ab
    dev = os.environ.get("RXE_DEV", "rxe0")
    nic = _netdev(dev)
    subprocess.run(["ip", "link", "set", nic, "down"], check=True)
    t0 = time.monotonic()
    try:
        _until(lambda: not _linked(a, b.local_engine) and not _linked(b, a.local_engine), 10,
               "both ends to close their link after the port went down")
        took = time.monotonic() - t0
        assert _closed_by(a, "async_event") + _closed_by(b, "async_event") >= 1
        assert took < 5, "links closed %.2f s after the port went down (the heartbeat bound is 10 s)" % took
    finally:
        subprocess.run(["ip", "link", "set", nic, "up"], check=True)
        _until(lambda: _port_active(dev), 30, "%s's port to be ACTIVE again" % dev)
    assert a.connect(b.local_engine, 20000) == SUCCESS, a.last_error()
    assert a.send_notify(b.local_engine, NotifyDesc("back", "up"), 5000) == SUCCESS, a.last_error()
