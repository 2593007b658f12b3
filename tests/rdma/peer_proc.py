"""Helper process for test_transfer_to_exited_peer_fails_clearly: a hixl endpoint that exits on EOF."""
import json
import sys

import numpy as np

import hixl

ep = hixl.Endpoint()
buf = np.zeros(1 << 20, np.uint8)
ep.register(buf)
print(json.dumps(ep.info()), flush=True)
ep.connect(json.loads(sys.stdin.readline()))
print("connected", flush=True)
sys.stdin.read()  # wait for EOF, then exit (the kernel destroys our QP)
