"""Guest A of the two-host tier (ci/two-vm): the target host.

One engine per transport (rdma, tcp) on A's address and a fixed port, each with a registered
64 MiB buffer; their names, addresses and lengths go to $TV_ST/peer.json, with the address and key of
the object server (tests/twohost/remote.py) through which B's run of the two-engine suite makes its
engines `a` and their buffers here. Serves until guest B is done
($TV_ST/B.rc) or $TV_ST/stop, writing its engines' metrics to $TV_ST/peer-metrics.json meanwhile (B's
tests read how A saw its links close).

    TV_ST=... TV_MYIP=192.168.88.1 python3 -m tests.twohost.peer
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

import hixl
from tests.twohost import remote

PORTS = {"rdma": 18500, "tcp": 18501}
REMOTE_PORT = 18502
SIZE = 64 << 20
# A dead link is declared after 2 s of silence (the faults below stay shorter, or longer on purpose).
HEARTBEAT = {"HixlHeartbeatMs": "200", "HixlHeartbeatMisses": "10"}


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def main() -> int:
    st, ip = os.environ["TV_ST"], os.environ["TV_MYIP"]
    engines, bufs, info = {}, [], {}
    for t, port in PORTS.items():
        e = hixl.Hixl()
        # rdma: up to 8 queue pairs per link, for B's striped sides (a link gets the smaller count of its ends)
        qps = {"HixlRdmaQpsPerLink": "8"} if t == "rdma" else {}
        if e.initialize("%s:%d" % (ip, port), {"HixlTransport": t, **HEARTBEAT, **qps}) != hixl.SUCCESS:
            print("peer: initialize %s: %s" % (t, e.last_error()), file=sys.stderr)
            return 1
        buf = np.zeros(SIZE, np.uint8)
        if e.register_mem(hixl.MemDesc(buf.ctypes.data, SIZE))[0] != hixl.SUCCESS:
            print("peer: register_mem %s: %s" % (t, e.last_error()), file=sys.stderr)
            return 1
        engines[t] = e
        bufs.append(buf)
        info[t] = {"engine": e.local_engine, "addr": buf.ctypes.data, "len": SIZE}
    key = os.urandom(16)
    server = remote.Server((ip, REMOTE_PORT), key, ip).start()
    info["remote"] = {"host": ip, "port": REMOTE_PORT, "key": key.hex()}
    _write_json(os.path.join(st, "peer.json"), info)
    print("peer: serving %s" % info, flush=True)
    while not any(os.path.exists(os.path.join(st, f)) for f in ("B.rc", "B.dead", "stop")):
        _write_json(os.path.join(st, "peer-metrics.json"), {t: e.metrics() for t, e in engines.items()})
        time.sleep(0.2)
    server.close()
    for e in engines.values():
        e.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
