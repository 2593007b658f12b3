"""A hixl.Hixl target in its own process, for tests that kill it mid-transfer.

Usage: python3 tests/engine_peer.py TRANSPORT SIZE
Prints one JSON line {"name", "addr", "len"} once its buffer is registered, then serves until it
is killed (or stdin closes).
"""
import json
import sys

import numpy as np

import hixl


def main() -> None:
    transport, size = sys.argv[1], int(sys.argv[2])
    e = hixl.Hixl()
    rc = e.initialize("127.0.0.1:0", {"HixlTransport": transport})
    if rc != hixl.SUCCESS:
        sys.exit("initialize: %s" % e.last_error())
    buf = np.zeros(size, np.uint8)
    rc, _ = e.register_mem(hixl.MemDesc(buf.ctypes.data, size), hixl.MemType.MEM_HOST)
    if rc != hixl.SUCCESS:
        sys.exit("register_mem: %s" % e.last_error())
    print(json.dumps({"name": e.local_engine, "addr": buf.ctypes.data, "len": size}), flush=True)
    sys.stdin.read()  # until the test closes stdin or kills us
    e.finalize()


if __name__ == "__main__":
    main()
