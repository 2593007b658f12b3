"""Disaggregated prefill/decode (PD) with a real model: SmolLM2-135M-Instruct, all on this host.

``hixl demo`` (or ``python -m hixl.demo``) starts prefill and decode *worker processes*. Each has its
own :class:`hixl.Hixl` engine (listening on 127.0.0.1, transport ``--transport``) and its own copy
of the model (the weights are a shared mmap cache). This process, the orchestrator, routes a request
the way a PD router would:

1. tokenize the chat prompt;
2. ask every decoder for a slot (:meth:`hixl.kv.KVReceiver.allocate`): a *grant* naming its blocks;
3. hand the grants to the prefill worker, which runs the model layer by layer and, right after each
   ``--chunk-layers`` layers, pushes their K/V into the decoders' blocks (:meth:`hixl.kv.KVSender.push`,
   non-blocking: the transfer overlaps the compute of the next layers). The first token (argmax of
   the last logits) travels in the aux bytes of the final push, which carries the completion flag;
4. each decoder waits for the flag (``--wait``), loads the K/V into its decode cache and generates
   greedily.

The same prompt also runs monolithically in this process (prefill + greedy decode of the same
functions, :meth:`SmolLM2.generate`'s steps): the disaggregated tokens must be IDENTICAL (exit 1
if not). Metrics (``time.monotonic()`` is CLOCK_MONOTONIC, comparable across processes on a host):

* TTFT disagg = flag seen by the decoder - prefill start; TTFT mono = prefill + argmax in one process;
* transfer busy = union of the transfers' [submitted, completed] intervals; exposed = the part of it
  after the prefill compute ended; overlap = 1 - exposed / busy;
* TPOT = decode time per generated token after the first (the first comes from the prefill).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import queue
import select
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

MiB = 1 << 20
AUX = struct.Struct("<iI")  # first token, prompt tokens: the aux bytes of the final push
DEFAULT_PROMPT = "What is the capital of France?"
DEFAULT_PROMPT2 = "Name the three primary colors."
FILLER = ("Hixl moves the key/value cache of a transformer from the prefill stage to the decode "
          "stage while the next layers are still being computed. ")
SETTLE_S = 0.3  # pause before a timed phase (see run_round)
EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 3
WAIT_MODES = ("block", "poll", "fd")
BLAS_ENV = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
FAULT_ENV = "HIXL_DEMO_FAULT"  # tests only: "<worker>:<cmd>:<exit code>" makes that worker exit there

EPILOG = """\
topologies:
  default            1 prefill + 1 decoder (1P+1D).
  --decoders N       1P+ND replicated: every decoder receives all layers and generates on its own;
                     all N token sequences must equal the monolithic one.
  --decoders N --shard
                     1P+ND layer-sharded: decoder i receives only a contiguous layer range (and the
                     aux bytes). Each shard is verified byte for byte (SHA-256 against the prefill's
                     KVSender.checksum of the same layers). No decoder holds the whole cache, so the
                     tokens are generated *pipeline-parallel* across the shards: per token, decoder 0
                     embeds it and runs its layers, its hidden state (d_model float32, exact bytes)
                     is relayed through the orchestrator to decoder 1, and so on; the last decoder
                     computes the logits. Nothing is copied between decoders besides that hidden
                     state, and the result must still equal the monolithic tokens. (The relay over
                     the orchestrator's pipes is included in the shard TPOT.)
  --prefills 2       two prefill processes with two different prompts push concurrently into ONE
                     decoder (slot isolation): the decoder's two grants must name disjoint blocks and
                     each output must equal its own monolithic reference.

The workers' stderr passes through. When several workers of a role compute at once (--prefills 2,
replicated --decoders N), each gets cpus/N BLAS threads (unless OPENBLAS_NUM_THREADS/OMP_NUM_THREADS
is set), so that they do not oversubscribe the CPUs. Timings are taken on whatever else this host runs.

