"""Put/get demo over one-sided RDMA: a target process exposes memory, an initiator writes into it,
flags completion with WRITE_WITH_IMM and reads it back. Both ends on this host (loopback on the
device, e.g. rxe0). Usage: ``python -m hixl.demo [--size BYTES] [--device rxe0]`` or ``hixl demo``.

(The KV-cache prefill/decode demo of a later release replaces this.)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time

import numpy as np

import hixl


def _target(args) -> int:
    ep = hixl.Endpoint(args.device)
    buf = np.zeros(args.size, np.uint8)
    ep.register(buf)
    port = ep.listen("127.0.0.1", 0)
    print(json.dumps({"port": port}), flush=True)
    ep.accept(30000)
    imm = ep.wait_imm(60000)  # the target's only work: wait for the "done" flag
    print(json.dumps({"imm": imm, "sha256": hashlib.sha256(buf.tobytes()).hexdigest()}), flush=True)
    sys.stdin.read()  # stay alive (memory stays registered) until the initiator is done reading
    ep.close()
    return 0


def _initiator(args) -> int:
    if not hixl.has_active_device():
        print("hixl demo: no RDMA device with an ACTIVE port on this host.\n"
              "  Run it inside the Soft-RoCE VM instead:  bash ci/demo.sh", file=sys.stderr)
        return 2
    tgt = subprocess.Popen([sys.executable, "-m", "hixl.demo", "--role", "target", "--size", str(args.size),
                            *(["--device", args.device] if args.device else [])],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(tgt.stdout.readline())["port"]
        ep = hixl.Endpoint(args.device)
        rng = np.random.default_rng(0)
        src = rng.integers(0, 256, args.size, dtype=np.uint8)
        back = np.zeros_like(src)
        ms, mback = ep.register(src), ep.register(back)
        peer = ep.connect_tcp("127.0.0.1", port, 30000)
        [region] = peer["regions"]
        info = ep.info()
        print(f"device {info['device']} gid[{info['gid_index']}] {info['gid']}  qpn {info['qpn']} -> {peer['qpn']}"
              f"  path mtu {min(info['mtu'], peer['mtu'])} B")
        chunk = 1 << 20
        descs = [(ms.addr + o, region["addr"] + o, min(chunk, args.size - o)) for o in range(0, args.size, chunk)]
        t0 = time.perf_counter()
        ep.wait_ok(ep.write_imm(descs, region["rkey"], imm=0x600D), 120000)  # put + completion flag
        t_put = time.perf_counter() - t0
        remote = json.loads(tgt.stdout.readline())
        t0 = time.perf_counter()
        ep.wait_ok(ep.read([(mback.addr, region["addr"], args.size)], region["rkey"]), 120000)  # get
        t_get = time.perf_counter() - t0
        ok = remote["sha256"] == hashlib.sha256(src.tobytes()).hexdigest() and np.array_equal(back, src)
        mib = args.size / (1 << 20)
        print(f"put {mib:.1f} MiB in {t_put * 1e3:.1f} ms ({mib / t_put:.1f} MiB/s), flag imm=0x{remote['imm']:x} seen by target")
        print(f"get {mib:.1f} MiB in {t_get * 1e3:.1f} ms ({mib / t_get:.1f} MiB/s)")
        print("verified: target bytes == source == read back" if ok else "MISMATCH between source and target bytes")
        st = ep.stats()
        print(f"work requests {st['posted_wrs']}, doorbells {st['doorbells']}, signaled {st['signaled']}")
        ep.close()
        return 0 if ok else 1
    finally:
        if tgt.poll() is None:
            tgt.stdin.close()
            tgt.wait(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hixl demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=16 << 20, help="bytes to put and get (default 16 MiB)")
    ap.add_argument("--device", default=None, help="RDMA device (default: $HIXL_DEVICE or the first active one)")
    ap.add_argument("--role", choices=["initiator", "target"], default="initiator", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.size <= 0:
        ap.error("--size must be > 0")
    return _target(args) if args.role == "target" else _initiator(args)


if __name__ == "__main__":
    sys.exit(main())
