"""``hixl.kv``: the KV-cache layer of a prefill/decode (PD) disaggregated pipeline.

What an inference engine imports. It sits on :class:`hixl.Hixl` and so runs over every transport
(rdma, shm, tcp) with the same semantics.

* :class:`KVLayout` - layers, KV heads, head dim, dtype and tokens per block (paged, vLLM-style).
* :class:`KVPool` - registered memory laid out as ``[layer][K|V][block][token][head][dim]`` plus a small
  per-request *aux* area; :meth:`KVPool.offset` is the one place a byte offset is computed.
* Bring your own memory: :meth:`KVPool.wrap` registers memory an inference engine owns (vLLM's KV
  cache tensors) in that engine's layout, described by a :class:`BlockMemory` (where each layer's
  blocks start, their stride, K and V in separate blocks or packed in one, token- or head-major
  inside); :meth:`KVReceiver.expect` and :meth:`KVSender.add_request` then work on the owner's block
  ids, with no staging copy. :func:`block_desc_array` is the one place transfer descriptors are built: a
  numpy descriptor array per transfer, no Python object per descriptor.
* Several KV cache groups in one cache (vLLM's hybrid KV cache: full attention, sliding window, the MLA
  latent, Mamba state): :class:`KVGroups` gives each group its :class:`KVLayout` (``kind`` ``kv``,
  ``latent`` or ``state``) and :class:`BlockMemory`; :meth:`KVPool.wrap_groups` registers memory the
  groups share once; a request then has block ids per group (``None``: a block it does not hold, e.g.
  behind a sliding window), a grant one :class:`GroupGrant` per group, and still one completion flag.
* Tensor parallelism with a different TP on the two sides: a :class:`HeadSlice` says which KV heads a
  side's blocks hold; :func:`sliced_desc_array` moves only the heads both hold, in place (a grant or a
  pull source with ``heads`` does so).
* :class:`KVReceiver` (decode side) - hands out request *slots* (a block table and a ticket) as
  :class:`Grant` objects, learns that a request's KV is complete from its completion flag, and gives
  back the K/V. Three ways to wait: :meth:`KVReceiver.poll` (non-blocking), :meth:`KVReceiver.wait`
  (blocks on the completion event, optionally with a timeout) and :meth:`KVReceiver.fileno` for
  ``select``/``asyncio``.
* :class:`KVSender` (prefill side) - :meth:`KVSender.push` is non-blocking and is called as soon as a
  chunk of layers is computed, so their transfer overlaps the compute of the next ones. A request may
  go to several decoders (replicated, or layer-sharded: each grant names its layers). The last push to
  a decoder carries the completion flag (RDMA: WRITE_WITH_IMM; shm/tcp: the ordered flag frame).
  In-flight transfers are bounded (``max_inflight``): a push beyond waits, never overflows a queue.

Isolation: blocks are owned by exactly one live slot; a grant addresses only its own blocks; a flag
whose ticket is unknown (stale) or that comes from another engine than the one the grant was made
for is ignored (and logged). A slot freed before its flag arrived keeps its blocks *quarantined*
until that flag arrives or :meth:`KVReceiver.reclaim` is called, so a late writer never lands in
another request's blocks.
"""
from .errors import KVError, KVTimeout, PoolExhausted, TransferFailed
from .grant import Grant, GroupGrant
from .groups import KVGroups
from .heads import HeadSlice, head_range, head_sources, sliced_desc_array
from .layout import BlockMemory, KVLayout, block_desc_array, block_descs
from .pool import KVPool
from .receiver import KVReceiver
from .sender import KVSender, union_seconds

__all__ = [
    "KVError", "PoolExhausted", "KVTimeout", "TransferFailed",
    "KVLayout", "BlockMemory", "block_desc_array", "block_descs", "KVPool", "Grant", "GroupGrant", "KVGroups",
    "KVReceiver", "KVSender",
    "union_seconds", "HeadSlice", "head_range", "head_sources", "sliced_desc_array",
]
