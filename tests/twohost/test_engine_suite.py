"""The two-engine suite (tests/test_hixl_engine.py) once across the link, on rdma and tcp (a smoke test).

Guest B runs every test of the suite here with engine `a` and its buffers on guest A (served by
tests/twohost/peer.py through tests/twohost/remote.py) and engine `b` on B's own address: every
connect, WRITE, READ, notify, flag, disconnect and reconnect of the suite crosses the QEMU link (each
guest has its own rxe0), and every byte is compared as on one host. shm and the tests that make
engines of their own on one host (marked onehost) are deselected here, not skipped (CI's junit check
fails on a skip); the single-host tiers run them. Outside guest B this copy is deselected whole.
"""
from __future__ import annotations

import os

import pytest

from tests.engine_pair import HOSTS
from tests.test_hixl_engine import *  # noqa: F401,F403 - the suite's tests and fixtures, collected here too

pytestmark = pytest.mark.twohost

if os.environ.get("TV_ST"):  # inside guest B: point the suite at guest A
    from tests.twohost import remote
    from tests.twohost.test_faults import _peer

    info = _peer()["remote"]
    HOSTS.remote = remote.Client((info["host"], info["port"]), bytes.fromhex(info["key"]))
    HOSTS.myip = os.environ.get("TV_MYIP", "192.168.88.2")
    HOSTS.big //= 4
