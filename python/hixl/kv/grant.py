"""``Grant``: a decode-side slot as the prefill side needs to know it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Tuple


@dataclass(frozen=True)
class Grant:
    """A decode-side slot as the prefill side needs to know it (JSON-able with :meth:`to_dict`).

    It travels from the decoder to the prefill instance through whatever the deployment uses to
    route requests (the demo: a pipe). Addresses are the decoder's; nothing here is a secret the
    peer could not already read from the region list the engine handshake gives it."""

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

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["blocks"], d["layers"] = list(self.blocks), list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Grant":
        d = dict(d)
        d["blocks"], d["layers"] = tuple(d["blocks"]), tuple(d["layers"])
        return cls(**d)
