"""What the scheduler side tells the worker side each step (pickled by vLLM), and what a worker tells
its scheduler once at start-up (its engine address, through vLLM's handshake hook: one per TP rank).

Block ids travel per KV cache group (vLLM's order of the groups that move): each list says, for request
block ``j`` of that group, the block that holds it here, ``None`` for one not to move (a sliding window's
blocks behind the window, a prefix the decoder holds already, vLLM's null block). A single group may also
be given as a flat list (:func:`per_group`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)

Blocks = List[List[Optional[int]]]


def per_group(blocks: Sequence, first_block: int = 0) -> Blocks:
    """``blocks`` as one list per group: as it is when it is one already, else a flat list of one group's
    blocks from request block ``first_block`` on."""
    if blocks and all(isinstance(b, (list, tuple)) for b in blocks):
        return [list(b) for b in blocks]
    return [[None] * first_block + list(blocks)]


@dataclass
class LoadSpec:
    """Decode side: receive the KV of a request's prompt into these blocks."""

    transfer_id: str
    mode: str                      # push | pull
    peer: str                      # the prefill's hixl engine (of its TP rank 0: peers[0]); "" when unknown
    blocks: Union[Blocks, List[int]]  # ours, per group (or one group's from first_block on)
    first_block: int               # attention blocks the decoder holds already (a prefix it computed)
    n_tokens: int                  # prompt tokens that come (the prefill computes them)
    source: Optional[Dict[str, Any]] = None  # pull: {"remote_blocks": the prefill's block ids (per group)}
    peers: List[str] = field(default_factory=list)  # the prefill's hixl engines by its TP rank ([peer] at TP 1)
    remote_tp: int = 1             # the prefill's tensor parallel size (len(peers))
    siblings: List[str] = field(default_factory=list)  # this instance's hixl engines by TP rank (relays)
    local_tokens: int = -1         # prompt tokens the decoder holds already (-1: first_block's blocks)

    def group_blocks(self) -> Blocks:
        return per_group(self.blocks, self.first_block)


@dataclass
class SendStep:
    """Prefill side, one step of a request whose KV goes to a decoder: in each group the request blocks
    ``spans[g] = (lo, hi)`` become complete in this step (every layer is written by its forward pass; a
    Mamba group's state only in the step that completes the prompt)."""

    transfer_id: str
    blocks: Union[Blocks, List[int]]  # the request's blocks so far, per group (or one group's)
    n_tokens: int                  # prompt tokens
    lo: int                        # group 0's span (a single group's)
    hi: int
    final: bool                    # the prompt is complete after this step
    spans: Optional[List[Tuple[int, int]]] = None  # per group (None: [(lo, hi)])

    def group_blocks(self) -> Blocks:
        return per_group(self.blocks)

    def group_spans(self) -> List[Tuple[int, int]]:
        return list(self.spans) if self.spans is not None else [(self.lo, self.hi)]


@dataclass
class HixlConnectorMetadata(KVConnectorMetadata):
    loads: Dict[str, LoadSpec] = field(default_factory=dict)        # decode: new loads, by request id
    sends: Dict[str, SendStep] = field(default_factory=dict)        # prefill: this step, by request id
    held: Dict[str, str] = field(default_factory=dict)              # prefill: finished, blocks held (id -> tid)
    # decode: tid -> the prefill engine, or (TP > 1) every prefill rank's engine: nothing to load
    cancels: Dict[str, Union[str, List[str]]] = field(default_factory=dict)
    idle: bool = False                                              # nothing scheduled in this step


@dataclass
class HixlHandshake(KVConnectorHandshakeMetadata):
    engine: str                    # "host:port" of the worker's hixl engine
    memory: Optional[Dict[str, Any]] = None  # its hixl.kv.BlockMemory (not sent to routers)
    layout: Optional[Dict[str, Any]] = None  # its hixl.kv.KVLayout (not sent to routers)
