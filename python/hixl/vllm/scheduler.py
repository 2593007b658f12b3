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
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

from . import messages
from .config import ConnectorConfig
from .metadata import HixlConnectorMetadata, HixlHandshake, LoadSpec, SendStep

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

_log = logging.getLogger("hixl.vllm")
HOLD_STEP_S = 1.0


@dataclass
class _Prefill:
    transfer_id: str
    n_tokens: int
    blocks: list
    pushed: int = 0  # request blocks already announced complete


class HixlScheduler:
    def __init__(self, config: ConnectorConfig, block_size: int, role: str):
        self.config, self.block_size, self.role = config, block_size, role
        self.engine: Optional[str] = None      # the worker's hixl engine (from the handshake)
        self.memory: Optional[Dict[str, Any]] = None
        self.layout: Optional[Dict[str, Any]] = None
        self._prefills: Dict[str, _Prefill] = {}        # prefill requests being computed
        self._held: Dict[str, float] = {}               # finished prefill requests whose blocks we hold (since)
        self._new_held: Dict[str, str] = {}
        self._loads: Dict[str, LoadSpec] = {}           # decode loads to start in the next step
        self._cancels: Dict[str, str] = {}

    # -- handshake ---------------------------------------------------------------------------
    def set_handshake(self, metadata: Dict[Any, Any]) -> None:
        metas = [m for m in metadata.values() if isinstance(m, HixlHandshake)]
        if len(metas) != 1:
            raise NotImplementedError(f"HixlConnector serves one worker per instance (tensor and pipeline "
                                      f"parallel size 1); got handshakes from {sorted(metadata)}")
        m = metas[0]
        self.engine, self.memory, self.layout = m.engine, m.memory, m.layout
        _log.info("hixl.vllm: worker engine %s (%s mode)", self.engine, self.config.mode)

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
        n = request.num_prompt_tokens - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        p = self._params(request)
        rid = request.request_id
        if p.get("do_remote_decode") and self.role != "kv_consumer" and rid not in self._prefills:
            tid = p.get("transfer_id", rid)
            if not messages.valid_tid(tid):
                _log.warning("hixl.vllm: request %s has a bad transfer_id %r: its KV is not sent", rid, tid)
                return
            self._prefills[rid] = _Prefill(tid, request.num_prompt_tokens, [])
            return
        if not p.get("do_remote_prefill") or p.get("_hixl_staged"):
            return
        p["_hixl_staged"] = True  # a re-entry (preemption, a failed load recomputed) loads nothing again
        tid, peer = p.get("transfer_id"), p.get("remote_engine")
        if num_external_tokens <= 0:
            if messages.valid_tid(tid) and isinstance(peer, str):
                self._cancels[tid] = peer  # the prefill need not wait for our grant
            return
        mode = p.get("mode", "push")
        if not messages.valid_tid(tid) or not isinstance(peer, str) or mode not in ("push", "pull"):
            _log.warning("hixl.vllm: request %s: kv_transfer_params lack a valid transfer_id, remote_engine or "
                         "mode (%r): nothing to load", rid, {k: p.get(k) for k in ("transfer_id", "remote_engine",
                                                                                      "mode")})
            tid, peer = tid if messages.valid_tid(tid) else "invalid", peer if isinstance(peer, str) else ""
        (block_ids,) = blocks.get_block_ids()
        n = request.num_prompt_tokens
        first = (n - num_external_tokens) // self.block_size
        nb = -(-n // self.block_size)
        source = None
        if mode == "pull":
            source = {k: p.get(k) for k in ("remote_blocks", "remote_memory", "remote_layout")}
        self._loads[rid] = LoadSpec(transfer_id=tid, mode=mode, peer=peer, blocks=list(block_ids[first:nb]),
                                    first_block=first, n_tokens=n, source=source)

    def build_connector_meta(self, so: "SchedulerOutput") -> HixlConnectorMetadata:
        meta = HixlConnectorMetadata(loads=self._loads, held=self._new_held, cancels=self._cancels,
                                     idle=so.total_num_scheduled_tokens == 0)
        self._loads, self._new_held, self._cancels = {}, {}, {}
        if self._prefills:
            for req in so.scheduled_new_reqs:
                pf = self._prefills.get(req.req_id)
                if pf is not None:
                    pf.blocks = list(req.block_ids[0])
                    self._step(meta, req.req_id, pf, req.num_computed_tokens, so)
            cached = so.scheduled_cached_reqs
            for i, rid in enumerate(cached.req_ids):
                pf = self._prefills.get(rid)
                if pf is None:
                    continue
                new = cached.new_block_ids[i]
                if rid in cached.resumed_req_ids:  # preempted and resumed: its blocks were replaced
                    pf.blocks, pf.pushed = list(new[0]) if new else [], 0
                elif new:
                    pf.blocks += list(new[0])
                self._step(meta, rid, pf, cached.num_computed_tokens[i], so)
        return meta

    def _step(self, meta: HixlConnectorMetadata, rid: str, pf: _Prefill, computed: int, so: "SchedulerOutput") -> None:
        after = min(pf.n_tokens, computed + so.num_scheduled_tokens.get(rid, 0))
        final = after >= pf.n_tokens
        hi = -(-pf.n_tokens // self.block_size) if final else after // self.block_size
        meta.sends[rid] = SendStep(transfer_id=pf.transfer_id, blocks=list(pf.blocks), n_tokens=pf.n_tokens,
                                   lo=pf.pushed, hi=hi, final=final)
        pf.pushed = hi

    def request_finished(self, request: "Request", block_ids: list) -> Tuple[bool, Optional[Dict[str, Any]]]:
        rid = request.request_id
        pf = self._prefills.pop(rid, None)
        if pf is None:
            if self._params(request).get("hixl_discover"):  # a router asking where our engine is
                return False, {"hixl_discover": True, "remote_engine": self.engine, "mode": self.config.mode,
                               "role": self.role}
            return False, None
        hold = bool(block_ids)
        if hold:
            self._held[rid] = time.monotonic()
            self._new_held[rid] = pf.transfer_id
        # what a decoder needs to ask for a push (our engine, the transfer id) or to read (pull) the blocks;
        # "mode" is this instance's preference, a router may choose the other
        nb = -(-pf.n_tokens // self.block_size)
        params: Dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False,
                                  "transfer_id": pf.transfer_id, "remote_engine": self.engine,
                                  "mode": self.config.mode, "num_tokens": pf.n_tokens,
                                  "remote_blocks": list(block_ids[:nb]), "remote_memory": self.memory,
                                  "remote_layout": self.layout}
        return hold, params

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
