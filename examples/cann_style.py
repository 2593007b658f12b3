#!/usr/bin/env python3
"""CANN-style hixl usage end to end: a "decode" engine and a "prefill" engine in two processes.

The code between the ``# --- CANN`` markers is written exactly as for CANN's hixl module on
Ascend; only the import line differs (``import hixl`` here, as there). Run it on a machine with
an RDMA device (or inside the CI's rxe VM):

    python3 examples/cann_style.py            # starts the decode peer itself, then runs prefill
    python3 examples/cann_style.py --role decode --listen 127.0.0.1:0   # one side only

Prefill WRITEs a "KV block" into decode's registered buffer and tells decode with a notify;
decode checks the bytes and answers with a notify of its own; prefill READs a reply region of
decode's buffer back. Exit status 0 and "example OK" on success.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import subprocess
import sys
import time

import hixl
from hixl import (READ, SUCCESS, WRITE, GetTransferStatusArgs, MemDesc, MemType, NotifyDesc, TransferArgs,
                  TransferOpDesc, TransferStatus)

BLOCK = 1 << 20  # one "KV block": 1 MiB


def check(rc, what, engine):
    if rc != SUCCESS:
        sys.exit("%s failed: %s (%s)" % (what, hixl.status_name(rc), engine.last_error()))


def decode(listen: str) -> None:
    kv = (ctypes.c_uint8 * (2 * BLOCK))()  # [0, BLOCK): prefill writes here; [BLOCK, 2*BLOCK): reply
    kv_addr = ctypes.addressof(kv)
    ctypes.memset(kv_addr + BLOCK, 0x42, BLOCK)
    # --- CANN
    engine = hixl.Hixl()
    check(engine.initialize(local_engine=listen, options={hixl.OPTION_RDMA_TRAFFIC_CLASS: "0"}), "initialize",
          engine)
    ret, handle = engine.register_mem(mem_desc=MemDesc(addr=kv_addr, len=2 * BLOCK), mem_type=MemType.MEM_HOST)
    check(ret, "register_mem", engine)
    # --- CANN
    print("decode listening on %s kv_addr=%d" % (engine.local_engine, kv_addr), flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ret, notifies = engine.get_notifies()
        check(ret, "get_notifies", engine)
        for n in notifies:
            if n.name == "kv_ready":
                got = hashlib.sha256(bytes(kv[:BLOCK])).hexdigest()
                ok = got == n.notify_msg
                print("decode: kv_ready, sha256 %s" % ("matches" if ok else "MISMATCH"), flush=True)
                peer = sys.stdin.readline().strip()  # prefill's engine name
                check(engine.send_notify(remote_engine=peer, notify=NotifyDesc(name="verdict",
                                         notify_msg="ok" if ok else "bad"), timeout_in_millis=5000), "send_notify", engine)
                sys.stdin.readline()  # prefill says it is done
                engine.deregister_mem(mem_handle=handle)
                engine.finalize()
                sys.exit(0 if ok else 1)
        time.sleep(0.01)
    sys.exit("decode: no kv_ready notify within 120 s")


def prefill(remote: str, kv_addr: int, decode_proc: subprocess.Popen) -> None:
    src = (ctypes.c_uint8 * (2 * BLOCK))()
    src_addr = ctypes.addressof(src)
    for i in range(BLOCK):
        src[i] = (i * 7 + 3) & 0xFF
    digest = hashlib.sha256(bytes(src[:BLOCK])).hexdigest()
    # --- CANN
    engine = hixl.Hixl()
    check(engine.initialize("127.0.0.1"), "initialize", engine)  # client only: no port
    ret, handle = engine.register_mem(MemDesc(addr=src_addr, len=2 * BLOCK), MemType.MEM_HOST)
    check(ret, "register_mem", engine)
    check(engine.connect(remote_engine=remote, timeout_in_millis=10000), "connect", engine)
    # The block in two halves, synchronously.
    half = BLOCK // 2
    descs = [TransferOpDesc(local_addr=src_addr, remote_addr=kv_addr, len=half),
             TransferOpDesc(local_addr=src_addr + half, remote_addr=kv_addr + half, len=half)]
    check(engine.transfer_sync(remote_engine=remote, op=WRITE, op_descs=descs, timeout_in_millis=30000),
          "transfer_sync", engine)
    check(engine.send_notify(remote, NotifyDesc(name="kv_ready", notify_msg=digest), 5000), "send_notify", engine)
    # Asynchronously READ decode's reply region into the second half of our buffer.
    ret, req = engine.transfer_async(remote_engine=remote, op=READ,
                                     op_descs=[TransferOpDesc(src_addr + BLOCK, kv_addr + BLOCK, BLOCK)],
                                     args=TransferArgs(user_data=7))
    check(ret, "transfer_async", engine)
    while True:
        ret, status = engine.get_transfer_status(req=req)
        check(ret, "get_transfer_status", engine)
        if status != TransferStatus.WAITING:
            break
        time.sleep(0.001)
    assert status == TransferStatus.COMPLETED, status
    ret, results = engine.get_all_transfer_status(args=GetTransferStatusArgs(5, True))
    check(ret, "get_all_transfer_status", engine)
    # --- CANN
    assert bytes(src[BLOCK:]) == b"\x42" * BLOCK, "READ brought back the wrong bytes"
    print("prefill: read back %d bytes, transport %s" % (BLOCK, engine.get_transport(remote)[1]), flush=True)
    decode_proc.stdin.write(engine.local_engine + "\n")
    decode_proc.stdin.flush()
    verdict = None
    deadline = time.monotonic() + 60
    while verdict is None and time.monotonic() < deadline:
        ret, notifies = engine.get_notifies()
        verdict = next((n.notify_msg for n in notifies if n.name == "verdict"), None)
        time.sleep(0.01)
    decode_proc.stdin.write("done\n")
    decode_proc.stdin.flush()
    check(engine.disconnect(remote, 1000), "disconnect", engine)
    engine.deregister_mem(handle)
    engine.finalize()
    if verdict != "ok":
        sys.exit("prefill: decode's verdict was %r" % (verdict,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["both", "decode"], default="both")
    ap.add_argument("--listen", default="127.0.0.1:0", help="decode engine address (port 0 = any free port)")
    args = ap.parse_args()
    if args.role == "decode":
        decode(args.listen)
        return
    proc = subprocess.Popen([sys.executable, __file__, "--role", "decode", "--listen", args.listen],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("decode listening on "):
            sys.exit("decode did not start: %r" % line)
        fields = line.split()
        remote, kv_addr = fields[3], int(fields[4].split("=")[1])
        prefill(remote, kv_addr, proc)
        rest = proc.stdout.read()
        sys.stdout.write(rest)
        rc = proc.wait(timeout=60)
        if rc != 0:
            sys.exit("decode exited with %d" % rc)
    finally:
        if proc.poll() is None:
            proc.kill()
    print("example OK")


if __name__ == "__main__":
    main()
