"""A hixl.Hixl target process for the benchmarks: registers one buffer and serves until stdin closes.

Usage: python3 bench/hixl_target.py TRANSPORT BYTES [host|acl] -> prints {"name", "addr", "len"} as one
JSON line. "acl": the buffer comes from the hixl.acl shim (memfd-backed: same-host peers map it);
"host" (default): a numpy buffer (same-host peers reach it with cross-memory attach).
"""
import json
import sys

import numpy as np

import hixl


def main() -> None:
    transport, size = sys.argv[1], int(sys.argv[2])
    e = hixl.Hixl()
    if e.initialize("127.0.0.1:0", {"HixlTransport": transport}) != hixl.SUCCESS:
        sys.exit("initialize: " + e.last_error())
    kind = sys.argv[3] if len(sys.argv) > 3 else "host"
    if kind == "acl":
        from hixl import acl
        rc, addr = acl.aclrtMalloc(size, acl.ACL_MEM_MALLOC_NORMAL_ONLY)
        if rc != acl.ACL_SUCCESS:
            sys.exit("aclrtMalloc: %d" % rc)
        mem_type = hixl.MemType.MEM_DEVICE
    else:
        buf = np.zeros(size, np.uint8)
        addr, mem_type = buf.ctypes.data, hixl.MemType.MEM_HOST
    if e.register_mem(hixl.MemDesc(addr, size), mem_type)[0] != hixl.SUCCESS:
        sys.exit("register_mem: " + e.last_error())
    print(json.dumps({"name": e.local_engine, "addr": addr, "len": size}), flush=True)
    sys.stdin.read()
    e.finalize()


if __name__ == "__main__":
    main()
