"""The demo's worker processes: a prefill worker pushes each request's KV layer by layer, a decode worker
receives it in place and decodes; both speak JSON lines to the orchestrator."""
from __future__ import annotations

import base64
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from typing import Any, Dict, List
from .common import AUX, FAULT_ENV, load_model


class _Out:
    """JSON lines to the orchestrator on the original stdout (stray prints go to stderr)."""

    def __init__(self):
        self._f = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self._lock = threading.Lock()

    def __call__(self, event: str, **kw) -> None:
        kw["event"] = event
        line = json.dumps(kw, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()


def _fault(name: str, cmd: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec:
        who, what, code = spec.split(":")
        if who == name and what == cmd:
            print(f"[{name}] {FAULT_ENV}: exiting with code {code} at '{cmd}'", file=sys.stderr, flush=True)
            os._exit(int(code))


def _run_layers(model, cache, h, pos: int, lo: int, hi: int):
    """Layers ``lo..hi`` of one decode step for the token whose hidden state is ``h`` at ``pos``:
    exactly the loop body of :func:`hixl_tools.models.smollm2.decode_step` (same calls, same arrays), so a
    pipeline over layer shards gives the same bits as decode_step over all layers."""
    for i in range(lo, hi):
        L = model.layers[i]
        q, k, v = model._qkv(L, h, pos)
        cache.k[i][pos] = k[0]
        cache.v[i][pos] = v[0]
        cache._lens[i] = pos + 1
        h = model._finish(L, h, model._attend(q, cache.k[i][:pos + 1], cache.v[i][:pos + 1], pos))
    return h


class _Prefill:
    def __init__(self, args, engine, model, layout, out):
        from hixl.kv import KVSender
        self.args, self.engine, self.model, self.layout, self.out = args, engine, model, layout, out
        self.kv = KVSender(engine, layout, args.num_blocks, max_requests=args.max_requests,
                           timeout=args.timeout)

    def close(self):
        self.kv.close()

    def cmd_prefill(self, m):
        import numpy as np
        kv, rid, ids = self.kv, m["rid"], m["ids"]
        n, K, n_layers = len(ids), int(m["chunk_layers"]), self.layout.n_layers
        progress = bool(m.get("progress"))
        kv.allocate(rid, n)
        links = {}
        for g in m["grants"]:
            kv.add_target(rid, g)  # connects to the decoder if not linked yet (before t_start)
            links[g["decode"]] = self.engine.get_transport(g["decode"])[1]
        pending: List[int] = []
        pushes: List[List[int]] = []
        t_layers: List[float] = []

        def on_layer(layer, k, v):
            kv.store(rid, layer, k, v)
            t_layers.append(time.monotonic())
            pending.append(layer)
            if len(pending) >= K or layer == n_layers - 1:
                # no flag yet: complete() sends it with the first token once the logits are known,
                # so the last layers travel while the first token is computed
                kv.push(rid, pending, complete=False)
                pushes.append(list(pending))
                pending.clear()
            if progress:
                self.out("layer", rid=rid, layer=layer)

        t_start = time.monotonic()
        _, _, logits = self.model.prefill(ids, on_layer=on_layer)
        first = int(np.argmax(logits))
        t_compute_end = time.monotonic()
        kv.complete(rid, aux=AUX.pack(first, n))  # aux + completion flag to every decoder
        t_last_push = time.monotonic()
        kv.flush(rid, self.args.timeout)
        t_flushed = time.monotonic()
        st = kv.stats(rid)
        # layers per transfer, in submission order (push by push, target by target)
        per_transfer = [sum(1 for x in p if g["layers"][0] <= x < g["layers"][1])
                        for p in pushes for g in m["grants"]]
        per_transfer = [c for c in per_transfer if c]
        iv = sorted(st["intervals"])
        # the layer transfers come first in submission order; the flag transfers (aux only) follow
        xfer_layer_ms = ([(b - a) * 1e3 / c for (a, b), c in zip(iv, per_transfer)]
                         if len(iv) == len(per_transfer) + len(m["grants"]) else [])
        checksums = [kv.checksum(rid, tuple(g["layers"])) for g in m["grants"]]
        kv.release(rid)
        compute = [(b - a) * 1e3 for a, b in zip([t_start] + t_layers[:-1], t_layers)]
        self.out("prefilled", rid=rid, n_prompt=n, first_token=first, t_start=t_start, t_layers=t_layers,
                 t_compute_end=t_compute_end, t_last_push=t_last_push, t_flushed=t_flushed,
                 bytes=st["bytes"], transfers=st["transfers"], intervals=iv, flagged=st["flagged"],
                 layer_compute_ms=compute, layer_transfer_ms=xfer_layer_ms, checksums=checksums, links=links)


class _Decode:
    def __init__(self, args, engine, model, layout, out):
        from hixl.kv import KVReceiver
        self.args, self.engine, self.model, self.layout, self.out = args, engine, model, layout, out
        self.kv = KVReceiver(engine, layout, args.num_blocks, max_requests=args.max_requests)
        self.reqs: Dict[str, Dict[str, Any]] = {}
        self.warm = False

    def close(self):
        self.kv.close()

    def cmd_alloc(self, m):
        g = self.kv.allocate(m["rid"], m["n_tokens"], extra_tokens=m["extra_tokens"],
                             layers=tuple(m["layers"]) if m.get("layers") else None, prefill=m["prefill"])
        self.reqs[m["rid"]] = {"capacity": m["n_tokens"] + m["extra_tokens"]}
        self.out("grant", rid=m["rid"], grant=g.to_dict())

    def _arrived(self, pending, seen, mode, deadline):
        from hixl.kv import KVTimeout
        kv = self.kv
        if mode == "block":
            rid = pending[0]
            seen[rid] = kv.wait(rid, max(0.0, deadline - time.monotonic()), warm=self.warm)
            return [rid]
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVTimeout(f"KV of {pending} not complete within {self.args.timeout:g} s")
        if mode == "fd":
            select.select([kv.fileno()], [], [], min(left, 0.5))  # then poll (also after a quiet 0.5 s)
        done = [r for r in kv.poll() if r in pending]
        now = time.monotonic()
        for r in done:
            seen[r] = now
            if self.warm:
                kv.warm(r)
        if not done and mode == "poll":
            time.sleep(0.001)
        return done

    def cmd_recv(self, m):
        from ..models.smollm2 import DecodeCache
        kv, mode = self.kv, m["wait"]
        self.warm = bool(m.get("warm"))
        pending = list(m["rids"])
        deadline = time.monotonic() + float(m["timeout"])
        seen: Dict[str, float] = {}
        results = {}
        while pending:
            for rid in self._arrived(pending, seen, mode, deadline):
                pending.remove(rid)
                t_ready = time.monotonic()
                g = kv.grant(rid)
                lo, hi = g.layers
                cache = DecodeCache(self.model.config, self.reqs[rid]["capacity"])
                for layer in range(lo, hi):
                    k, v = kv.kv(rid, layer)
                    cache.load_layer(layer, k, v)
                t_loaded = time.monotonic()
                first, n_prompt = AUX.unpack(kv.aux(rid)[:AUX.size])
                if n_prompt != g.n_tokens:
                    raise RuntimeError(f"{rid}: aux says {n_prompt} prompt tokens, the grant {g.n_tokens}")
                self.reqs[rid].update(cache=cache, layers=(lo, hi), first=first, n_prompt=n_prompt)
                results[rid] = {"t_kv": seen[rid], "t_ready": t_ready, "kv_load_ms": (t_loaded - t_ready) * 1e3,
                                "first_token": first, "layers": [lo, hi], "checksum": kv.warm(rid)}
                self.out("kv_ready", rid=rid)
        self.out("received", results=results)

    def cmd_generate(self, m):
        import numpy as np

        from ..models.smollm2 import decode_step
        rid, max_new = m["rid"], int(m["max_new_tokens"])
        r = self.reqs[rid]
        cache, model = r["cache"], self.model
        progress = bool(m.get("progress"))
        # greedy_decode's loop, with a progress event per token (same decode_step calls)
        out: List[int] = []
        tok = int(r["first"])
        t0 = time.monotonic()
        while True:
            out.append(tok)
            if progress:
                self.out("token", rid=rid, n=len(out))
            if len(out) >= max_new or tok == model.config.eos_id:
                break
            tok = int(np.argmax(decode_step(model, cache, tok, cache.length)))
        t1 = time.monotonic()
        self.out("generated", rid=rid, tokens=out, decode_ms=(t1 - t0) * 1e3,
                 tpot_ms=(t1 - t0) * 1e3 / (len(out) - 1) if len(out) > 1 else None)

    def cmd_stage(self, m):
        import numpy as np
        r = self.reqs[m["rid"]]
        lo, hi = r["layers"]
        model, pos = self.model, int(m["pos"])
        if "token" in m:
            h = model.embed([int(m["token"])])
        else:
            h = np.frombuffer(base64.b64decode(m["h"]), dtype=m["dtype"]).reshape(m["shape"])
        h = _run_layers(model, r["cache"], h, pos, lo, hi)
        if hi == model.config.n_layers:
            self.out("stage", rid=m["rid"], token=int(np.argmax(model.logits(h)[0])))
        else:
            self.out("stage", rid=m["rid"], h=base64.b64encode(h.tobytes()).decode(), dtype=str(h.dtype),
                     shape=list(h.shape))

    def cmd_free(self, m):
        self.kv.free(m["rid"])
        self.reqs.pop(m["rid"], None)
        self.out("freed", rid=m["rid"])


def run_worker(args) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the orchestrator's: it stops the workers
    out = _Out()
    name = args.name
    role_obj = None
    engine = None
    cmd = "start"
    try:
        _fault(name, "start")
        import hixl
        from hixl.kv import KVLayout
        t0 = time.monotonic()
        engine = hixl.Hixl()
        rc = engine.initialize("127.0.0.1:0", {"HixlTransport": args.transport})
        if rc != hixl.SUCCESS:
            raise RuntimeError(f"Hixl.initialize(127.0.0.1:0, HixlTransport={args.transport}) failed "
                               f"(status {rc}): {engine.last_error()}")
        model = load_model()
        layout = KVLayout.for_model(model.config, "float32", args.block_tokens)
        role_obj = (_Prefill if args.role == "prefill" else _Decode)(args, engine, model, layout, out)
        out("ready", name=name, pid=os.getpid(), engine=engine.local_engine, startup_s=time.monotonic() - t0)
        for line in sys.stdin:
            m = json.loads(line)
            cmd = m["cmd"]
            _fault(name, cmd)
            if cmd == "exit":
                break
            getattr(role_obj, "cmd_" + cmd)(m)
            cmd = "idle"
        return 0
    except BaseException as e:  # report, then exit non-zero: the orchestrator aborts the run
        traceback.print_exc(file=sys.stderr)
        try:
            out("error", name=name, cmd=cmd, error=f"{type(e).__name__}: {e}")
        except Exception:
            pass
        return 1
    finally:
        try:
            if role_obj is not None:
                role_obj.close()
            if engine is not None:
                engine.finalize()
        except Exception:
            traceback.print_exc(file=sys.stderr)


