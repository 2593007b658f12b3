"""Reliability: two engines that connect to each other from several threads at once, on a host whose
every core is busy, and at once exchange notifies and flagged writes.

Each connect() must end with the one link between them usable (SUCCESS, or ALREADY_CONNECTED for a
link that existed before the call): no thread may see NOT_CONNECTED after its connect returned, and
both ends must keep exactly that link (none closed as superseded by the other end's connect). One
suite over rdma (the CI VM), shm and tcp; the CPU hogs are busy processes, two per core.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from .helpers import REPO, free_port

STORM = REPO / "tests" / "connect_storm_peer.py"
THREADS, ROUNDS = 8, 5


@pytest.fixture
def hogs():
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 * (os.cpu_count() or 1))]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_both_ends_connecting_from_many_threads_under_cpu_hogs_get_one_working_link(transport, hogs):
    d = tempfile.mkdtemp(prefix="hixl-storm-")
    a, b = free_port(), free_port()
    sides = [subprocess.Popen([sys.executable, str(STORM), transport, str(x), str(y), str(THREADS), str(ROUNDS), d],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for x, y in ((a, b), (b, a))]
    try:
        out = [json.loads(p.stdout.readline() or "{}") for p in sides]
    finally:
        for p in sides:
            p.stdin.close()
        for p in sides:
            p.wait(60)
            p.stdout.close()
    want_flags = sorted(1000 * i + r for i in range(THREADS) for r in range(ROUNDS))
    want_notes = sorted(("t%d" % i, str(r)) for i in range(THREADS) for r in range(ROUNDS))
    for name, got in zip(("a", "b"), out):
        assert got, "side %s printed nothing" % name
        assert got["n_errors"] == 0, (name, got["errors"])
        assert got["flags"] == want_flags, (name, got["flags"][:20])
        assert sorted(map(tuple, got["notifies"])) == want_notes, name
        assert got["last_bytes"] == [ROUNDS * i + ROUNDS - 1 for i in range(THREADS)], (name, got["last_bytes"])
        assert got["linked"], "side %s lost its link after the storm" % name
        print("%s %s: slowest connect %.3f s, slowest notify+write round %.3f s"
              % (transport, name, got["slowest"]["connect"], got["slowest"]["round"]))
