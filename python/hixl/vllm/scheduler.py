"""The scheduler side of :class:`hixl.vllm.HixlConnector` (runs in vLLM's EngineCore process).

It decides, from each request's ``kv_transfer_params``, what the worker side does:

* a **prefill** request (``do_remote_decode``) is computed normally; each step the worker learns which
  of its blocks become complete (:class:`~hixl.vllm.metadata.SendStep`), so that it can push them layer
  by layer during the forward pass. When it finishes, its blocks are held (``request_finished`` returns
  True) until the worker reports the push complete, the decoder read them (pull) or the lease ran out;
* a **decode** request (``do_remote_prefill``) gets its prompt's KV from the prefill: the tokens past
  its own prefix-cache hit are loaded asynchronously (``get_num_new_matched_tokens`` returns them with
  ``True``); once vLLM allocated their blocks, the worker grants them to the prefill (push) or reads
  the prefill's blocks (pull).

Which contract a router speaks (ours, NIXL's, Mooncake's) is read and written by
:mod:`hixl.vllm.contracts`; a Mooncake description whose engine id does not name the prefill's hixl
engines is completed from the prefill's bootstrap endpoint (:class:`~hixl.vllm.lookups.BootstrapLookups`,
never waited on here: the load starts at a later step). A prefill serves that endpoint
(:class:`~hixl.vllm.bootstrap.BootstrapServer`) from this process.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from . import contracts
from .bootstrap import BootstrapServer
from .config import DEFAULT_BOOTSTRAP_PORT, ConnectorConfig
from .lookups import BootstrapLookups
from .metadata import HixlConnectorMetadata, HixlHandshake, LoadSpec, SendStep
from .specs import GroupSpec, backoff_of

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

_log = logging.getLogger("hixl.vllm")
HOLD_STEP_S = 1.0
_SHOWN = ("transfer_id", "remote_request_id", "remote_engine", "remote_engines", "remote_engine_id", "remote_host",
          "remote_port", "remote_bootstrap_addr", "tp_size", "mode")


@dataclass
class _Prefill:
    transfer_id: str
    n_tokens: int
    blocks: list                 # per group (None: a block not held)
    pushed: list                 # per group: request blocks already announced complete


def _null(b: int) -> Optional[int]:
    """vLLM's block id as ours: its null block (id 0: a sliding window's blocks behind the window, a
    Mamba group's unused positions) is a block the request does not hold."""
    return None if b == 0 else b


