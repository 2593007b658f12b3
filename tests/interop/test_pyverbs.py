"""Tier 3 (`interop`): our endpoint against a peer built only with pyverbs (an independent verbs stack)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import hixl
from hixl import TransferStatus

pytestmark = pytest.mark.interop

SYSTEM_PYTHON = os.environ.get("HIXL_PYVERBS_PYTHON", "/usr/bin/python3")
PEER = Path(__file__).with_name("pyverbs_peer.py")


class PyverbsPeer:
    def __init__(self, device: str, gid_index: int, size: int):
        self.proc = subprocess.Popen(
            [SYSTEM_PYTHON, str(PEER), "--device", device, "--gid-index", str(gid_index), "--size", str(size)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            self.info = self.recv()
        except Exception:
            self.close()
            raise

    def send(self, obj):
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"pyverbs peer exited (rc={self.proc.wait(10)})")
        return json.loads(line)

    def call(self, **cmd):
        self.send(cmd)
        return self.recv()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "exit"})
                self.proc.wait(10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdin.close()
        self.proc.stdout.close()


@pytest.fixture
def peer_and_ep():
    probe = subprocess.run([SYSTEM_PYTHON, "-c", "import pyverbs.device"], capture_output=True)
    if probe.returncode != 0:
        if os.environ.get("HIXL_REQUIRE_RDMA") == "1":
            pytest.fail(f"pyverbs is not importable by {SYSTEM_PYTHON}: {probe.stderr.decode()[-300:]}")
        pytest.skip(f"pyverbs not importable by {SYSTEM_PYTHON}")
    ep = hixl.Endpoint()
    li = ep.info()
    peer = PyverbsPeer(li["device"], li["gid_index"], 1 << 20)
    try:
        ep.connect(peer.info)  # from its plain connection info only
        peer.send(li)
        assert peer.recv() == {"ok": True}
    except BaseException:
        peer.close()
        ep.close()
        raise
    yield peer, ep
    peer.close()
    ep.close()


def test_our_writes_land_in_pyverbs_mr(peer_and_ep):
    peer, ep = peer_and_ep
    rng = np.random.default_rng(7)
    for size, off in [(1, 0), (4097, 13), (300_001, 4096 + 3)]:
        src = rng.integers(0, 256, size, dtype=np.uint8)
        m = ep.register(src)
        ep.wait_ok(ep.write([(m.addr, peer.info["addr"] + off, size)], peer.info["rkey"]), 30000)
        got = bytes.fromhex(peer.call(cmd="read", offset=off, length=size)["hex"])
        assert got == src.tobytes()
        ep.deregister(m)


def test_our_reads_return_pyverbs_bytes(peer_and_ep):
    peer, ep = peer_and_ep
    pattern = bytes((i * 37 + 11) % 256 for i in range(65536))
    assert peer.call(cmd="fill", offset=1000, hex=pattern.hex()) == {"ok": True}
    dst = np.zeros(65536 + 8, np.uint8)
    m = ep.register(dst)
    ep.wait_ok(ep.read([(m.addr + 8, peer.info["addr"] + 1000, 65536)], peer.info["rkey"]), 30000)
    assert dst[8:].tobytes() == pattern


def test_our_write_with_imm_appears_in_pyverbs_cq(peer_and_ep):
    peer, ep = peer_and_ep
    src = np.full(512, 0xAB, np.uint8)
    m = ep.register(src)
    for imm in (0x12345678, 0, 0xFFFFFFFF):
        ep.wait_ok(ep.write_imm([(m.addr, peer.info["addr"], 512)], peer.info["rkey"], imm), 30000)
        wc = peer.call(cmd="poll_imm", timeout_ms=10000)
        assert wc["imm"] == imm and wc["with_imm"] and wc["status"] == 0, wc
    assert bytes.fromhex(peer.call(cmd="read", offset=0, length=512)["hex"]) == src.tobytes()


def test_bad_rkey_against_pyverbs_is_a_clear_failure(peer_and_ep):
    peer, ep = peer_and_ep
    src = np.ones(64, np.uint8)
    m = ep.register(src)
    st, err = ep.wait_result(ep.write([(m.addr, peer.info["addr"], 64)], peer.info["rkey"] ^ 0xFFFF), 30000)
    assert st == TransferStatus.FAILED and "remote" in err.lower(), err
