"""Disaggregated prefill/decode (PD) with a real model: SmolLM2-135M-Instruct, all on this host.

``hixl demo`` (or ``python -m hixl_tools.demo``) starts prefill and decode *worker processes*. Each has its
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
# The package: common.py (model, prompt, reference, metrics), workers.py (the prefill and decode worker
# processes), cluster.py (the orchestrator: Cluster, run_round), cli.py (options, display; main).
from __future__ import annotations

from .cli import main, run_demo, summary, table
from .cluster import Cluster, DemoError, Worker, run_round
from .common import (DEFAULT_PROMPT, EXIT_ERROR, EXIT_MISMATCH, EXIT_OK, WAIT_MODES, build_prompt_ids, layer_ranges,
                     load_model, mono_reference)

__all__ = ["main", "run_demo", "summary", "table", "Cluster", "DemoError", "Worker", "run_round", "DEFAULT_PROMPT",
           "EXIT_OK", "EXIT_MISMATCH", "EXIT_ERROR", "WAIT_MODES", "build_prompt_ids", "layer_ranges", "load_model",
           "mono_reference"]