class HixlScheduler:
    """The scheduler side for ``role``; ``specs``: the KV cache groups that move (their ``index`` is their
    place in the block-id tuples vLLM hands out)."""

    def __init__(self, config: ConnectorConfig, specs: List[GroupSpec], role: str, engine_id: str = "hixl",
                 dp_rank: int = 0, lookups: Optional[BootstrapLookups] = None):
        self.config, self.specs, self.role = config, list(specs), role
        self.backoff = backoff_of(self.specs)
        self.kv_cache_manager: Any = None  # vLLM's, once bound: the blocks a request holds now, per group
        self.engine_id, self.dp_rank = engine_id, dp_rank  # vLLM's engine id (kv_transfer_config.engine_id)
        self.engines: List[str] = []           # the workers' hixl engines by TP rank (from the handshake)
        self.engine: Optional[str] = None      # engines[0]
        self._prefills: Dict[str, _Prefill] = {}        # prefill requests being computed
        self._held: Dict[str, float] = {}               # finished prefill requests whose blocks we hold (since)
        self._new_held: Dict[str, str] = {}
        self._loads: Dict[str, LoadSpec] = {}           # decode loads to start in the next step
        self._cancels: Dict[str, List[str]] = {}        # decode: tid -> prefill engines (nothing to load)
        self._lookups = lookups or BootstrapLookups(timeout_s=config.connect_timeout_ms / 1000.0)
        self._waiting: Dict[str, Tuple[Optional[LoadSpec], Dict[str, Any]]] = {}  # for a bootstrap answer
        self._bootstrap: Optional[BootstrapServer] = None

    # -- handshake, bootstrap endpoint ---------------------------------------------------------------
    def set_handshake(self, metadata: Dict[Any, Any]) -> None:
        """One :class:`HixlHandshake` per TP rank (keyed by rank, or by ``(pp_rank, tp_rank)``)."""
        by_rank: Dict[int, HixlHandshake] = {}
        for key, m in metadata.items():
            pp, tp = key if isinstance(key, tuple) else (0, key)
            if pp != 0:
                raise NotImplementedError(f"HixlConnector does not support pipeline parallelism (a handshake "
                                          f"from pipeline rank {pp}); run with pipeline_parallel_size 1")
            if isinstance(m, HixlHandshake):
                by_rank[int(tp)] = m
        if not by_rank or sorted(by_rank) != list(range(len(by_rank))):
            raise RuntimeError(f"HixlConnector: handshakes from TP ranks {sorted(by_rank)}, not 0..n-1 "
                               f"(got {sorted(metadata, key=str)})")
        self.engines = [by_rank[r].engine for r in range(len(by_rank))]
        self.engine = self.engines[0]
        _log.info("hixl.vllm: worker engine(s) %s (%s mode)", ", ".join(self.engines), self.config.mode)

    def engine_id_for_routers(self) -> str:
        return contracts.encode_engine_id(self.engine_id, self.engines) if self.engines else self.engine_id

    def bootstrap_answer(self) -> Dict[str, Any]:
        """``GET /query``'s answer, in ``MooncakeBootstrapServer``'s shape (``{}`` before the workers'
        handshake, as Mooncake's answers before its workers registered)."""
        if not self.engines:
            return {}
        return {str(self.dp_rank): {"engine_id": self.engine_id_for_routers(),
                                    "worker_addr": {str(r): {"0": e} for r, e in enumerate(self.engines)}}}

    def serve_bootstrap(self) -> Optional[BootstrapServer]:
        """Starts the bootstrap endpoint (prefill roles, ``bootstrap_port`` not 0). RuntimeError naming
        the port and the option when it cannot listen."""
        port = self.config.bootstrap_port
        if self.role == "kv_consumer" or port == 0:
            return None
        self._bootstrap = BootstrapServer(self.config.host or "0.0.0.0", port or DEFAULT_BOOTSTRAP_PORT,
                                          self.bootstrap_answer)
        try:
            self._bootstrap.start()
        except RuntimeError as e:
            self._bootstrap = None
            if port is not None:
                raise
            _log.warning("%s. Serving no bootstrap endpoint: vllm-router's mooncake mode cannot find this "
                         "prefill (the other contracts are not affected)", e)
        return self._bootstrap

    def close(self) -> None:
        if self._bootstrap is not None:
            self._bootstrap.stop()
            self._bootstrap = None

    # -- both roles ------------------------------------------------------------------------------
    @staticmethod
    def _params(request: "Request") -> Dict[str, Any]:
        p = request.kv_transfer_params
        return p if isinstance(p, dict) else {}

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> Tuple[int, bool]:
        p = self._params(request)
        if not p.get("do_remote_prefill") or p.get("_hixl_staged"):
            return 0, False
        if self.role == "kv_producer":
            _log.warning("hixl.vllm: request %s asks for a remote prefill, but this instance is kv_producer: "
                         "computing it here", request.request_id)
            return 0, False
        n = self._loaded_tokens(request) - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def _loaded_tokens(self, request: "Request") -> int:
        """Prompt tokens a decoder loads: all but the ``backoff`` last, which it computes itself."""
        n = request.num_prompt_tokens
        return n - self.backoff if n > self.backoff else n

    def on_new_request(self, request: "Request") -> None:
        """A prefill request whose KV goes to a decoder stops ``backoff`` tokens short of its prompt (the
        decoder computes them: :func:`hixl.vllm.specs.backoff_of`), and computes only its prompt."""
        p = self._params(request)
        if (not self.backoff or not p.get("do_remote_decode") or self.role == "kv_consumer"
                or p.get("_hixl_truncated") or request.num_prompt_tokens <= self.backoff
                or request.get_skip_reading_prefix_cache()):
            return
        b = self.backoff
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-b:]
        elif request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-b]
        else:
            return
        if getattr(request, "prompt_is_token_ids", None) is not None:
            request.prompt_is_token_ids = request.prompt_is_token_ids[:-b]
        del request._all_token_ids[-b:]
        request.num_prompt_tokens -= b
        request.max_tokens = 1
        p["_hixl_truncated"] = True

    def _held_blocks(self, block_ids: Any) -> List[List[Optional[int]]]:
        """The blocks of the groups that move, from vLLM's tuple over every group (or one group's list)."""
        if block_ids and not isinstance(block_ids[0], (list, tuple)):
            block_ids = (block_ids,)
        return [[_null(b) for b in block_ids[s.index]] for s in self.specs]

    def _nb(self, n_tokens: int) -> List[int]:
        return [-(-n_tokens // s.block_size) for s in self.specs]

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        p = self._params(request)
        rid = request.request_id
        if p.get("do_remote_decode") and self.role != "kv_consumer" and rid not in self._prefills:
            # a router's transfer_id (ours, Mooncake's), else one from vLLM's request id (NIXL's contract:
            # the answer's remote_request_id is it)
            tid = contracts.prefill_transfer_id(p, rid)
            if tid is None:
                _log.warning("hixl.vllm: request %s has no usable transfer id: its KV is not sent", rid)
                return
            self._prefills[rid] = _Prefill(tid, request.num_prompt_tokens, [[] for _ in self.specs],
                                           [0] * len(self.specs))
            return
        if not p.get("do_remote_prefill") or p.get("_hixl_staged"):
            return
        p["_hixl_staged"] = True  # a re-entry (preemption, a failed load recomputed) loads nothing again
        want = contracts.describe_remote(p, self.config.mode, rid)
        if num_external_tokens <= 0:
            if want["why"] is None:
                self._resolve(rid, None, want)  # the prefill need not wait for our grant
            return
        n = self._loaded_tokens(request)
        local = n - num_external_tokens
        source = {"remote_blocks": want["blocks"]} if want["mode"] == "pull" else None
        spec = LoadSpec(transfer_id=want["tid"] or "invalid", mode=want["mode"], peer="",
                        blocks=self._wanted(self._held_blocks(blocks.get_block_ids()), n, local),
                        first_block=local // self.specs[0].block_size, n_tokens=n, source=source,
                        siblings=list(self.engines), local_tokens=local)
        if want["why"] is not None:
            self._fail_load(rid, spec, want["why"], p)
            return
        self._resolve(rid, spec, want)

    def _wanted(self, held: List[List[Optional[int]]], n: int, local: int) -> List[List[Optional[int]]]:
        """Per group, our blocks for request blocks ``0 .. nb`` of ``n`` tokens that the load fills: those
        we hold from the first one past the ``local`` tokens we have (a sliding window: its window;
        vLLM's null block elsewhere), and of a Mamba group the state after the prompt only."""
        out = []
        for spec, blocks, nb in zip(self.specs, held, self._nb(n)):
            blocks = (blocks + [None] * nb)[:nb]
            if spec.kind == "mamba":
                last = max((j for j, b in enumerate(blocks) if b is not None), default=None)
                out.append([b if j == last else None for j, b in enumerate(blocks)])
            else:
                first = local // spec.block_size
                out.append([b if j >= first else None for j, b in enumerate(blocks)])
        return out

    # -- where the prefill's hixl engines are ------------------------------------------------------
    def _resolve(self, rid: str, spec: Optional[LoadSpec], want: Dict[str, Any]) -> bool:
        """Completes a load (or, ``spec`` None, a cancel) once the prefill's engines are known: at once
        when the params name them, else from the bootstrap answer (False while it is awaited)."""
        engines = want["engines"]
        if engines is None:
            answer, why = self._lookups.get(want["bootstrap"], lambda a: self._has_engine(a, want["engine_id"]))
            if answer is None and why is None:
                self._waiting[rid] = (spec, want)
                return False
            if answer is not None:
                try:
                    engines = contracts.engines_from_query(answer, want["engine_id"])
                except ValueError as e:
                    why = f"the bootstrap endpoint {want['bootstrap']} answered no usable engine: {e}"
            if engines is None:
                if spec is not None:
                    self._fail_load(rid, spec, f"no hixl engine for transfer {want['tid']}: {why}", None)
                return True
            if want["tp"] is not None and want["tp"] != len(engines):
                _log.info("hixl.vllm: request %s: tp_size %d, but the bootstrap endpoint names %d rank(s): "
                          "using those", rid, want["tp"], len(engines))
        if spec is None:
            self._cancels[want["tid"]] = list(engines)
            return True
        spec.peers, spec.peer, spec.remote_tp = list(engines), engines[0], len(engines)
        self._loads[rid] = spec
        return True

    @staticmethod
    def _has_engine(answer: Any, engine_id: Any) -> bool:
        return isinstance(answer, dict) and any(isinstance(e, dict) and e.get("engine_id") == engine_id
                                                for e in answer.values())

    def _fail_load(self, rid: str, spec: LoadSpec, why: str, params: Optional[Dict[str, Any]]) -> None:
        """The load cannot start: the worker fails it at once (peer ""), so vLLM's kv_load_failure_policy
        decides (an error, or recomputing the prompt here)."""
        shown = {k: params.get(k) for k in _SHOWN if k in params} if params is not None else {}
        _log.warning("hixl.vllm: request %s: nothing to load (%s)%s", rid, why, f"; kv_transfer_params {shown}"
                     if shown else "")
        spec.peer, spec.peers = "", []
        self._loads[rid] = spec

    def _settle_waiting(self) -> None:
        for rid, (spec, want) in list(self._waiting.items()):
            del self._waiting[rid]
            self._resolve(rid, spec, want)  # back in _waiting while the answer is awaited

    def build_connector_meta(self, so: "SchedulerOutput") -> HixlConnectorMetadata:
        if self._waiting:
            self._settle_waiting()
        meta = HixlConnectorMetadata(loads=self._loads, held=self._new_held,
                                     cancels={t: e if len(e) > 1 else e[0] for t, e in self._cancels.items()},
                                     idle=so.total_num_scheduled_tokens == 0)
        self._loads, self._new_held, self._cancels = {}, {}, {}
        if self._prefills:
            for req in so.scheduled_new_reqs:
                pf = self._prefills.get(req.req_id)
                if pf is not None:
                    pf.blocks = self._held_blocks(req.block_ids)
                    self._step(meta, req.req_id, pf, req.num_computed_tokens, so)
            cached = so.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                pf = self._prefills.get(rid)
                if pf is None:
                    continue
                new = cached.new_block_ids[i]
                if rid in cached.resumed_req_ids:  # preempted and resumed: its blocks were replaced
                    pf.blocks = self._held_blocks(new) if new else [[] for _ in self.specs]
                    pf.pushed = [0] * len(self.specs)
                elif new:
                    pf.blocks = [old + more for old, more in zip(pf.blocks, self._held_blocks(new))]
                self._step(meta, rid, pf, cached.num_computed_tokens[i], so)
        return meta

    def _step(self, meta: HixlConnectorMetadata, rid: str, pf: _Prefill, computed: int, so: "SchedulerOutput") -> None:
        after = min(pf.n_tokens, computed + so.num_scheduled_tokens.get(rid, 0))
        final = after >= pf.n_tokens
        if self.kv_cache_manager is not None:  # what it holds now: a sliding window's blocks behind it are gone
            pf.blocks = self._held_blocks(self.kv_cache_manager.get_blocks(rid).get_block_ids())
        spans = []
        for k, (spec, nb) in enumerate(zip(self.specs, self._nb(pf.n_tokens))):
            if spec.kind == "mamba":  # the state is complete with the prompt only
                spans.append((0, nb) if final else (0, 0))
                continue
            hi = nb if final else after // spec.block_size
            spans.append((pf.pushed[k], hi))
            pf.pushed[k] = hi
        blocks = [lst[:nb] for lst, nb in zip(pf.blocks, self._nb(pf.n_tokens))]
        meta.sends[rid] = SendStep(transfer_id=pf.transfer_id, blocks=blocks, n_tokens=pf.n_tokens, lo=spans[0][0],
                                   hi=spans[0][1], final=final, spans=spans)

    def request_finished(self, request: "Request", block_ids: Any) -> Tuple[bool, Optional[Dict[str, Any]]]:
        """vLLM's ``request_finished`` (one group's block ids) and ``request_finished_all_groups`` (a
        tuple over every group): whether we hold the blocks, and the answer a decoder needs."""
        rid = request.request_id
        waiting = self._waiting.pop(rid, None)
        if waiting is not None and waiting[0] is not None:
            # aborted while its prefill's engines were looked up: vLLM holds its blocks until the worker
            # reports the load over, so the load goes to the worker, failed
            self._fail_load(rid, waiting[0], "the request ended while the bootstrap endpoint was asked", None)
        pf = self._prefills.pop(rid, None)
        if pf is None:
            if self._params(request).get("hixl_discover"):  # a router asking where our engine is
                return False, {"hixl_discover": True, "remote_engine": self.engine, "remote_engines": self.engines,
                               "remote_engine_id": self.engine_id_for_routers(), "tp_size": len(self.engines),
                               "mode": self.config.mode, "role": self.role}
            return False, None
        held = [lst[:nb] for lst, nb in zip(self._held_blocks(block_ids), self._nb(pf.n_tokens))] if block_ids \
            else [[] for _ in self.specs]
        hold = any(b is not None for lst in held for b in lst)
        if hold:
            self._held[rid] = time.monotonic()
            self._new_held[rid] = pf.transfer_id
        if not self.engines:  # no handshake: cannot happen once vLLM serves
            return hold, None
        # what a decoder needs to ask for a push or to read (pull) the blocks, in NIXL's fields and ours;
        # "mode" is this instance's preference, a router may choose the other
        return hold, contracts.prefill_answer(pf.transfer_id, self.engines, self.engine_id, self.config.mode,
                                              pf.n_tokens, held)

    def update_connector_output(self, output: Any) -> None:
        for rid in output.finished_sending or ():
            self._held.pop(rid, None)

    def has_pending_push_work(self) -> bool:
        """Keeps vLLM stepping (each idle step is a worker round trip every millisecond) only while a
        push just posted is likely to complete: for ``HOLD_STEP_S`` after a request finished. Blocks
        held longer (a grant that has not come yet: it is pushed by the inbox thread when it comes)
        are given back at the next step the instance takes anyway; an idle prefill does not spin."""
        if self._new_held:
            return True
        now = time.monotonic()
        return any(now - t < HOLD_STEP_S for t in self._held.values())