exit status: 0 all tokens identical, 1 a token sequence (or a KV checksum) differs, 2 usage error,
3 a worker failed, died or timed out (the orchestrator names it and its exit code, stops the others).
"""


# ============================================================================ shared helpers
def load_model(warm: bool = True):
    """SmolLM2 from the shared weight cache; ``warm`` runs a tiny prefill once so that the first
    timed prefill of this process does not pay for faulting the weights in."""
    from .models.smollm2 import SmolLM2
    model = SmolLM2.load()
    if warm:
        model.prefill(model.tokenizer.encode("Warm up, please."))
    return model


def build_prompt_ids(tok, question: str, n_tokens: Optional[int] = None) -> List[int]:
    """Token ids of the chat prompt for ``question``; with ``n_tokens``, the user message is padded
    in front of the question with (trimmed) filler text so that the whole prompt has exactly
    ``n_tokens`` tokens (ids are built piecewise: system/header, filler, question, footer)."""
    if n_tokens is None:
        return tok.encode(tok.chat_prompt(question))
    head, tail = tok.chat_prompt("\x00").split("\x00")
    pre, q, post = tok.encode(head), tok.encode(question), tok.encode(tail)
    need = n_tokens - len(pre) - len(q) - len(post) - 1
    if need < 0:
        raise ValueError(f"--prompt-tokens {n_tokens} is too small for this question: at least "
                         f"{len(pre) + len(q) + len(post) + 1} tokens")
    filler: List[int] = []
    while len(filler) < need:
        filler += tok.encode(FILLER)
    sep = tok.encode("\n")
    ids = pre + filler[:need] + sep + q + post
    assert len(ids) == n_tokens, (len(ids), n_tokens)
    return ids


def layer_ranges(n_layers: int, parts: int) -> List[Tuple[int, int]]:
    """``parts`` contiguous, near-equal layer ranges covering [0, n_layers)."""
    base, extra = divmod(n_layers, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def transfer_metrics(t_start: float, t_compute_end: float, intervals) -> Dict[str, float]:
    from .kv import union_seconds
    busy = union_seconds(intervals)
    exposed = union_seconds(intervals, after=t_compute_end)
    return {"busy_ms": busy * 1e3, "exposed_ms": exposed * 1e3,
            "overlap": (1.0 - exposed / busy) if busy > 0 else 0.0}


def worker_threads(prefills: int, decoders: int, shard: bool) -> Dict[str, int]:
    """BLAS threads per worker role when several workers of a role compute at the same time (two
    prefills; replicated decoders), so that they share the CPUs instead of oversubscribing them
    (an explicit OPENBLAS_NUM_THREADS/OMP_NUM_THREADS in the environment wins)."""
    cpus = os.cpu_count() or 1
    out = {}
    if prefills > 1:
        out["prefill"] = max(1, cpus // prefills)
    if decoders > 1 and not shard:
        out["decode"] = max(1, cpus // decoders)
    return out


def mono_reference(model, ids: Sequence[int], max_new_tokens: int) -> Dict[str, Any]:
    """The monolithic run, step for step what :meth:`SmolLM2.generate` does (prefill -> DecodeCache
    -> greedy_decode), timed: TTFT = prefill + argmax, TPOT = decode per token after the first."""
    import numpy as np

    from .models.smollm2 import DecodeCache, greedy_decode
    t0 = time.monotonic()
    ks, vs, logits = model.prefill(list(ids))
    first = int(np.argmax(logits))
    t1 = time.monotonic()
    cache = DecodeCache(model.config, len(ids) + max_new_tokens)
    for i in range(model.config.n_layers):
        cache.load_layer(i, ks[i], vs[i])
    t2 = time.monotonic()
    tokens = greedy_decode(model, cache, first, max_new_tokens, True)
    t3 = time.monotonic()
    return {"tokens": tokens, "ttft_ms": (t1 - t0) * 1e3,
            "tpot_ms": (t3 - t2) * 1e3 / (len(tokens) - 1) if len(tokens) > 1 else None}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ============================================================================ workers
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
    exactly the loop body of :func:`hixl.models.smollm2.decode_step` (same calls, same arrays), so a
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
        from .kv import KVSender
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
        from .kv import KVReceiver
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
        from .kv import KVTimeout
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
        from .models.smollm2 import DecodeCache
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

        from .models.smollm2 import decode_step
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


def _worker(args) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the orchestrator's: it stops the workers
    out = _Out()
    name = args.name
    role_obj = None
    engine = None
    cmd = "start"
    try:
        _fault(name, "start")
        import hixl
        from .kv import KVLayout
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


# ============================================================================ orchestrator
class DemoError(RuntimeError):
    """A worker failed, died or timed out (the message says which)."""


class Worker:
    def __init__(self, name: str, role: str, argv: List[str], inbox: "queue.Queue", env=None):
        self.name, self.role = name, role
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env=env)
        self.info: Dict[str, Any] = {}
        self.pending: List[Dict[str, Any]] = []
        self.exiting = False
        self._reader = threading.Thread(target=self._read, args=(inbox,), name=f"demo-{name}", daemon=True)
        self._reader.start()

    def _read(self, inbox):
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                msg = {"event": "error", "error": f"not a protocol line: {line.strip()[:200]!r}"}
            inbox.put((self.name, msg))
        inbox.put((self.name, None))

    def send(self, **msg) -> None:
        try:
            self.proc.stdin.write(json.dumps(msg, separators=(",", ":")) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: the reader reports the EOF with its exit code


class Cluster:
    """Worker processes (``prefill0..``, ``decode0..``) and the JSON-lines plumbing to them: every
    wait has a deadline, and a worker that reports an error or exits is reported by name (with
    its exit code) while waiting for *any* worker, so nothing hangs."""

    def __init__(self, *, prefills: int, decoders: int, transport: str, timeout: float,
                 prefill_blocks: int, decode_blocks: int, decode_requests: int, block_tokens: int = 16,
                 threads: Optional[Dict[str, int]] = None,
                 on_progress: Optional[Callable[[str, Dict[str, Any]], None]] = None):
        self.timeout = timeout
        self.threads = threads or {}
        self.on_progress = on_progress
        self._inbox: "queue.Queue" = queue.Queue()
        self.workers: Dict[str, Worker] = {}
        common = ["--transport", transport, "--timeout", str(timeout), "--block-tokens", str(block_tokens)]
        try:
            for i in range(decoders):
                self._spawn(f"decode{i}", "decode", common + ["--num-blocks", str(decode_blocks),
                                                              "--max-requests", str(decode_requests)])
            for i in range(prefills):
                self._spawn(f"prefill{i}", "prefill", common + ["--num-blocks", str(prefill_blocks),
                                                                "--max-requests", "1"])
            for w in self.workers.values():
                w.info = self.expect(w.name, "ready", timeout=max(timeout, 60.0))
        except BaseException:
            self.kill()
            raise
        self.prefills = [self.workers[f"prefill{i}"] for i in range(prefills)]
        self.decoders = [self.workers[f"decode{i}"] for i in range(decoders)]

    def _spawn(self, name, role, extra):
        argv = [sys.executable, "-m", "hixl.demo", "--role", role, "--name", name] + extra
        env = dict(os.environ)
        if self.threads.get(role):
            for k in BLAS_ENV:
                env.setdefault(k, str(self.threads[role]))
        self.workers[name] = Worker(name, role, argv, self._inbox, env)

    def _died(self, w: Worker) -> DemoError:
        try:
            code = w.proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}" if code is not None else "closed its output but is still running"
        return DemoError(f"worker {w.name} (pid {w.proc.pid}) {how}")

    def _first_dead(self, name: str, grace_s: float = 1.0) -> Optional["Worker"]:
        """Another worker that died unasked, waiting up to grace_s for one: when a peer's death made
        ``name`` fail, the peer's sockets close while it exits, so ``name`` may report first."""
        others = [o for o in self.workers.values() if o.name != name and not o.exiting]
        end = time.monotonic() + grace_s
        while True:
            dead = [o for o in others if o.proc.poll() not in (None, 0)]
            if dead or time.monotonic() >= end:
                return dead[0] if dead else None
            time.sleep(0.02)

    def _pump(self, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DemoError(f"timed out after {self.timeout:g} s waiting for {what}")
        try:
            name, msg = self._inbox.get(timeout=left)
        except queue.Empty:
            raise DemoError(f"timed out after {self.timeout:g} s waiting for {what}") from None
        w = self.workers[name]
        if msg is None:
            if not w.exiting:
                raise self._died(w)
            return
        if msg.get("event") == "error":
            try:
                code = w.proc.wait(10)
            except subprocess.TimeoutExpired:
                code = None
            failed = (f"worker {name} (pid {w.proc.pid}) failed during '{msg.get('cmd', '?')}': "
                      f"{msg.get('error')} (exit code {code})")
            cause = self._first_dead(name)
            if cause is not None:  # name the worker that died first: its death is why this one failed
                raise DemoError(f"{self._died(cause)}; then {failed}")
            raise DemoError(failed)
        if msg.get("event") in ("layer", "token", "kv_ready"):
            if self.on_progress:
                self.on_progress(name, msg)
            return
        w.pending.append(msg)

    def expect(self, name: str, event: str, timeout: Optional[float] = None) -> Dict[str, Any]:
        """The next message of worker ``name``, which must be ``event``."""
        w = self.workers[name]
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not w.pending:
            self._pump(deadline, f"'{event}' from {name}")
        msg = w.pending.pop(0)
        if msg.get("event") != event:
            raise DemoError(f"worker {name}: expected '{event}', got {msg!r:.200}")
        return msg

    def close(self) -> None:
        for w in self.workers.values():
            w.exiting = True
            w.send(cmd="exit")
            try:
                w.proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 15
        for w in self.workers.values():
            try:
                w.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()

    def kill(self) -> None:
        for w in self.workers.values():
            w.exiting = True
            if w.proc.poll() is None:
                w.proc.terminate()
        for w in self.workers.values():
            try:
                w.proc.wait(3)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, et, ev, tb) -> None:
        if et is None:
            self.close()
        else:
            self.kill()


