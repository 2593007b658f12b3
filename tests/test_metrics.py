"""Metrics an operator can scrape: ``Hixl.metrics()`` and ``/metrics`` (HixlMetricsPort).

Each test runs once per transport (rdma in the CI VM, shm and tcp on the host) between two engines
of this process. What the engine counts is checked against what the test did, and what ``/metrics``
serves (a real HTTP scrape, parsed by ``prometheus_client.parser``) against ``Hixl.metrics()``.
"""
from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import hixl
from hixl import FAILED, PARAM_INVALID, READ, SUCCESS, WRITE, MemDesc, MemType, NotifyDesc, TransferOpDesc

parser = pytest.importorskip("prometheus_client.parser")

TRANSPORTS = [pytest.param("rdma", marks=pytest.mark.rdma), "shm", "tcp"]
SIZE = 1 << 16


def _value(m: dict, name: str, **labels) -> float:
    """The samples named `name` whose labels include `labels`, summed."""
    hits = [s["value"] for fam in m.values() for s in fam
            if s["name"] == name and all(s["labels"].get(k) == v for k, v in labels.items())]
    assert hits, "no sample %s%s in %s" % (name, labels, m.get(name))
    return sum(hits)


def _scrape(address: str) -> dict:
    """{(sample name, sorted labels): value} of a real GET /metrics."""
    with urllib.request.urlopen("http://%s/metrics" % address, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("hixl_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _flat(m: dict) -> dict:
    return {(s["name"], tuple(sorted(s["labels"].items()))): s["value"] for samples in m.values() for s in samples}


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    t = request.param
    ini, tgt = hixl.Hixl(), hixl.Hixl()
    assert ini.initialize("127.0.0.1:0", {"HixlTransport": t, "HixlMetricsPort": "0"}) == SUCCESS, ini.last_error()
    assert tgt.initialize("127.0.0.1:0", {"HixlTransport": t}) == SUCCESS, tgt.last_error()
    ibuf = np.arange(SIZE, dtype=np.uint8)
    tbuf, ro = np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)
    assert ini.register_mem(MemDesc(ibuf.ctypes.data, SIZE), MemType.MEM_HOST)[0] == SUCCESS
    assert tgt.register_mem(MemDesc(tbuf.ctypes.data, SIZE), MemType.MEM_HOST)[0] == SUCCESS
    assert tgt.register_mem(MemDesc(ro.ctypes.data, SIZE), MemType.MEM_HOST, access="ro")[0] == SUCCESS
    assert ini.connect(tgt.local_engine, 10000) == SUCCESS, ini.last_error()
    yield t, ini, tgt, ibuf, tbuf, ro
    ini.finalize()
    tgt.finalize()


def test_what_the_engine_did_is_counted_and_served(pair):
    t, ini, tgt, ibuf, tbuf, ro = pair
    peer, ia, ta = tgt.local_engine, ibuf.ctypes.data, tbuf.ctypes.data
    m0 = ini.metrics()
    assert _value(m0, "hixl_links", transport=t) == 1
    assert _value(m0, "hixl_transfers_total") == 0
    # Two WRITEs (1 + 3 descriptors, 4096 + 3 x 100 bytes), one async READ of 2 x 512.
    assert ini.transfer_sync(peer, WRITE, [TransferOpDesc(ia, ta, 4096)]) == SUCCESS, ini.last_error()
    d3 = [TransferOpDesc(ia + 100 * k, ta + 8192 + 100 * k, 100) for k in range(3)]
    assert ini.transfer_sync(peer, WRITE, d3) == SUCCESS, ini.last_error()
    rc, req = ini.transfer_async(peer, READ, [TransferOpDesc(ia + 16384, ta, 512), TransferOpDesc(ia + 20000, ta, 512)])
    assert rc == SUCCESS and ini.transfer_wait(req, 10000) == (SUCCESS, hixl.TransferStatus.COMPLETED)
    assert bytes(tbuf[:4096]) == bytes(ibuf[:4096])
    # Refusals: outside every region (range), a read-only region written (access), a bad flag (param).
    assert ini.transfer_sync(peer, WRITE, [TransferOpDesc(ia, ta + SIZE, 64)]) == PARAM_INVALID
    assert ini.transfer_sync(peer, WRITE, [TransferOpDesc(ia, ro.ctypes.data, 64)]) == PARAM_INVALID
    assert not ro.any()  # nothing was posted
    assert ini.transfer_sync(peer, READ, [TransferOpDesc(ia, ta, 64)], flag=1) == PARAM_INVALID
    assert ini.transfer_async(peer, WRITE, [TransferOpDesc(ia, ta, 64)], flag=-5)[0] == PARAM_INVALID
    # A notify each way.
    assert ini.send_notify(peer, NotifyDesc("n", "hello")) == SUCCESS, ini.last_error()
    assert tgt.send_notify(ini.local_engine, NotifyDesc("m", "hi")) == SUCCESS, tgt.last_error()
    assert ini.wait_notifies(5000)[1]

    m = ini.metrics()
    assert _value(m, "hixl_transfers_total", op="write", transport=t, status="completed") == 2
    assert _value(m, "hixl_transfers_total", op="read", transport=t, status="completed") == 1
    assert _value(m, "hixl_transfers_total", status="failed") == _value(m, "hixl_transfers_total", status="timeout") == 0
    assert _value(m, "hixl_transfer_bytes_total", op="write", transport=t) == 4096 + 300
    assert _value(m, "hixl_transfer_bytes_total", op="read", transport=t) == 1024
    assert _value(m, "hixl_descriptors_total", op="write", transport=t) == 4
    assert _value(m, "hixl_descriptors_total", op="read", transport=t) == 2
    assert _value(m, "hixl_transfer_seconds_count", op="write") == 2
    assert _value(m, "hixl_transfer_seconds_bucket", op="write", le="+Inf") == 2
    assert 0 < _value(m, "hixl_transfer_seconds_sum", op="write") < 20
    buckets = [s["value"] for s in m["hixl_transfer_seconds"] if s["name"].endswith("_bucket")
               and s["labels"]["op"] == "write"]
    assert buckets == sorted(buckets)  # cumulative
    assert _value(m, "hixl_refused_total", reason="range") == 1
    assert _value(m, "hixl_refused_total", reason="access") == 1
    assert _value(m, "hixl_refused_total", reason="param") == 2  # one refused in C++, one in Python
    assert _value(m, "hixl_notifies_total", direction="sent") == 1
    assert _value(m, "hixl_notifies_total", direction="received") == 1
    assert _value(tgt.metrics(), "hixl_notifies_total", direction="received") == 1

    # /metrics serves the same, in the text format Prometheus scrapes.
    assert _scrape(ini.metrics_address) == _flat(ini.metrics())


def test_links_closed_are_counted_by_cause(pair):
    t, ini, tgt, *_ = pair
    assert ini.disconnect(tgt.local_engine, 5000) == SUCCESS
    m = ini.metrics()
    assert _value(m, "hixl_link_closed_total", cause="disconnect") == 1
    assert _value(m, "hixl_links", transport=t) == 0
    # The peer saw our goodbye.
    deadline = time.monotonic() + 10
    while _value(tgt.metrics(), "hixl_link_closed_total", cause="peer_closed") < 1:
        assert time.monotonic() < deadline, tgt.metrics()["hixl_link_closed_total"]
        time.sleep(0.02)
    assert _value(tgt.metrics(), "hixl_links") == 0
    assert _value(m, "hixl_link_closed_total") == 1  # no other cause


def test_a_peer_refused_for_authentication_is_counted():
    srv, cli = hixl.Hixl(), hixl.Hixl()
    assert srv.initialize("127.0.0.1:0", {"HixlTransport": "tcp", "HixlAuthToken": "s3cret"}) == SUCCESS
    assert cli.initialize("127.0.0.1:0", {"HixlTransport": "tcp"}) == SUCCESS
    try:
        assert cli.connect(srv.local_engine, 5000) == FAILED
        assert _value(srv.metrics(), "hixl_link_closed_total", cause="auth") == 1
        assert _value(srv.metrics(), "hixl_links") == 0
    finally:
        cli.finalize()
        srv.finalize()


def test_metrics_port_option_env_and_errors(monkeypatch):
    e = hixl.Hixl()
    assert e.metrics() == {}  # not initialized
    assert e.initialize("127.0.0.1:0", {"HixlMetricsPort": "70000"}) == PARAM_INVALID
    assert "HixlMetricsPort" in e.last_error()
    assert e.initialize("127.0.0.1:0", {"HixlMetricsPort": "x"}) == PARAM_INVALID
    # A port in use: initialize fails (asked for, so not silently without) and says which.
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        assert e.initialize("127.0.0.1:0", {"HixlMetricsPort": str(port)}) == FAILED
        assert str(port) in e.last_error() and "metrics" in e.last_error()
    finally:
        busy.close()
    # The env variable, when the option is absent; served on the engine's host; gone after finalize.
    monkeypatch.setenv("HIXL_METRICS_PORT", "0")
    assert e.initialize("127.0.0.1:0", {"HixlTransport": "tcp"}) == SUCCESS, e.last_error()
    addr = e.metrics_address
    assert addr.startswith("127.0.0.1:")
    assert ("hixl_links", (("transport", "tcp"),)) in _scrape(addr)
    e.finalize()
    assert e.metrics_address == "" and e.metrics() == {}
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen("http://%s/metrics" % addr, timeout=2)
    monkeypatch.setenv("HIXL_METRICS_PORT", "-1")
    assert e.initialize("127.0.0.1:0") == PARAM_INVALID and "HIXL_METRICS_PORT" in e.last_error()
    monkeypatch.delenv("HIXL_METRICS_PORT")
    e2 = hixl.Hixl()
    assert e2.initialize("127.0.0.1:0", {"HixlTransport": "tcp"}) == SUCCESS
    assert e2.metrics_address == ""  # opt-in
    assert _value(e2.metrics(), "hixl_links") == 0
    e2.finalize()
