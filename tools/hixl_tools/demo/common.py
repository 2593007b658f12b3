"""What the demo's processes share: the model, the prompt, layer ranges, the monolithic reference, metrics."""
from __future__ import annotations

import os
import statistics
import struct
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple


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
    from ..models.smollm2 import SmolLM2
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
    from hixl.kv import union_seconds
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

    from ..models.smollm2 import DecodeCache, greedy_decode
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