def run_round(cl: Cluster, model, layout, prompts: List[List[int]], *, max_new_tokens: int, shard: bool,
              chunk_layers: int, wait: str, warm: bool, tag: str = "", progress=None,
              settle_s: float = SETTLE_S) -> Dict[str, Any]:
    """One request per prefill worker (``prompts[i]`` on ``prefill{i}``), sent to every decoder
    (replicated or layer-sharded); then the monolithic references. Returns the metrics.

    Before each timed phase (the prefills, the monolithic run) it pauses ``settle_s``: OpenBLAS
    threads of a process that just computed keep spinning for a while, and on a small host they
    would steal the CPU from the phase being timed."""
    n_layers, D = layout.n_layers, len(cl.decoders)
    shards = layer_ranges(n_layers, D) if shard else [(0, n_layers)] * D
    reqs = []
    for p, ids in enumerate(prompts):
        rid = f"r{p}{tag}"
        pw = cl.prefills[p]
        for d, dw in enumerate(cl.decoders):
            dw.send(cmd="alloc", rid=rid, n_tokens=len(ids), extra_tokens=max_new_tokens,
                    layers=list(shards[d]) if shard else None, prefill=pw.info["engine"])
        grants = [cl.expect(dw.name, "grant")["grant"] for dw in cl.decoders]
        reqs.append({"rid": rid, "prefill": pw.name, "ids": ids, "grants": grants})
    if progress:
        progress.start_round(reqs, cl, n_layers, max_new_tokens, shard)
    time.sleep(settle_s)
    for dw in cl.decoders:
        dw.send(cmd="recv", rids=[r["rid"] for r in reqs], wait=wait, warm=warm, timeout=cl.timeout)
    for r in reqs:  # all prefills start together (concurrently with --prefills 2)
        cl.workers[r["prefill"]].send(cmd="prefill", rid=r["rid"], ids=r["ids"], grants=r["grants"],
                                      chunk_layers=chunk_layers, progress=progress is not None)
    for r in reqs:
        r["pf"] = cl.expect(r["prefill"], "prefilled")
    received = {dw.name: cl.expect(dw.name, "received")["results"] for dw in cl.decoders}

    # generation: every decoder on its own (replicated), or pipeline-parallel over the shards
    eos = model.config.eos_id
    for r in reqs:
        rid = r["rid"]
        if not shard:
            for dw in cl.decoders:
                dw.send(cmd="generate", rid=rid, max_new_tokens=max_new_tokens, progress=progress is not None)
            r["gen"] = [cl.expect(dw.name, "generated") for dw in cl.decoders]
        else:
            tok = received[cl.decoders[-1].name][rid]["first_token"]  # the last shard's aux has it
            out, pos = [tok], len(r["ids"])
            if progress:
                progress.token(rid, None, 1)
            t0 = time.monotonic()
            while len(out) < max_new_tokens and tok != eos:
                payload: Dict[str, Any] = {"token": tok}
                for dw in cl.decoders:
                    dw.send(cmd="stage", rid=rid, pos=pos, **payload)
                    msg = cl.expect(dw.name, "stage")
                    payload = {k: msg[k] for k in ("h", "dtype", "shape") if k in msg}
                tok = msg["token"]
                out.append(tok)
                pos += 1
                if progress:
                    progress.token(rid, None, len(out))
            dt = (time.monotonic() - t0) * 1e3
            r["gen"] = [{"tokens": out, "decode_ms": dt, "tpot_ms": dt / (len(out) - 1) if len(out) > 1 else None}]
    for r in reqs:
        for dw in cl.decoders:
            dw.send(cmd="free", rid=r["rid"])
            cl.expect(dw.name, "freed")

    # the monolithic references run last, alone on the CPU
    time.sleep(settle_s)
    for r in reqs:
        r["mono"] = mono_reference(model, r["ids"], max_new_tokens)
        if progress:
            progress.mono(r["rid"])
    return _round_metrics(cl, model, layout, reqs, received, shard)


