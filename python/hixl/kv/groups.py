"""``KVGroups``: the KV cache groups one pool holds (vLLM's hybrid KV cache: full attention, sliding window,
MLA latent, Mamba state), each with its own layout, its own addressing and its own block ids per request.

A request's blocks are one list per group (:meth:`KVGroups.per_group`): request block ``j`` of group ``g``
holds that group's tokens ``[j * block_tokens, (j + 1) * block_tokens)`` (a state group: the state after
them), and ``None`` is a block the request does not hold there (a sliding window's blocks behind the
window, vLLM's null block). Layers are numbered across the groups, group after group: global layer ``L``
is layer ``L - offset(g)`` of its group ``g`` (:meth:`KVGroups.group_of`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .layout import BlockMemory, KVLayout, merge_ranges

__all__ = ["KVGroups"]


@dataclass(frozen=True)
class KVGroups:
    layouts: Tuple[KVLayout, ...]
    memories: Tuple[BlockMemory, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layouts", tuple(self.layouts))
        object.__setattr__(self, "memories", tuple(self.memories))
        if not self.layouts or len(self.layouts) != len(self.memories):
            raise ValueError(f"KVGroups: {len(self.layouts)} layouts and {len(self.memories)} memories")
        for g, (layout, memory) in enumerate(zip(self.layouts, self.memories)):
            try:
                memory.check(layout)
            except ValueError as e:
                raise ValueError(f"KV cache group {g}: {e}") from None
        offsets = [0]
        for layout in self.layouts:
            offsets.append(offsets[-1] + layout.n_layers)
        object.__setattr__(self, "_offsets", tuple(offsets))

    @classmethod
    def single(cls, layout: KVLayout, memory: BlockMemory) -> "KVGroups":
        return cls((layout,), (memory,))

    def __len__(self) -> int:
        return len(self.layouts)

    @property
    def n_layers(self) -> int:
        return self._offsets[-1]

    def layers(self, g: int) -> range:
        """Group ``g``'s layers, numbered globally."""
        return range(self._offsets[g], self._offsets[g + 1])

    def group_of(self, layer: int) -> Tuple[int, int]:
        """``(group, layer within it)`` of global layer ``layer``."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} outside [0, {self.n_layers})")
        g = next(k for k in range(len(self.layouts)) if layer < self._offsets[k + 1])
        return g, layer - self._offsets[g]

    def heads(self, heads: Any) -> List[Any]:
        """The :class:`~hixl.kv.heads.HeadSlice` (or None) of each group from ``heads``: None (no group's
        heads known), one HeadSlice (one group), or one entry per group."""
        if heads is None:
            return [None] * len(self.layouts)
        if not isinstance(heads, (list, tuple)):
            heads = [heads]
        if len(heads) != len(self.layouts):
            raise ValueError(f"{len(heads)} head slices for {len(self.layouts)} KV cache groups")
        return list(heads)

    def blocks_for(self, n_tokens: int) -> List[int]:
        """Blocks per group that ``n_tokens`` tokens take."""
        return [layout.blocks_for(n_tokens) for layout in self.layouts]

    def per_group(self, blocks: Sequence) -> List[List[Optional[int]]]:
        """``blocks`` as one list per group: a list of per-group lists as it is, or (one group only) a
        flat list of block ids. Entries are ints or None; ValueError for anything else."""
        flat = len(self.layouts) == 1 and all(b is None or isinstance(b, int) for b in blocks)
        lists = [list(blocks)] if flat else [list(x) for x in blocks]
        if len(lists) != len(self.layouts):
            raise ValueError(f"{len(lists)} block lists for {len(self.layouts)} KV cache groups")
        for g, lst in enumerate(lists):
            for b in lst:
                if b is not None and (not isinstance(b, int) or isinstance(b, bool)
                                      or not 0 <= b < self.memories[g].num_blocks):
                    raise ValueError(f"block {b!r} of group {g} is outside its pool of {self.memories[g].num_blocks}")
        return lists

    def ranges(self) -> List[Tuple[int, int]]:
        """The memory every group's units cover, merged into ``(addr, len)`` ranges (what to register:
        groups that share memory, as vLLM's hybrid cache does, are registered once)."""
        return merge_ranges(r for m in self.memories for r in m.ranges())
