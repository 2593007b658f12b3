"""``Grant``: a decode-side slot as the prefill side needs to know it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple

from .heads import HeadSlice
from .layout import BlockMemory, KVLayout


@dataclass(frozen=True)
class Grant:
    """A decode-side slot as the prefill side needs to know it (JSON-able with :meth:`to_dict`).

    It travels from the decoder to the prefill instance through whatever the deployment uses to
    route requests (the demo: a pipe; the vLLM connector: notifies over the hixl link). Addresses are
    the decoder's; nothing here is a secret the peer could not already read from the region list the
    engine handshake gives it.

    ``blocks[k]`` holds the request's tokens ``[(first_block + k) * block_tokens, ...)``: a decoder
    that already holds the first ``first_block`` blocks (a prefix-cache hit) grants only the rest.
    ``memory`` is the decoder's :class:`BlockMemory` (absent: a :class:`KVPool` of its own, addressed
    from ``pool_addr`` and ``num_blocks``). ``aux_bytes == 0``: no aux area (the flag rides on the
    last block write).

    ``heads`` (tensor parallelism with a different TP on the two sides): the decoder's blocks hold the
    KV heads its :class:`~hixl.kv.heads.HeadSlice` says, and it wants heads ``want`` from this
    prefill; ``layout`` is then the decoder's (its ``n_kv_heads`` are its own)."""

    request_id: str
    decode: str                   # the decoder's engine address
    ticket: int                   # u32, the completion flag value
    blocks: Tuple[int, ...]
    n_tokens: int
    layers: Tuple[int, int]       # [lo, hi): the layers this decoder receives
    pool_addr: int
    num_blocks: int
    aux_addr: int
    aux_bytes: int
    layout: Dict[str, Any] = field(default_factory=dict)
    prefill: Optional[str] = None  # the engine allowed to complete it (None: any)
    first_block: int = 0
    memory: Optional[Dict[str, Any]] = None
    heads: Optional[Dict[str, Any]] = None  # head-sliced: {"slice": the decoder's HeadSlice, "want": [a, b]}

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["blocks"], d["layers"] = list(self.blocks), list(self.layers)
        if d["heads"] is None:  # whole blocks: the dict an older peer knows
            del d["heads"]
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Grant":
        d = dict(d)
        d["blocks"], d["layers"] = tuple(d["blocks"]), tuple(d["layers"])
        return cls(**d)

    def block_memory(self, layout: KVLayout) -> BlockMemory:
        """The decoder's addressing of its blocks."""
        if self.memory is not None:
            return BlockMemory.from_dict(self.memory)
        bb = layout.block_bytes
        return BlockMemory(layer_addrs=tuple(self.pool_addr + layer * 2 * self.num_blocks * bb
                                             for layer in range(layout.n_layers)),
                           num_blocks=self.num_blocks, block_stride=bb, unit_bytes=bb, parts=2,
                           part_stride=self.num_blocks * bb, token_major=True)

    def head_slice(self) -> Tuple[Optional["HeadSlice"], Optional[Tuple[int, int]]]:
        """The decoder's :class:`~hixl.kv.heads.HeadSlice` and the heads it wants, or ``(None, None)``."""
        if self.heads is None:
            return None, None
        try:
            lo, hi = (int(x) for x in self.heads["want"])
            return HeadSlice.from_dict(self.heads["slice"]), (lo, hi)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"grant for {self.request_id!r}: malformed heads {self.heads!r}: {e}") from None

    def request_blocks(self) -> Tuple[Optional[int], ...]:
        """The decoder's block of each request block ``j`` (``None`` below ``first_block``)."""
        return (None,) * self.first_block + tuple(self.blocks)
