"""``Grant``: a decode-side slot as the prefill side needs to know it."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .heads import HeadSlice
from .layout import BlockMemory, KVLayout


@dataclass(frozen=True)
class GroupGrant:
    """One KV cache group of a grant as a transfer uses it: the decoder's block of each request block
    ``j`` (``None``: not wanted, e.g. behind a sliding window, or below a prefix the decoder holds),
    the group's layout (a dict, compared with the other side's), the decoder's memory and, head-sliced,
    the decoder's heads and those it wants (else ``None``)."""

    blocks: Tuple[Optional[int], ...]
    layout: Dict[str, Any]
    memory: BlockMemory
    heads: Optional[HeadSlice] = None
    want: Optional[Tuple[int, int]] = None

    def wanted(self, nb: int) -> List[int]:
        """The request blocks ``j < nb`` this group wants."""
        return [j for j in range(min(nb, len(self.blocks))) if self.blocks[j] is not None]

    def to_dict(self) -> Dict[str, Any]:
        return {"blocks": list(self.blocks), "layout": dict(self.layout), "memory": self.memory.to_dict(),
                "heads": None if self.heads is None else {"slice": self.heads.to_dict(), "want": list(self.want)}}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "GroupGrant":
        if not isinstance(d, dict) or set(d) != {"blocks", "layout", "memory", "heads"}:
            raise ValueError(f"a grant's group must be a dict of blocks, layout, memory, heads, not {str(d)[:200]}")
        blocks = tuple(d["blocks"])
        if any(b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0) for b in blocks):
            raise ValueError(f"a grant's group names blocks that are not block ids: {list(blocks)[:20]}")
        if not isinstance(d["layout"], dict):
            raise ValueError(f"a grant's group layout must be a dict, not {d['layout']!r:.100}")
        heads, want = None, None
        if d["heads"] is not None:
            try:
                heads, want = HeadSlice.from_dict(d["heads"]["slice"]), tuple(int(x) for x in d["heads"]["want"])
            except (KeyError, TypeError) as e:
                raise ValueError(f"a grant's group has malformed heads {d['heads']!r:.200}: {e}") from None
            if len(want) != 2:
                raise ValueError(f"a grant's group wants heads {want}, not [lo, hi]")
        return cls(blocks, dict(d["layout"]), BlockMemory.from_dict(d["memory"]), heads, want)


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
    prefill; ``layout`` is then the decoder's (its ``n_kv_heads`` are its own).

    ``groups`` (several KV cache groups, :class:`~hixl.kv.groups.KVGroups`): one :class:`GroupGrant`
    dict per group, which then says the blocks, layout, memory and heads (``blocks``, ``first_block``,
    ``layout``, ``memory`` and ``heads`` are unused); ``layers`` count across the groups.
    :meth:`group_grants` gives either form as :class:`GroupGrant` objects."""

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
    groups: Optional[Tuple[Dict[str, Any], ...]] = None  # several KV cache groups: a GroupGrant dict each

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["blocks"], d["layers"] = list(self.blocks), list(self.layers)
        for k in ("heads", "groups"):  # absent when unused: the dict an older peer knows
            if d[k] is None:
                del d[k]
        if "groups" in d:
            d["groups"] = [dict(x) for x in self.groups]
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Grant":
        d = dict(d)
        d["blocks"], d["layers"] = tuple(d["blocks"]), tuple(d["layers"])
        if d.get("groups") is not None:
            if not isinstance(d["groups"], (list, tuple)) or not d["groups"]:
                raise ValueError(f"grant groups must be a non-empty list, not {d['groups']!r:.100}")
            d["groups"] = tuple(d["groups"])
        return cls(**d)

    def group_grants(self, layout: KVLayout) -> List[GroupGrant]:
        """Each KV cache group of the grant (one, from ``blocks``, ``first_block``, ``memory`` and
        ``heads``, when it has no ``groups``); ``layout``: ours, for a grant of a pool of its own
        (addressed from ``pool_addr``). Raises ValueError for a malformed one."""
        if self.groups is not None:
            return [GroupGrant.from_dict(x) for x in self.groups]
        heads, want = self.head_slice()
        return [GroupGrant(self.request_blocks(), dict(self.layout), self.block_memory(layout), heads, want)]

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
