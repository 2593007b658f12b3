"""One side of a connect storm: an engine that connects to its peer from several threads at once
(while the peer does the same to it), then sends notifies and flagged writes from each thread.

Usage: python3 tests/connect_storm_peer.py TRANSPORT PORT PEER_PORT THREADS ROUNDS DIR

Both sides listen on 127.0.0.1; each writes its buffer's address to DIR/PORT and reads the peer's
from DIR/PEER_PORT. Thread i writes 4 KiB at offset i * 4096 of the peer's buffer, the byte value
ROUNDS * i + round, with flag 1000 * i + round. Prints one JSON line: the errors (call, status,
reason), the notifies and flags received, and the slowest connect and round in seconds.
"""
import json
import os
import sys
import threading
import time

import numpy as np

import hixl
from hixl import SUCCESS, WRITE, MemDesc, NotifyDesc, TransferOpDesc


def main() -> None:
    transport, port, peer_port, n, rounds, d = sys.argv[1], *map(int, sys.argv[2:6]), sys.argv[6]
    e = hixl.Hixl()
    assert e.initialize("127.0.0.1:%d" % port, {"HixlTransport": transport}) == SUCCESS, e.last_error()
    mem = np.zeros(2 * n * 4096, np.uint8)  # the peer writes into the first half; we write from the second
    assert e.register_mem(MemDesc(mem.ctypes.data, mem.nbytes))[0] == SUCCESS, e.last_error()
    buf, src = mem[:n * 4096], mem[n * 4096:]
    with open(os.path.join(d, "%d.tmp" % port), "w") as f:
        f.write(str(buf.ctypes.data))
    os.rename(os.path.join(d, "%d.tmp" % port), os.path.join(d, str(port)))
    theirs = os.path.join(d, str(peer_port))
    deadline = time.monotonic() + 120
    while not os.path.exists(theirs):
        assert time.monotonic() < deadline, "the peer never started"
        time.sleep(0.01)
    with open(theirs) as f:
        peer, paddr = "127.0.0.1:%d" % peer_port, int(f.read())
    errors, slow = [], {"connect": 0.0, "round": 0.0}
    go = threading.Barrier(n)

    def work(i: int) -> None:
        go.wait()
        t0 = time.monotonic()
        rc = e.connect(peer, 60000)
        if rc not in (SUCCESS, hixl.ALREADY_CONNECTED):
            errors.append(("connect", int(rc), e.last_error()))
        slow["connect"] = max(slow["connect"], time.monotonic() - t0)
        for r in range(rounds):
            t0 = time.monotonic()
            rc = e.send_notify(peer, NotifyDesc("t%d" % i, str(r)), 60000)
            if rc != SUCCESS:
                errors.append(("send_notify", int(rc), e.last_error()))
            src[i * 4096:(i + 1) * 4096] = rounds * i + r
            w = [TransferOpDesc(src.ctypes.data + i * 4096, paddr + i * 4096, 4096)]
            rc = e.transfer_sync(peer, WRITE, w, 60000, flag=1000 * i + r)
            if rc != SUCCESS:
                errors.append(("transfer_sync", int(rc), e.last_error()))
            slow["round"] = max(slow["round"], time.monotonic() - t0)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    notes, flags = [], []
    deadline = time.monotonic() + 60
    while (len(notes) < n * rounds or len(flags) < n * rounds) and time.monotonic() < deadline:
        notes += e.wait_notifies(200)[1]
        flags += e.poll_flags(n * rounds)[1]
    got = {"flags": sorted(int(v) for _, v in flags), "notifies": sorted((x.name, x.notify_msg) for x in notes),
           "last_bytes": [int(buf[i * 4096]) for i in range(n)], "errors": errors[:10], "n_errors": len(errors),
           "linked": e.get_transport(peer)[0] == SUCCESS, "slowest": slow}
    print(json.dumps(got), flush=True)
    sys.stdin.read()  # until the test is done with both sides: the peer may still be writing to us
    e.finalize()


if __name__ == "__main__":
    main()
