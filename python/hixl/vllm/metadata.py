"""What the scheduler side tells the worker side each step (pickled by vLLM), and what a worker tells
its scheduler once at start-up (its engine address, through vLLM's handshake hook: one per TP rank)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)


@dataclass
class LoadSpec:
    """Decode side: receive the KV of a request's prompt into these blocks."""

    transfer_id: str
    mode: str                      # push | pull
    peer: str                      # the prefill's hixl engine (of its TP rank 0: peers[0]); "" when unknown
    blocks: List[int]              # our blocks for request blocks first_block, first_block + 1, ...
    first_block: int
    n_tokens: int
    source: Optional[Dict[str, Any]] = None  # pull: {"remote_blocks": the prefill's block ids}
    peers: List[str] = field(default_factory=list)  # the prefill's hixl engines by its TP rank ([peer] at TP 1)
    remote_tp: int = 1             # the prefill's tensor parallel size (len(peers))


@dataclass
class SendStep:
    """Prefill side, one step of a request whose KV goes to a decoder: the request blocks
    ``[lo, hi)`` become complete in this step (every layer is written by its forward pass)."""

    transfer_id: str
    blocks: List[int]              # the request's blocks so far (vLLM block ids)
    n_tokens: int                  # prompt tokens
    lo: int
    hi: int
    final: bool                    # the prompt is complete after this step


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
