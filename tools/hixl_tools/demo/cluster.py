"""The orchestrator: starts and stops the workers (Cluster), runs one round of requests through them
(run_round) and checks every byte and token against the monolithic reference."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional
from .common import AUX, BLAS_ENV, MiB, SETTLE_S, layer_ranges, mono_reference, transfer_metrics


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
        argv = [sys.executable, "-m", "hixl_tools.demo", "--role", role, "--name", name] + extra
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


