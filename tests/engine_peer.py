"""A hixl.Hixl peer in its own process, for tests that kill it or restrict it.

Usage: python3 tests/engine_peer.py TRANSPORT SIZE [--no-cma] [--write-to NAME ADDR] [--write-loop NAME ADDR]
                                    [--port N]

Serving (default): registers SIZE bytes of numpy memory, prints one JSON line {"name", "addr",
"len"}, then serves until it is killed or stdin closes.
--write-to NAME ADDR: connects to NAME instead, WRITEs SIZE bytes of the pattern i % 251 to ADDR,
prints {"rc", "transport", "error"} and exits.
--write-loop NAME ADDR: as --write-to, but WRITEs again and again: prints {"writing": true} after the
first one succeeded, and {"rc", "error", "writes"} at the first that did not; then waits for stdin to close.
--no-cma: first forbid cross-memory attach in this process with a seccomp filter (tests/no_cma.py),
as a container's seccomp profile or Yama's ptrace_scope would.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hixl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("transport")
    ap.add_argument("size", type=int)
    ap.add_argument("--no-cma", action="store_true")
    ap.add_argument("--write-to", nargs=2, metavar=("NAME", "ADDR"))
    ap.add_argument("--write-loop", nargs=2, metavar=("NAME", "ADDR"))
    ap.add_argument("--port", type=int, default=0, help="listen on this port (default: any free one)")
    a = ap.parse_args()
    if a.no_cma:
        import no_cma
        no_cma.forbid_cross_memory_attach()
    e = hixl.Hixl()
    rc = e.initialize("127.0.0.1:%d" % a.port, {"HixlTransport": a.transport})
    if rc != hixl.SUCCESS:
        sys.exit("initialize: %s" % e.last_error())
    writing = a.write_to or a.write_loop
    # i % 251, tiled from one period: no int64 array of SIZE elements
    buf = np.resize(np.arange(251, dtype=np.uint8), a.size) if writing else np.zeros(a.size, np.uint8)
    rc, _ = e.register_mem(hixl.MemDesc(buf.ctypes.data, a.size), hixl.MemType.MEM_HOST)
    if rc != hixl.SUCCESS:
        sys.exit("register_mem: %s" % e.last_error())
    if a.write_to:
        name, addr = a.write_to[0], int(a.write_to[1])
        rc = e.connect(name, 20000)
        if rc == hixl.SUCCESS:
            rc = e.transfer_sync(name, hixl.WRITE, [hixl.TransferOpDesc(buf.ctypes.data, addr, a.size)], 20000)
        print(json.dumps({"rc": int(rc), "transport": e.get_transport(name)[1], "error": e.last_error()}), flush=True)
        e.finalize()
        return
    if a.write_loop:
        write_loop(e, a.write_loop[0], int(a.write_loop[1]), buf)
        return
    print(json.dumps({"name": e.local_engine, "addr": buf.ctypes.data, "len": a.size}), flush=True)
    sys.stdin.read()  # until the test closes stdin or kills us
    e.finalize()


def write_loop(e, name: str, addr: int, buf) -> None:
    rc = e.connect(name, 20000)
    writes = 0
    while rc == hixl.SUCCESS:
        rc = e.transfer_sync(name, hixl.WRITE, [hixl.TransferOpDesc(buf.ctypes.data, addr, buf.size)], 20000)
        writes += rc == hixl.SUCCESS
        if writes == 1 and rc == hixl.SUCCESS:
            print(json.dumps({"writing": True}), flush=True)
    print(json.dumps({"rc": int(rc), "error": e.last_error(), "writes": writes}), flush=True)
    sys.stdin.read()
    e.finalize()


if __name__ == "__main__":
    main()
