"""The scaffolding of the two-engine suite (tests/test_hixl_engine.py): the transport each test runs on,
engines, the Pair of engines with their buffers, and small waits.

Where the engines live is the one thing the two copies of the suite differ in: `HOSTS.remote` is None
on one host (both engines here); in the two-host tier (tests/twohost/test_engine_suite.py) it is the
connection to the other host (tests/twohost/remote.Client), where each Pair's engine `a` and its
buffers then live, and `HOSTS.myip` is this host's address on the link.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import hixl
from hixl import SUCCESS, MemDesc, MemType, TransferStatus

# rdma4: rdma with every link striped over 4 queue pairs (HixlRdmaQpsPerLink=4 on both ends)
TRANSPORTS = [pytest.param("rdma", marks=pytest.mark.rdma), pytest.param("rdma4", marks=pytest.mark.rdma),
              "shm", "tcp"]
MiB = 1 << 20
# transport: the running test's transport (the `transport` fixture sets it), qps: its queue pairs per
# rdma link; remote, myip: see the module's doc; big: the bytes of the tests that need a transfer still
# running when something happens to it (a deadline, a flag behind it). Across the emulated link a
# quarter of it still runs for seconds, and every byte the test compares crosses the link again.
HOSTS = SimpleNamespace(transport="rdma", qps=1, remote=None, myip="127.0.0.1", big=64 * MiB)


@pytest.fixture(params=TRANSPORTS, autouse=True)
def transport(request):
    """Every test of a module that imports this runs once per transport; _engine() picks it up."""
    HOSTS.transport, HOSTS.qps = ("rdma", 4) if request.param == "rdma4" else (request.param, 1)
    yield request.param


def transport_name() -> str:
    """The running test's transport as an engine names it ("rdma" for rdma4 too)."""
    return HOSTS.transport


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


def _engine(options=None, listen=True, remote=False):
    """An initialized engine on this host, or (remote, in the two-host tier) on the other one."""
    opts = {"HixlTransport": HOSTS.transport}
    if HOSTS.transport == "rdma":  # explicit: on Soft-RoCE the engine's default is 4 (test_rdma_defaults.py)
        opts["HixlRdmaQpsPerLink"] = str(HOSTS.qps)
    opts.update(options or {})
    if remote and HOSTS.remote is not None:
        return HOSTS.remote.engine(opts, listen)
    e = hixl.Hixl()
    assert e.initialize(HOSTS.myip + ":0" if listen else HOSTS.myip, opts) == SUCCESS, e.last_error()
    return e


def _wait_status(e, req, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        rc, st = e.get_transfer_status(req)
        assert rc == SUCCESS, e.last_error()
        if st != TransferStatus.WAITING:
            return st
        assert time.monotonic() < deadline, "request %d still WAITING after %ss" % (req, timeout_s)
        time.sleep(0.001)


def _readable(fd, timeout_s):
    """Whether engine a's descriptor fd (on a's host) becomes readable within timeout_s."""
    if HOSTS.remote is not None:
        return HOSTS.remote.readable(fd, timeout_s)
    import select
    return bool(select.select([fd], [], [], timeout_s)[0])


def _until(pred, timeout_s=30.0, what="condition"):
    """Waits for ``pred()`` to be truthy and returns what it returned."""
    deadline = time.monotonic() + timeout_s
    while not (v := pred()):
        assert time.monotonic() < deadline, "timed out waiting for " + what
        time.sleep(0.005)
    return v


class Pair:
    """Engine `a` listens and owns buffer `abuf`; engine `b` listens too, owns `bbuf` and connects to `a`.
    In the two-host tier `a` and `abuf` (and a_zeros()'s buffers) live on the other host."""

    def __init__(self, size=8 * MiB, a_opts=None, b_opts=None):
        self._remote = []  # roots on a's host, released by close()
        self.a = _engine(a_opts, remote=True)
        if HOSTS.remote is not None:
            self._remote.append(self.a)
        self.b = None
        try:
            self.b = _engine(b_opts)
            rng = np.random.default_rng(20261202)
            self.abuf = self.a_zeros(size)
            self.bbuf = rng.integers(0, 256, size, dtype=np.uint8)
            rc, self.ha = self.a.register_mem(MemDesc(_addr(self.abuf), size), MemType.MEM_HOST)
            assert rc == SUCCESS, self.a.last_error()
            rc, self.hb = self.b.register_mem(MemDesc(_addr(self.bbuf), size), MemType.MEM_HOST)
            assert rc == SUCCESS, self.b.last_error()
            assert self.b.connect(self.a.local_engine, 10000) == SUCCESS, self.b.last_error()
        except BaseException:
            self.close()  # nothing left behind on a's host either
            raise

    def a_zeros(self, n):
        """n zero bytes on a's host."""
        if HOSTS.remote is None:
            return np.zeros(n, np.uint8)
        self._remote.append(HOSTS.remote.zeros(n))
        return self._remote[-1]

    def close(self):
        try:
            if self.b is not None:
                self.b.finalize()
            self.a.finalize()
        finally:
            if HOSTS.remote is not None:  # a, its buffers and whatever the test derived from them
                for root in self._remote:
                    HOSTS.remote.release(root)


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()