def _round_metrics(cl, model, layout, reqs, received, shard) -> Dict[str, Any]:
    out_reqs = []
    for r in reqs:
        pf, rid, n = r["pf"], r["rid"], len(r["ids"])
        tm = transfer_metrics(pf["t_start"], pf["t_compute_end"], pf["intervals"])
        expected = sum(layout.kv_bytes(n, tuple(g["layers"])) + AUX.size for g in r["grants"])
        decs = []
        for d, (dw, g) in enumerate(zip(cl.decoders, r["grants"])):
            rc = received[dw.name][rid]
            decs.append({"decoder": dw.name, "engine": dw.info["engine"], "layers": g["layers"],
                         "blocks": g["blocks"], "link": pf["links"].get(g["decode"], "?"),
                         "ttft_ms": (rc["t_kv"] - pf["t_start"]) * 1e3, "kv_load_ms": rc["kv_load_ms"],
                         "first_token": rc["first_token"], "checksum": rc["checksum"],
                         "checksum_ok": rc["checksum"] == pf["checksums"][d]})
        mono = r["mono"]
        gens = []
        for i, gen in enumerate(r["gen"]):
            by = "pipeline " + "+".join(dw.name for dw in cl.decoders) if shard else cl.decoders[i].name
            gens.append({"by": by, "tokens": gen["tokens"],
                         "text": model.tokenizer.decode(gen["tokens"], skip_special_tokens=True),
                         "identical": gen["tokens"] == mono["tokens"], "tpot_ms": gen["tpot_ms"],
                         "decode_ms": gen["decode_ms"]})
        ttft = max(d["ttft_ms"] for d in decs)
        out_reqs.append({
            "rid": rid, "prefill": r["prefill"], "n_prompt": n, "first_token": pf["first_token"],
            "prompt_text": model.tokenizer.decode(r["ids"]),
            "bytes": pf["bytes"], "expected_bytes": expected, "mib": pf["bytes"] / MiB, "transfers": pf["transfers"],
            "flagged": pf["flagged"], **tm,
            "compute_ms": (pf["t_compute_end"] - pf["t_start"]) * 1e3,
            "flush_after_compute_ms": (pf["t_flushed"] - pf["t_compute_end"]) * 1e3,
            "layer_compute_ms": pf["layer_compute_ms"], "layer_transfer_ms": pf["layer_transfer_ms"],
            "intervals_ms": [[(a - pf["t_start"]) * 1e3, (b - pf["t_start"]) * 1e3] for a, b in pf["intervals"]],
            "ttft_disagg_ms": ttft, "ttft_mono_ms": mono["ttft_ms"], "ttft_ratio": ttft / mono["ttft_ms"],
            "tpot_mono_ms": mono["tpot_ms"], "tokens_mono": mono["tokens"],
            "text_mono": model.tokenizer.decode(mono["tokens"], skip_special_tokens=True),
            "decoders": decs, "generations": gens,
            "identical": all(g["identical"] for g in gens),
            "checksums_ok": all(d["checksum_ok"] for d in decs),
        })
    # slot isolation: on each decoder, the grants of different requests name disjoint blocks
    disjoint = {}
    for d, dw in enumerate(cl.decoders):
        sets = [set(r["grants"][d]["blocks"]) for r in reqs]
        disjoint[dw.name] = all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1:])
    return {"requests": out_reqs, "grants_disjoint": disjoint,
            "identical": all(r["identical"] for r in out_reqs),
            "checksums_ok": all(r["checksums_ok"] for r in out_reqs),
            "bytes_ok": all(r["bytes"] == r["expected_bytes"] for r in out_reqs)}


