"""Same-host transport where the kernel forbids cross-memory attach.

The peer process installs a seccomp filter that makes process_vm_readv/writev fail with EPERM (what
Docker's default profile does without CAP_SYS_PTRACE, and Yama's ptrace_scope between siblings).
Connect-time probes must notice it on either side: ``auto`` then falls back to tcp with a warning
that says why, an explicit ``shm`` is refused with that reason, and bytes still move. A control
run without the filter picks shm, so the filter is what changes the outcome.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hixl
from hixl import READ, SUCCESS, UNSUPPORTED, WRITE, MemDesc, TransferOpDesc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import no_cma  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SIZE = 1 << 20
PATTERN = (np.arange(SIZE) % 251).astype(np.uint8)

pytestmark = pytest.mark.skipif(not no_cma.supported(), reason="seccomp filter written for x86_64/aarch64 Linux")


def _peer(*args):
    return subprocess.Popen([sys.executable, str(REPO / "tests" / "engine_peer.py"), *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p):
    """Close the peer's stdin (it finalizes and exits); its stderr."""
    try:
        return p.communicate(timeout=30)[1]
    finally:
        p.kill()
        p.wait()


def _engine(transport="auto", listen=False):
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:0" if listen else "127.0.0.1", {"HixlTransport": transport}) == SUCCESS, \
        e.last_error()
    return e


def _write_and_read_back(e, info):
    src, back = PATTERN.copy(), np.zeros(SIZE, np.uint8)
    for b in (src, back):
        assert e.register_mem(MemDesc(b.ctypes.data, SIZE))[0] == SUCCESS
    assert e.transfer_sync(info["name"], WRITE, [TransferOpDesc(src.ctypes.data, info["addr"], SIZE)], 20000) \
        == SUCCESS, e.last_error()
    assert e.transfer_sync(info["name"], READ, [TransferOpDesc(back.ctypes.data, info["addr"], SIZE)], 20000) \
        == SUCCESS, e.last_error()
    assert np.array_equal(back, src)


@pytest.mark.parametrize("forbid", [False, True], ids=["cma-allowed", "cma-forbidden"])
def test_server_side_probe_falls_back_to_tcp_with_a_warning(forbid):
    """The target forbids CMA: its probe of our cookie fails, it answers with tcp and logs why."""
    p = _peer("auto", str(SIZE), *(["--no-cma"] if forbid else []))
    e = _engine()
    try:
        info = json.loads(p.stdout.readline())
        assert e.connect(info["name"], 20000) == SUCCESS, e.last_error()
        assert e.get_transport(info["name"]) == (SUCCESS, "tcp" if forbid else "shm")
        _write_and_read_back(e, info)
    finally:
        e.finalize()
        err = _finish(p)
    print(err)
    if forbid:
        assert "process_vm_readv" in err and "not permitted" in err and "using tcp" in err, err
    else:
        assert "using tcp" not in err, err


def test_client_side_probe_retries_without_shm():
    """We (the target) can reach the peer, the peer cannot reach us: the peer's probe back fails,
    it reconnects offering no shm, and its WRITE lands over tcp."""
    e = _engine(listen=True)
    dst = np.zeros(SIZE, np.uint8)
    try:
        assert e.register_mem(MemDesc(dst.ctypes.data, SIZE))[0] == SUCCESS
        p = _peer("auto", str(SIZE), "--no-cma", "--write-to", e.local_engine, str(dst.ctypes.data))
        out = json.loads(p.stdout.readline())
        err = _finish(p)
        print(out, err)
        assert out["rc"] == SUCCESS and out["transport"] == "tcp", out
        assert "not usable from this side" in err and "process_vm_readv" in err and "not permitted" in err, err
        assert np.array_equal(dst, PATTERN)
    finally:
        e.finalize()


def test_explicit_shm_is_refused_with_the_reason():
    """HixlTransport=shm on both ends, CMA forbidden at the target: UNSUPPORTED, and the error says why."""
    p = _peer("shm", str(SIZE), "--no-cma")
    e = _engine("shm")
    try:
        info = json.loads(p.stdout.readline())
        rc = e.connect(info["name"], 20000)
        print(rc, e.last_error())
        assert rc == UNSUPPORTED, (rc, e.last_error())
        assert "process_vm_readv" in e.last_error() and "not permitted" in e.last_error(), e.last_error()
    finally:
        e.finalize()
        _finish(p)
