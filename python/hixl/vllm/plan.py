"""Where each decoder rank takes a request's KV from, group by group (tensor parallelism on either side):
:func:`sources` gives the parts of one decoder rank's load, :func:`fanin` how many decoder ranks take
something from a prefill rank (how many grants it waits for), :func:`idle_prefill_ranks` the prefill
ranks nobody takes anything from (they are told to let go at once).

Per group kind:
* attention (``full``, ``sliding``): from the prefill rank of our rank when both sides have the same TP;
  else each prefill rank holding some of our KV heads sends those (:func:`hixl.kv.head_sources`);
* ``mla``: the latent is the same on every rank, so it crosses the network once per request: decoder rank
  0 takes it from prefill rank 0, and the other decoder ranks copy it from decoder rank 0 (a *relay*, on
  the host) once it landed there (``relay``; without it, as beside other groups, decoder rank ``r`` takes
  it from prefill rank ``r * remote_tp // tp``);
* ``mamba``: the state is split over the ranks by vLLM's own layout, so both sides need the same TP.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple, Union

from ..kv.heads import head_range, head_sources

__all__ = ["Source", "GroupPlan", "sources", "fanin", "idle_prefill_ranks", "relayed_to"]

Want = Union[None, bool, Tuple[int, int]]  # None: whole blocks; (a, b): those KV heads; False: nothing


@dataclass(frozen=True)
class GroupPlan:
    """What the plan needs of a group: its kind, the model's KV heads (attention), whether our blocks'
    heads are known (head-sliced transfers need it)."""

    kind: str
    total_heads: int = 0
    sliceable: bool = False


@dataclass(frozen=True)
class Source:
    """One part of a load: ``rank`` of the prefill (or, ``sibling``, of this instance: a relay), and per
    group what comes from it."""

    rank: int
    sibling: bool
    wants: Tuple[Want, ...]


def sources(rank: int, tp: int, remote_tp: int, groups: Sequence[GroupPlan], relay: bool = True) -> List[Source]:
    """The parts of decoder rank ``rank``'s load (of ``tp`` ranks) from a prefill of ``remote_tp`` ranks.
    ValueError when a group cannot move between these TP sizes (saying why, naming both)."""
    parts: Dict[Tuple[bool, int], List[Want]] = {}

    def want(sibling: bool, q: int, k: int, w: Want) -> None:
        parts.setdefault((sibling, q), [False] * len(groups))[k] = w

    for k, g in enumerate(groups):
        if g.kind == "mla":
            if not relay:
                want(False, rank * remote_tp // tp, k, None)
            elif rank == 0:
                want(False, 0, k, None)
            else:
                want(True, 0, k, None)
        elif remote_tp == tp:
            want(False, rank, k, None)
        elif g.kind == "mamba":
            raise ValueError(f"KV cache group {k} is Mamba state, which vLLM splits over the TP ranks: the prefill "
                             f"has TP {remote_tp}, this decoder TP {tp}; it moves between equal TP sizes only")
        elif not g.sliceable:
            raise ValueError(f"the prefill has TP {remote_tp}, this decoder TP {tp}, and the KV heads of group {k} "
                             f"are unknown: no head-sliced transfer")
        else:
            lo, hi = head_range(rank, tp, g.total_heads)
            for q, a, b in head_sources(lo, hi, remote_tp, g.total_heads, prefer=rank):
                want(False, q, k, (a, b))
    return [Source(q, sib, tuple(w)) for (sib, q), w in sorted(parts.items())]


def fanin(q: int, remote_tp: int, tp: int, groups: Sequence[GroupPlan], relay: bool = True) -> int:
    """How many of the ``tp`` decoder ranks take something from prefill rank ``q`` (of ``remote_tp``)."""
    return sum(any(not s.sibling and s.rank == q for s in sources(r, tp, remote_tp, groups, relay))
               for r in range(tp))


def idle_prefill_ranks(remote_tp: int, tp: int, groups: Sequence[GroupPlan], relay: bool = True) -> List[int]:
    return [q for q in range(remote_tp) if not fanin(q, remote_tp, tp, groups, relay)]


def relayed_to(rank: int, tp: int, remote_tp: int, groups: Sequence[GroupPlan], relay: bool = True) -> List[int]:
    """The decoder ranks that copy part of their load from decoder rank ``rank`` (once it landed here)."""
    return [r for r in range(tp) if r != rank
            and any(s.sibling and s.rank == rank for s in sources(r, tp, remote_tp, groups, relay))]