# ---------------------------------------------------------------------------- display
def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 100 else f"{v:.1f}"
        return str(v)
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    num = [all(isinstance(row[i], (int, float)) or row[i] is None for row in rows) for i in range(len(headers))]

    def line(vals):
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(vals, widths, num)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _span(lo_hi):
    return f"{lo_hi[0]}-{lo_hi[1] - 1}"


def _blocks(blocks):
    b = sorted(blocks)
    if b == list(range(b[0], b[-1] + 1)):
        return f"{b[0]}-{b[-1]}" if len(b) > 1 else str(b[0])
    return ",".join(map(str, b[:6])) + (",..." if len(b) > 6 else "")


def summary(res: Dict[str, Any]) -> str:
    lines = []
    rows = []
    for r in res["requests"]:
        links = sorted({d["link"] for d in r["decoders"]})
        rows.append([r["rid"], r["prefill"], "/".join(links), r["n_prompt"], r["mib"], r["transfers"],
                     r["compute_ms"], r["busy_ms"], r["exposed_ms"], 100 * r["overlap"],
                     r["ttft_disagg_ms"], r["ttft_mono_ms"], r["ttft_ratio"]])
    lines.append(table(["request", "prefill", "link", "prompt [tok]", "KV [MiB]", "xfers [#]", "compute [ms]",
                        "busy [ms]", "exposed [ms]", "overlap [%]", "TTFT PD [ms]", "TTFT mono [ms]",
                        "ratio [x]"], rows))
    lines.append("  compute: prefill compute incl. first token; busy: union of the transfers' [submit, done] "
                 "intervals;\n  exposed: busy time after compute ended; overlap = 1 - exposed / busy; TTFT PD: prefill "
                 "start -> decoder(s) hold\n  all KV + first token; TTFT mono: prefill + argmax in one process; "
                 "ratio = TTFT PD / TTFT mono")
    lines.append("")
    rows = []
    for r in res["requests"]:
        for d in r["decoders"]:
            rows.append([r["rid"], d["decoder"], _span(d["layers"]), _blocks(d["blocks"]), d["ttft_ms"],
                         d["kv_load_ms"], "ok" if d["checksum_ok"] else "MISMATCH"])
    lines.append(table(["request", "decoder", "layers", "blocks", "KV done [ms]", "KV load [ms]",
                        "sha256 vs prefill"], rows))
    lines.append("  KV done: flag seen by the decoder, after prefill start; KV load: copy into the decode cache")
    lines.append("")
    rows = []
    for r in res["requests"]:
        for g in r["generations"]:
            rows.append([r["rid"], g["by"], len(g["tokens"]), g["tpot_ms"], r["tpot_mono_ms"],
                         "IDENTICAL" if g["identical"] else "DIFFERENT"])
    lines.append(table(["request", "generated by", "new [tok]", "TPOT PD [ms]", "TPOT mono [ms]",
                        "tokens vs monolithic"], rows))
    return "\n".join(lines)


