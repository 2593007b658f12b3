#!/usr/bin/python3
"""An independent RC peer built only from pyverbs (rdma-core's own Python verbs).

Run with Debian's /usr/bin/python3 (python3-pyverbs). Speaks JSON lines on stdin/stdout:
  start    -> prints {"qpn","psn","lid","gid","mtu","port","addr","rkey","size"}
  <info>   -> one line with the hixl endpoint's plain info; answers {"ok": true} once RTS
  {"cmd": "read", "offset": o, "length": n}       -> {"hex": bytes of its MR}
  {"cmd": "fill", "offset": o, "hex": h}          -> {"ok": true}   (local memcpy into its MR)
  {"cmd": "poll_imm", "timeout_ms": t}            -> {"imm": v|null, "opcode": op, "status": s}
  {"cmd": "exit"}
It never imports hixl: everything it does goes through libibverbs via pyverbs.
"""
import argparse
import ipaddress
import json
import random
import socket
import sys
import time

import pyverbs.enums as e
from pyverbs.addr import AHAttr, GID, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR

RECVS = 32


def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="rxe0")
    ap.add_argument("--gid-index", type=int, default=1)
    ap.add_argument("--size", type=int, default=1 << 20)
    args = ap.parse_args()

    ctx = Context(name=args.device)
    pd = PD(ctx)
    access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
    mr = MR(pd, args.size, access)
    cq = CQ(ctx, 2 * RECVS)
    cap = QPCap(max_send_wr=16, max_recv_wr=RECVS, max_send_sge=1, max_recv_sge=1)
    qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap))
    port = ctx.query_port(1)
    gid = ctx.query_gid(1, args.gid_index)
    psn = random.randrange(1 << 24)

    init = QPAttr()
    init.qp_access_flags = access
    init.port_num = 1
    init.pkey_index = 0
    qp.to_init(init)
    # pyverbs insists on one SGE per receive; WRITE_WITH_IMM consumes the receive, not its buffer.
    recv_mr = MR(pd, 64, e.IBV_ACCESS_LOCAL_WRITE)

    def post_recv(wr_id):
        qp.post_recv(RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(recv_mr.buf, 64, recv_mr.lkey)]))

    for i in range(RECVS):
        post_recv(i)

    say({"qpn": qp.qp_num, "psn": psn, "lid": port.lid, "gid": str(gid),
         "mtu": 128 << int(port.active_mtu), "port": 1, "addr": mr.buf, "rkey": mr.rkey, "size": args.size})

    peer = json.loads(sys.stdin.readline())
    attr = QPAttr()
    attr.path_mtu = min(int(port.active_mtu), {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}[peer["mtu"]])
    attr.dest_qp_num = peer["qpn"]
    attr.rq_psn = peer["psn"]
    attr.max_dest_rd_atomic = 1
    attr.min_rnr_timer = 12
    dgid = GID(ipaddress.IPv6Address(peer["gid"]).exploded)  # pyverbs wants all 8 groups spelled out
    gr = GlobalRoute(dgid=dgid, sgid_index=args.gid_index)
    attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=1, dlid=peer.get("lid", 0))
    attr.timeout = 14
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    attr.sq_psn = psn
    attr.max_rd_atomic = 1
    qp.to_rtr(attr)
    qp.to_rts(attr)
    say({"ok": True})

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "read":
            say({"hex": mr.read(cmd["length"], cmd["offset"]).hex()})
        elif cmd["cmd"] == "fill":
            data = bytes.fromhex(cmd["hex"])
            mr.write(data, len(data), cmd["offset"])
            say({"ok": True})
        elif cmd["cmd"] == "poll_imm":
            deadline = time.monotonic() + cmd["timeout_ms"] / 1000
            out = {"imm": None}
            while time.monotonic() < deadline:
                n, wcs = cq.poll(1)
                if n:
                    wc = wcs[0]
                    out = {"imm": socket.ntohl(wc.imm_data), "opcode": int(wc.opcode), "status": int(wc.status),
                           "with_imm": int(wc.opcode) == int(e.IBV_WC_RECV_RDMA_WITH_IMM)}
                    post_recv(wc.wr_id)
                    break
                time.sleep(0.0005)
            say(out)
        elif cmd["cmd"] == "exit":
            break
    say({"bye": True})


if __name__ == "__main__":
    main()