class _Progress:
    """rich progress bars: prefill layers, decode tokens, monolithic reference."""

    def __init__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self.p = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn(), transient=False)
        self.tasks: Dict[Any, Any] = {}

    def __enter__(self):
        self.p.start()
        return self

    def __exit__(self, *exc):
        self.p.stop()

    def start_round(self, reqs, cl, n_layers, max_new, shard):
        for r in reqs:
            rid = r["rid"]
            self.tasks[("L", rid)] = self.p.add_task(f"{rid} prefill ({r['prefill']}) layers", total=n_layers)
            for dw in cl.decoders:
                self.tasks[("K", rid, dw.name)] = self.p.add_task(f"{rid} KV -> {dw.name}", total=1)
            if shard:
                self.tasks[("T", rid, None)] = self.p.add_task(f"{rid} tokens (pipeline)", total=max_new)
            else:
                for dw in cl.decoders:
                    self.tasks[("T", rid, dw.name)] = self.p.add_task(f"{rid} tokens on {dw.name}", total=max_new)
            self.tasks[("M", rid)] = self.p.add_task(f"{rid} monolithic reference", total=1)

    def __call__(self, name, msg):
        ev = msg["event"]
        if ev == "layer":
            self.p.update(self.tasks[("L", msg["rid"])], completed=msg["layer"] + 1)
        elif ev == "kv_ready":
            self.p.update(self.tasks[("K", msg["rid"], name)], completed=1)
        elif ev == "token":
            self.token(msg["rid"], name, msg["n"])

    def token(self, rid, name, n):
        self.p.update(self.tasks[("T", rid, name)], completed=n)

    def mono(self, rid):
        self.p.update(self.tasks[("M", rid)], completed=1)


def _say(quiet: bool, *a) -> None:
    if not quiet:
        print(*a, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hixl demo", description=__doc__, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"user message (default: {DEFAULT_PROMPT!r})")
    ap.add_argument("--prompt2", default=DEFAULT_PROMPT2,
                    help=f"the second prefill's user message with --prefills 2 (default: {DEFAULT_PROMPT2!r})")
    ap.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                    help="pad the user message (filler text before the question) so that the chat prompt "
                         "has exactly N tokens, e.g. 512")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32; EOS stops early)")
    ap.add_argument("--transport", choices=["auto", "shm", "tcp", "rdma"], default="auto",
                    help="hixl transport of every worker engine (default auto: rdma if a device is active, "
                         "else shm on this host)")
    ap.add_argument("--decoders", type=int, default=1, metavar="N", help="decode workers (default 1)")
    ap.add_argument("--shard", action="store_true",
                    help="with --decoders N >= 2: split the layers into N contiguous ranges, one per decoder, "
                         "and decode pipeline-parallel over them (see below)")
    ap.add_argument("--prefills", type=int, default=1, choices=[1, 2],
                    help="prefill workers; 2 = two prompts pushed concurrently into the same decoder(s)")
    ap.add_argument("--chunk-layers", type=int, default=1, metavar="K",
                    help="push after every K layers (default 1; the last chunk carries the flag)")
    ap.add_argument("--wait", choices=WAIT_MODES, default="block",
                    help="how decoders wait for the KV: block = KVReceiver.wait; poll = KVReceiver.poll "
                         "every 1 ms; fd = select() on KVReceiver.fileno(), then poll (default block)")
    ap.add_argument("--warm", action="store_true", help="decoders touch every received byte once before loading")
    ap.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block (default 16)")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds any single step may take before the run is aborted (default 120)")
    ap.add_argument("--json", metavar="PATH", help="write all metrics and tokens to PATH")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (also when stdout is not a TTY)")
    ap.add_argument("--role", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--num-blocks", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--max-requests", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        return _worker(args)

    if args.decoders < 1 or args.max_new_tokens < 1 or args.block_tokens < 1 or args.timeout <= 0:
        ap.error("--decoders, --max-new-tokens, --block-tokens and --timeout must be positive")
    if args.shard and args.decoders < 2:
        ap.error("--shard needs --decoders N with N >= 2")
    try:
        model = load_model()
    except (FileNotFoundError, ImportError) as e:
        print(f"hixl demo: cannot load SmolLM2-135M-Instruct: {e}", file=sys.stderr)
        return EXIT_ERROR
    from .kv import KVLayout
    layout = KVLayout.for_model(model.config, "float32", args.block_tokens)
    if args.shard and args.decoders > layout.n_layers:
        ap.error(f"--shard: at most {layout.n_layers} decoders (one layer each)")
    if not 1 <= args.chunk_layers <= layout.n_layers:
        ap.error(f"--chunk-layers must be in 1..{layout.n_layers}")
    try:
        prompts = [build_prompt_ids(model.tokenizer, q, args.prompt_tokens)
                   for q in [args.prompt, args.prompt2][:args.prefills]]
    except ValueError as e:
        ap.error(str(e))
    res = run_demo(args, model, layout, prompts)
    return res["exit_code"]


def run_demo(args, model, layout, prompts) -> Dict[str, Any]:
    tty = sys.stdout.isatty() and not args.no_progress
    quiet = tty  # with bars on a TTY, the bars are the progress report
    shape = f"1P+{args.decoders}D" if args.prefills == 1 else f"{args.prefills}P+{args.decoders}D"
    mode = "layer-sharded, pipeline decode" if args.shard else ("replicated" if args.decoders > 1 else "")
    print(f"hixl demo: SmolLM2-135M-Instruct, {shape}{' ' + mode if mode else ''}, transport {args.transport}, "
          f"push every {args.chunk_layers} layer(s), wait {args.wait}{', warm' if args.warm else ''}, "
          f"{args.max_new_tokens} new tokens", flush=True)
    for p, ids in enumerate(prompts):
        q = args.prompt if p == 0 else args.prompt2
        print(f"  r{p}: {len(ids)} prompt tokens, question {q!r}", flush=True)
    cap = [layout.blocks_for(len(ids) + args.max_new_tokens) for ids in prompts]
    result: Dict[str, Any] = {"ok": False, "config": {k: v for k, v in vars(args).items()
                                                       if k not in ("role", "name", "num_blocks", "max_requests")},
                              "model": {"name": "SmolLM2-135M-Instruct", **vars(layout).copy()}}
    progress = None
    code = EXIT_ERROR
    cl = None
    try:
        if tty:
            try:
                progress = _Progress()
            except ImportError:
                progress = None
        threads = worker_threads(args.prefills, args.decoders, args.shard)
        result["worker_blas_threads"] = threads
        _say(quiet, f"  starting {args.prefills} prefill + {args.decoders} decode worker(s)"
             + "".join(f", {n} BLAS thread(s) per {r} worker" for r, n in threads.items())
             + f" ({os.cpu_count()} CPUs) ...")
        t0 = time.monotonic()
        cl = Cluster(prefills=args.prefills, decoders=args.decoders, transport=args.transport,
                     timeout=args.timeout, prefill_blocks=max(layout.blocks_for(len(i)) for i in prompts),
                     decode_blocks=sum(cap), decode_requests=len(prompts), block_tokens=args.block_tokens,
                     threads=threads, on_progress=progress)
        _say(quiet, f"  workers ready in {time.monotonic() - t0:.1f} s: " + ", ".join(
            f"{w.name} pid {w.info['pid']} @ {w.info['engine']}" for w in cl.workers.values()))
        if progress:
            with progress:
                res = run_round(cl, model, layout, prompts, max_new_tokens=args.max_new_tokens, shard=args.shard,
                                chunk_layers=args.chunk_layers, wait=args.wait, warm=args.warm, progress=progress)
        else:
            _say(quiet, "  prefill -> KV push -> decode, then the monolithic reference ...")
            res = run_round(cl, model, layout, prompts, max_new_tokens=args.max_new_tokens, shard=args.shard,
                            chunk_layers=args.chunk_layers, wait=args.wait, warm=args.warm)
        cl.close()
        result.update(res)
        ok = res["identical"] and res["checksums_ok"]
        result["ok"] = ok
        code = EXIT_OK if ok else EXIT_MISMATCH
        print()
        print(summary(res))
        print()
        for r in res["requests"]:
            print(f"{r['rid']} prompt ({r['n_prompt']} tokens): ...{r['prompt_text'][-120:]!r}")
            for g in r["generations"]:
                print(f"{r['rid']} {g['by']}: {g['text']!r}")
            print(f"{r['rid']} monolithic: {r['text_mono']!r}")
        if len(prompts) > 1:
            for d, dw in enumerate(cl.decoders):
                sets = ", ".join(f"{r['rid']} blocks {_blocks(r['decoders'][d]['blocks'])}" for r in res["requests"])
                print(f"slot isolation on {dw.name}: {sets}: "
                      f"{'disjoint' if res['grants_disjoint'][dw.name] else 'OVERLAPPING'}")
        if not res["bytes_ok"]:
            print("note: bytes moved differ from the expected KV bytes (see JSON)")
        n_seq = sum(len(r["generations"]) for r in res["requests"])
        n_same = sum(g["identical"] for r in res["requests"] for g in r["generations"])
        verdict = "IDENTICAL to" if res["identical"] else "DIFFERENT from"
        print(f"tokens: {verdict} the monolithic run ({n_same}/{n_seq} sequences); KV checksums "
              f"{'match' if res['checksums_ok'] else 'MISMATCH'}")
    except DemoError as e:
        print(f"hixl demo: error: {e}; stopping the other workers", file=sys.stderr, flush=True)
        result["error"] = str(e)
        if cl is not None:
            cl.kill()
    except KeyboardInterrupt:
        result["error"] = "interrupted"
        if cl is not None:
            cl.kill()
        code = 130
    except BaseException:
        if cl is not None:
            cl.kill()
        raise
    result["exit_code"] = code
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main())
