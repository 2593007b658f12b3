"""HixlConnector with vLLM's hybrid KV cache manager: several KV cache groups (full attention, sliding window,
Mamba state, the MLA latent), without a vLLM server but with vLLM's own parts for everything the connector
does not do itself.

The caches are what vLLM's worker allocates for hybrid models (its grouping of the layers, its one allocation
that every group aliases: ``allocate_kv_cache``), and the block ids come from vLLM's ``KVCacheManager`` on
both sides (the prefill computing its prompt, chunked or not; the decoder allocating for an external load),
as vLLM's scheduler would pass them to the connector's scheduler side. The expected bytes are read through
vLLM's own views of the caches, block by block: a unit moved to the wrong page, a block behind the window
that moved anyway, or a state that did not come all show, and so does any byte of the decoder's cache
written that should not have been.

The bookkeeping alone (which blocks each side holds and wants) is checked over every prompt length of a
range against what the decoder's recomputation of the prompt's last token reads."""
from __future__ import annotations

import math
import time
from types import SimpleNamespace as NS

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core import kv_cache_utils as ku  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, MambaSpec, MLAAttentionSpec,  # noqa: E402
                                        SlidingWindowSpec)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from hixl.vllm.config import ConnectorConfig  # noqa: E402
from hixl.vllm.metadata import HixlConnectorMetadata, HixlHandshake  # noqa: E402
from hixl.vllm.scheduler import HixlScheduler  # noqa: E402
from hixl.vllm.specs import backoff_of, group_specs  # noqa: E402
from hixl.vllm.worker import HixlWorker  # noqa: E402
from tests.vllm_tier.test_connector_units import _until  # noqa: E402

W, B = 32, 16                       # the sliding window and the attention block, in tokens
MAX_LEN = 2048
CONV, SSM = (3, 32), (2, 8, 8)      # a small Gated DeltaNet's conv and SSM states (vLLM's shapes per rank)
MAMBA_BYTES = 3 * 32 * 2 + 2 * 8 * 8 * 4


def _attn(kind, heads=2, head=8, dtype=torch.float32, block=B):
    if kind == "sliding":
        return SlidingWindowSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype, sliding_window=W)
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head, dtype=dtype)


def _model(name, block=B):
    """Layer name -> vLLM KV cache spec, for a few hybrid shapes (as vLLM's model runner reports them)."""
    if name == "sliding":      # Gemma 3 / gpt-oss: sliding and full attention layers alternating
        return {f"model.layers.{i}.self_attn.attn": _attn("sliding" if i % 2 == 0 else "full", block=block)
                for i in range(4)}
    if name == "full":         # the same layers, all full attention
        return {f"model.layers.{i}.self_attn.attn": _attn("full", block=block) for i in range(4)}
    if name == "mamba":        # Qwen3-Next: three linear-attention layers to one full attention layer
        page = 2 * 2 * 8 * 4 * 32  # the attention block (32 tokens of fp32 K and V) is the page
        specs = {}
        for i in range(4):
            if i % 4 == 3:
                specs[f"model.layers.{i}.self_attn.attn"] = _attn("full", block=32)
            else:
                specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                    block_size=MAX_LEN, shapes=(CONV, SSM), dtypes=(torch.bfloat16, torch.float32),
                    page_size_padded=page)
        return specs
    if name == "mla":          # DeepSeek-V2: the latent (kv_lora_rank 512 + rope 64) in blocks of 16
        return {f"model.layers.{i}.self_attn.attn": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                                                     dtype=torch.bfloat16) for i in range(2)}
    raise ValueError(name)


def _config(name, monkeypatch, budget=8 << 20, block=B):
    """vLLM's KVCacheConfig for the model: its grouping of the layers and its tensors."""
    monkeypatch.setattr(ku, "may_override_num_blocks", lambda _vc, n: n)
    cc = NS(get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC, prefix_cache_retention_interval=None,
            num_gpu_blocks_override=None)
    vc = NS(cache_config=cc, attention_config=NS(hisparse_config=None))
    groups = ku._get_kv_cache_groups_uniform_page_size(_model(name, block))
    return ku.get_kv_cache_config_from_groups(vc, groups, budget)


def _manager(cfg):
    sizes = [g.kv_cache_spec.block_size for g in cfg.kv_cache_groups]
    return KVCacheManager(cfg, max_model_len=MAX_LEN, scheduler_block_size=math.lcm(*sizes),
                          hash_block_size=min(sizes), enable_caching=False, max_in_flight_tokens=MAX_LEN)


def _request(rid, n, params, max_tokens):
    r = Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens), None)
    r.kv_transfer_params = params
    return r


def _so(new=(), cached=(), scheduled=None):
    return NS(scheduled_new_reqs=[NS(req_id=r, block_ids=b, num_computed_tokens=c) for r, b, c in new],
              scheduled_cached_reqs=NS(req_ids=[r for r, _, _ in cached], new_block_ids=[b for _, b, _ in cached],
                                       num_computed_tokens=[c for _, _, c in cached], resumed_req_ids=set()),
              num_scheduled_tokens=scheduled or {}, total_num_scheduled_tokens=sum((scheduled or {}).values()))


# ------------------------------------------------------------------------------------ bookkeeping
def test_group_specs_follow_vllms_groups_and_refuse_what_cannot_move(monkeypatch):
    cfg = _config("sliding", monkeypatch)
    specs = group_specs(cfg, total_kv_heads=2)
    assert [(s.kind, s.window, s.block_size) for s in specs] == [
        ("full" if isinstance(g.kv_cache_spec, FullAttentionSpec) else "sliding",
         W if isinstance(g.kv_cache_spec, SlidingWindowSpec) else 0, B) for g in cfg.kv_cache_groups]
    assert {s.kind for s in specs} == {"full", "sliding"} and [s.index for s in specs] == list(range(len(specs)))
    assert [list(s.layer_names) for s in specs] == [list(g.layer_names) for g in cfg.kv_cache_groups]
    kinds = {s.kind for s in group_specs(_config("mamba", monkeypatch))}
    assert kinds == {"full", "mamba"} and backoff_of(group_specs(_config("mamba", monkeypatch))) == 1
    assert {s.kind for s in group_specs(_config("mla", monkeypatch))} == {"mla"}
    assert backoff_of(group_specs(_config("mla", monkeypatch))) == 0 and backoff_of(specs) == 1
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    bad = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["a"], ChunkedLocalAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                         attention_chunk_size=64))])
    with pytest.raises(NotImplementedError, match="ChunkedLocalAttentionSpec"):
        group_specs(bad)
    skipped = KVCacheConfig(num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["a"], _attn("full")), KVCacheGroupSpec(["b"], _attn("full"), enable_kv_transfer=False)])
    assert [s.layer_names for s in group_specs(skipped)] == [("a",)]


def _held_and_wanted(name, n, monkeypatch, chunk=None):
    """What the prefill holds when its request ends and what the decoder's load wants, per group, as the
    connector's scheduler sides take them from vLLM's managers (the prefill computing ``n - backoff``
    tokens in chunks of ``chunk``)."""
    cfg = _config(name, monkeypatch)
    specs = group_specs(cfg, 2)
    p = HixlScheduler(ConnectorConfig(), specs, "kv_producer")
    d = HixlScheduler(ConnectorConfig(), specs, "kv_consumer")
    mp, md = _manager(cfg), _manager(cfg)
    pr = _request("p", n, {"do_remote_decode": True, "transfer_id": "t"}, 16)
    p.on_new_request(pr)
    done, step = 0, chunk or pr.num_prompt_tokens
    while done < pr.num_prompt_tokens:
        k = min(step, pr.num_prompt_tokens - done)
        assert mp.allocate_slots(pr, k) is not None
        done += k
        pr.num_computed_tokens = done
    mp.remove_skipped_blocks("p", done, done)
    held = p._held_blocks(mp.get_block_ids_for_computed_tokens("p", done))
    dr = _request("d", n, {"do_remote_prefill": True, "transfer_id": "t", "remote_engine": "10.0.0.1:5"}, 16)
    ext, _ = d.get_num_new_matched_tokens(dr, 0)
    assert ext == pr.num_prompt_tokens  # the decoder loads what the prefill computed
    assert md.allocate_slots(dr, 0, num_external_computed_tokens=ext, delay_cache_blocks=True) is not None
    wanted = d._wanted(d._held_blocks(md.get_block_ids("d")), ext, 0)
    return specs, held, wanted, ext


@pytest.mark.parametrize("chunk", [None, 48])
def test_the_decoder_wants_its_window_and_the_prefill_holds_it_for_every_prompt_length(monkeypatch, chunk):
    for n in range(W - 4, 6 * W):
        specs, held, wanted, ext = _held_and_wanted("sliding", n, monkeypatch, chunk)
        assert ext == n - 1  # the decoder computes the prompt's last token itself
        for spec, h, w in zip(specs, held, wanted):
            got = [j for j, b in enumerate(w) if b is not None]
            assert all(j < len(h) and h[j] is not None for j in got), (n, spec.kind, h, w)  # the prefill has each
            if spec.kind == "full":
                assert got == list(range(-(-ext // B))), (n, w)
                continue
            # the decoder's last prompt token (position n - 1) attends the W positions before it: those of
            # them loaded ([n - W, n - 2]) must all come, and nothing older
            need = sorted({pos // B for pos in range(max(0, n - W), n - 1)})
            assert got == need, (n, got, need)
            assert len(got) <= -(-W // B) + 1


def test_a_mamba_group_moves_the_state_after_the_prompt_and_nothing_else(monkeypatch):
    for n in (5, 33, 200, 700):
        specs, held, wanted, ext = _held_and_wanted("mamba", n, monkeypatch)
        assert ext == n - 1
        for spec, h, w in zip(specs, held, wanted):
            got = [j for j, b in enumerate(w) if b is not None]
            if spec.kind == "mamba":
                assert got == [0] and h[0] is not None, (n, h, w)  # one state block (vLLM's block: the prompt)
            else:
                assert got == list(range(-(-ext // 32))) and all(h[j] is not None for j in got)


# ------------------------------------------------------------------------------------ bytes
class Side:
    """One TP rank of an instance: vLLM's cache for the model (random bytes on a prefill), a worker over it,
    and vLLM's manager for its block ids."""

    def __init__(self, name, role, monkeypatch, transport, seed=None, rank=0, tp=1, data=None, block=B,
                 cache_dtype="auto", latent="kv_lora_rank 512 + rope 64", **cfg):
        self.cfg = _config(name, monkeypatch, block=block)
        self.kv = allocate_kv_cache(self.cfg, torch.device("cpu"), KVCacheLayout.LBHNC)
        t = next(iter(self.kv.values()))
        self.raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
        if data is not None:
            self.raw.copy_(data)
        elif seed is not None:
            self.raw.copy_(torch.randint(0, 256, self.raw.shape, dtype=torch.uint8,
                                         generator=torch.Generator().manual_seed(seed)))
        self.specs = group_specs(self.cfg, 2 * tp, cache_dtype, latent)
        config = ConnectorConfig.parse(dict({"transport": transport, "host": "127.0.0.1"}, **cfg), env={})
        self.w = HixlWorker(config, role, "e", self.cfg.num_blocks, self.specs, rank=rank, tp_size=tp)
        self.w.register_kv_caches(self.kv)
        self.engine = self.w.engine.local_engine
        self.hooked = [n for n in sorted(self.kv, key=lambda n: int(n.split(".")[2])) if "linear_attn" not in n]

    def step(self, meta=None, layers=True, finished=()):
        self.w.bind(meta or HixlConnectorMetadata(idle=True))
        if layers:
            for n in self.hooked:  # vLLM's save_kv_layer: attention and MLA layers; Mamba layers have none
                self.w.save_kv_layer(n)
        self.w.wait_for_save()
        return self.w.transfer_results(set(finished))

    def unit(self, layer, block):
        """The bytes vLLM's view of ``layer`` has for ``block``."""
        return self.kv[layer][block].contiguous().view(torch.uint8).reshape(-1)

    def close(self):
        self.w.shutdown()


@pytest.fixture(params=["shm", "tcp"])
def transport(request):
    return request.param


def _on(cases, rdma=()):
    """``cases`` over shm and tcp, and the ``rdma`` ones over rdma too (the rxe VM runs them: under its
    emulation each costs tens of seconds, so a few that cover each group kind)."""
    rows = [pytest.param("rdma", *c, marks=pytest.mark.rdma) for c in rdma]
    return rows + [(t, *c) for t in ("shm", "tcp") for c in cases]


@pytest.fixture
def sides(monkeypatch, transport):
    made = []

    def make(name, role, **kw):
        s = Side(name, role, monkeypatch, transport, **kw)
        made.append(s)
        return s
    yield make
    for s in reversed(made):
        s.close()


class Prefill:
    """A prefill instance of one rank: its scheduler side over vLLM's manager, and the rank's worker."""

    def __init__(self, sides_):
        self.sides = sides_
        self.s = HixlScheduler(ConnectorConfig(mode="push"), sides_[0].specs, "kv_producer", engine_id="p")
        self.s.set_handshake({r: HixlHandshake(engine=x.engine) for r, x in enumerate(sides_)})
        self.m = _manager(sides_[0].cfg)
        self.s.kv_cache_manager = self.m

    def compute(self, n, chunk=None):
        """The prompt of request "p" in chunks, each a step of every rank; returns the request."""
        r = _request("p", n, {"do_remote_decode": True, "transfer_id": "t"}, 16)
        self.s.on_new_request(r)
        done, first = 0, True
        while done < r.num_prompt_tokens:
            k = min(chunk or r.num_prompt_tokens, r.num_prompt_tokens - done)
            assert self.m.allocate_slots(r, k) is not None
            if first:
                self.s.update_state_after_alloc(r, self.m.get_blocks("p"), 0)
            ids = self.m.get_block_ids("p")
            so = _so(new=[("p", ids, done)] if first else (), cached=() if first else [("p", ids, done)],
                     scheduled={"p": k})
            meta = self.s.build_connector_meta(so)
            for x in self.sides:
                x.step(meta)
            done, first = done + k, False
            r.num_computed_tokens = done
        return r

    def finish(self, r):
        """vLLM finishes the request: the scheduler side's answer; the blocks it keeps for the decoder."""
        self.m.remove_skipped_blocks("p", r.num_computed_tokens, r.num_computed_tokens)
        ids = self.m.get_block_ids_for_computed_tokens("p", r.num_computed_tokens)
        hold, answer = self.s.request_finished(r, ids)
        assert hold
        meta = self.s.build_connector_meta(_so())
        self.freed = [x.step(meta, layers=False, finished={"p"})[0] for x in self.sides]
        return answer, ids

    def released(self, rank=0):
        """Whether the rank gave back the blocks of request "p" (stepping it once more)."""
        self.freed[rank] |= self.sides[rank].step(layers=False)[0]
        return "p" in self.freed[rank]


class Decoder:
    def __init__(self, sides_):
        self.sides = sides_
        self.s = HixlScheduler(ConnectorConfig(), sides_[0].specs, "kv_consumer", engine_id="d")
        self.s.set_handshake({r: HixlHandshake(engine=x.engine) for r, x in enumerate(sides_)})
        self.m = _manager(sides_[0].cfg)
        self.done = [set() for _ in sides_]
        self.failed = [set() for _ in sides_]

    def load(self, n, params):
        r = _request("d", n, params, 16)
        ext, _ = self.s.get_num_new_matched_tokens(r, 0)
        assert self.m.allocate_slots(r, 0, num_external_computed_tokens=ext, delay_cache_blocks=True) is not None
        self.s.update_state_after_alloc(r, self.m.get_blocks("d"), ext)
        meta = self.s.build_connector_meta(_so())
        self.poll(meta)
        return self.m.get_block_ids("d")

    def poll(self, meta=None):
        for k, x in enumerate(self.sides):
            _, recv, failed = x.step(meta, layers=False)
            self.done[k] |= recv
            self.failed[k] |= failed
        return all("d" in d for d in self.done)


def _check(p, d, p_ids, d_ids, before, n):
    """Every block the decoder's load (of ``n`` tokens) wanted holds the prefill's bytes, in every layer of
    its group; every other byte of the decoder's cache is as it was. Returns the bytes moved per group kind.
    (An MLA block holds its tokens one after the other: of the last one, only the prompt's tokens move.)"""
    moved = {}
    changed = torch.zeros_like(d.raw, dtype=torch.bool)
    base = d.raw.data_ptr()
    for k, g in enumerate(p.cfg.kv_cache_groups):
        kind, block = p.specs[k].kind, p.specs[k].block_size
        for j, bd in enumerate(d_ids[k]):
            if bd == 0 or j >= len(p_ids[k]) or j * block >= n:
                continue
            if kind == "mamba" and j != max(i for i, b in enumerate(d_ids[k]) if b):
                continue
            for layer in g.layer_names:
                view = d.kv[layer][bd]
                size = view.nbytes if kind != "mla" else view.nbytes * min(block, n - j * block) // block
                assert torch.equal(d.unit(layer, bd)[:size], p.unit(layer, p_ids[k][j])[:size]), (kind, layer, j)
                changed[view.data_ptr() - base:view.data_ptr() - base + size] = True
                moved[kind] = moved.get(kind, 0) + size
    assert torch.equal(d.raw[~changed], before[~changed]), "bytes outside the wanted blocks were written"
    return moved


@pytest.mark.parametrize("transport,name,n,chunk", _on(
    [("sliding", 150, None), ("sliding", 150, 48), ("mamba", 150, None), ("mamba", 150, 64), ("mla", 70, None)],
    rdma=[("sliding", 150, 48), ("mamba", 150, None)]))
def test_a_layer_wise_push_moves_each_groups_blocks_into_place(sides, name, n, chunk):
    p = Prefill([sides(name, "kv_producer", seed=7)])
    d = Decoder([sides(name, "kv_consumer")])
    before = d.sides[0].raw.clone()
    d_ids = d.load(n, {"do_remote_prefill": True, "transfer_id": "t", "remote_engine": p.sides[0].engine,
                       "mode": "push"})
    _until(lambda: p.sides[0].w.producer._grants or p.sides[0].w.producer._by_tid)  # granted before the prefill
    r = p.compute(n, chunk)
    _until(d.poll)
    assert not d.failed[0]
    _, p_ids = p.finish(r)
    moved = _check(p.sides[0], d.sides[0], p_ids, d_ids, before, r.num_prompt_tokens)
    _until(p.released)  # the prefill gives its blocks back
    sent = p.sides[0].w.stats.take().data
    recv = d.sides[0].w.stats.take().data
    assert sent["send_kinds"] == moved == recv["recv_kinds"], (sent["send_kinds"], moved, recv["recv_kinds"])
    if name == "sliding":  # the window's blocks only, in every sliding layer
        cfg = p.sides[0].cfg
        per_block = p.sides[0].kv[cfg.kv_cache_groups[0].layer_names[0]][0].nbytes
        layers = sum(len(g.layer_names) for g, s in zip(cfg.kv_cache_groups, p.sides[0].specs) if s.kind == "sliding")
        assert moved["sliding"] <= layers * (-(-W // B) + 1) * per_block < moved["full"]


@pytest.mark.parametrize("transport,name,n", _on([("sliding", 150), ("mamba", 150), ("mla", 70)],
                                                 rdma=[("mla", 70)]))
def test_a_pull_reads_each_groups_blocks_after_the_prefill(sides, name, n):
    p = Prefill([sides(name, "kv_producer", seed=9)])
    d = Decoder([sides(name, "kv_consumer")])
    before = d.sides[0].raw.clone()
    r = p.compute(n)
    answer, p_ids = p.finish(r)
    answer = dict(answer, mode="pull")
    d_ids = d.load(n, answer)
    _until(d.poll)
    assert not d.failed[0]
    moved = _check(p.sides[0], d.sides[0], p_ids, d_ids, before, r.num_prompt_tokens)
    assert d.sides[0].w.stats.take().data["recv_kinds"] == moved
    _until(p.released)  # released by the decoder's read


@pytest.mark.parametrize("transport,mode", _on([("push",), ("pull",)], rdma=[("push",)]))
def test_an_mla_latent_crosses_once_to_a_decoder_of_two_ranks(sides, mode):
    """P TP=1 -> D TP=2: decoder rank 0 takes the latent from the prefill, rank 1 copies it from rank 0."""
    p = Prefill([sides("mla", "kv_producer", seed=11)])
    d = Decoder([sides("mla", "kv_consumer", rank=r, tp=2) for r in range(2)])
    befores = [x.raw.clone() for x in d.sides]
    if mode == "push":
        d_ids = d.load(70, {"do_remote_prefill": True, "transfer_id": "t", "remote_engine": p.sides[0].engine,
                            "mode": "push"})
        r = p.compute(70)
        _until(d.poll)
        _, p_ids = p.finish(r)
    else:
        r = p.compute(70)
        answer, p_ids = p.finish(r)
        d_ids = d.load(70, dict(answer, mode="pull"))
        _until(d.poll)
    assert not any(d.failed)
    _until(p.released)  # pull: released by decoder rank 0's read, not by the lease
    moved = [_check(p.sides[0], x, p_ids, d_ids, b, 70) for x, b in zip(d.sides, befores)]
    one = moved[0]["mla"]
    if mode == "push":  # (a read counts on the decoder only)
        assert p.sides[0].w.stats.take().data["send_bytes"] == [one]  # one copy crossed the network
    rank0, rank1 = (x.w.stats.take().data for x in d.sides)
    assert sum(rank0["recv_bytes"]) == one and not any(rank0["recv_relay_bytes"])
    assert sum(rank1["recv_relay_bytes"]) == one and not any(rank1["recv_bytes"])


def test_an_mla_latent_comes_from_one_rank_of_a_prefill_of_two(sides):
    """P TP=2 -> D TP=1: the decoder takes the latent from prefill rank 0; rank 1 is told to let go."""
    first = sides("mla", "kv_producer", seed=13, rank=0, tp=2)
    p = Prefill([first, sides("mla", "kv_producer", rank=1, tp=2, data=first.raw)])  # the same latent on both
    d = Decoder([sides("mla", "kv_consumer")])
    before = d.sides[0].raw.clone()
    r = p.compute(70)
    answer, p_ids = p.finish(r)
    d_ids = d.load(70, dict(answer, mode="push"))
    _until(d.poll)
    assert not d.failed[0]
    _check(p.sides[0], d.sides[0], p_ids, d_ids, before, 70)
    _until(lambda: p.released(1), timeout=5)  # released at once, not by the lease (60 s)
    assert not p.sides[1].w.stats.take()  # sent nothing


# ------------------------------------------------------------------------------------ refusals, failures
@pytest.mark.parametrize("prefill,decoder,said", [
    (dict(name="sliding"), dict(name="sliding", block=32), ["blocks of 16 tokens", "blocks of 32 tokens"]),
    (dict(name="sliding", cache_dtype="fp8_e4m3"), dict(name="sliding", cache_dtype="fp8_e5m2"),
     ["KV cache dtype fp8_e4m3", "KV cache dtype fp8_e5m2"]),
    (dict(name="full"), dict(name="sliding"), ["2 KV cache group", "this side has 1", "sliding blocks", "full"]),
    (dict(name="mla"), dict(name="sliding"), ["KV cache group", "this side has"]),
    (dict(name="mla"), dict(name="mla", latent="kv_lora_rank 448 + rope 128"),  # 576 wide either way
     ["kv_lora_rank 512 + rope 64", "kv_lora_rank 448 + rope 128"]),
])
def test_a_decoder_whose_groups_differ_is_refused_naming_both_sides(sides, prefill, decoder, said, caplog):
    """Blocks of another size, FP8 KV of another format (the same bytes to vLLM's tensors), groups of
    another kind, an MLA latent split otherwise (as wide): the prefill aborts the grant, saying both sides;
    the load fails (vLLM's policy decides)."""
    p = Prefill([sides(role="kv_producer", seed=3, **prefill)])
    d = Decoder([sides(role="kv_consumer", **decoder)])
    d.load(100, {"do_remote_prefill": True, "transfer_id": "t", "remote_engine": p.sides[0].engine, "mode": "push"})
    import logging
    with caplog.at_level(logging.WARNING, logger="hixl.vllm"):
        _until(d.poll)
    assert "d" in d.failed[0]
    why = next(r.getMessage() for r in caplog.records if "failed to load its KV" in r.getMessage())
    assert "aborted the transfer" in why and all(x in why for x in said), why


def test_a_prefill_that_dies_before_the_state_moved_fails_the_load_not_half_of_it(sides):
    """The attention layers were pushed, the Mamba state (pushed at the step's end, with the flag) was
    not: the decoder's load fails when the prefill's link goes; nothing is reported received."""
    p = Prefill([sides("mamba", "kv_producer", seed=5)])
    d = Decoder([sides("mamba", "kv_consumer", timeout_s=60)])
    d.load(150, {"do_remote_prefill": True, "transfer_id": "t", "remote_engine": p.sides[0].engine, "mode": "push"})
    _until(lambda: p.sides[0].w.producer._grants or p.sides[0].w.producer._by_tid)
    x = p.sides[0]
    r = _request("p", 150, {"do_remote_decode": True, "transfer_id": "t"}, 16)
    p.s.on_new_request(r)
    assert p.m.allocate_slots(r, r.num_prompt_tokens) is not None
    p.s.update_state_after_alloc(r, p.m.get_blocks("p"), 0)
    meta = p.s.build_connector_meta(_so(new=[("p", p.m.get_block_ids("p"), 0)], scheduled={"p": r.num_prompt_tokens}))
    x.w.bind(meta)
    for n in x.hooked:  # the forward's attention layers, pushed as computed ...
        x.w.save_kv_layer(n)
    x.w.shutdown()      # ... and the prefill dies before the step's end
    t0 = time.monotonic()
    _until(d.poll, timeout=20)
    assert "d" in d.failed[0] and time.monotonic() - t0 < 15  # its link's end, not its 60 s timeout
    assert not d.sides[0].w.stats.take().data["recv_tokens"]


def test_a_hybrid_prefill_whose_decoder_never_comes_frees_its_blocks_at_the_lease(sides):
    p = Prefill([sides("sliding", "kv_producer", seed=6, lease_s=0.3)])
    r = p.compute(150)
    p.finish(r)
    _until(p.released, timeout=5)
    assert p.sides[0].w.stats.take().data["send_expired"] == 1


def test_the_plan_takes_each_group_from_where_it_is_and_refuses_what_cannot_move():
    from hixl.vllm.plan import GroupPlan, fanin, idle_prefill_ranks, relayed_to, sources
    mla, attn, mamba = GroupPlan("mla"), GroupPlan("full", 4, True), GroupPlan("mamba")
    # the latent alone: rank 0 from prefill rank 0, the others copy it from rank 0; unread prefill ranks go
    assert [(s.rank, s.sibling) for s in sources(0, 2, 1, [mla])] == [(0, False)]
    assert [(s.rank, s.sibling) for s in sources(1, 2, 1, [mla])] == [(0, True)]
    assert relayed_to(0, 2, 1, [mla]) == [1] and fanin(0, 1, 2, [mla]) == 1
    assert idle_prefill_ranks(2, 1, [mla]) == [1] and idle_prefill_ranks(2, 2, [mla]) == [1]
    # beside other groups, each decoder rank takes it from a prefill rank
    assert [(s.rank, s.sibling, s.wants) for s in sources(1, 2, 1, [mla, attn], relay=False)] == [
        (0, False, (None, (2, 4)))]
    # attention of another TP: each prefill rank holding some of our heads
    assert [(s.rank, s.wants) for s in sources(0, 1, 2, [attn])] == [(0, ((0, 2),)), (1, ((2, 4),))]
    assert [(s.rank, s.wants) for s in sources(1, 2, 2, [attn, mamba])] == [(1, (None, None))]
    with pytest.raises(ValueError, match="Mamba state.*prefill has TP 2, this decoder TP 1"):
        sources(0, 1, 2, [attn, mamba])
    with pytest.raises(ValueError, match="KV heads of group 0 are unknown"):
        sources(0, 1, 2, [GroupPlan("full", 4, False)])


def test_a_relay_fails_at_once_when_the_rank_it_copies_from_fails(sides):
    """P TP=1 -> D TP=2 (MLA): the prefill dies after decoder rank 0 granted; rank 0's load fails when the
    link goes, and rank 1, which copies from rank 0, hears it and fails too, long before its timeout."""
    p = Prefill([sides("mla", "kv_producer", seed=12)])
    d = Decoder([sides("mla", "kv_consumer", rank=r, tp=2, timeout_s=60) for r in range(2)])
    d.load(70, {"do_remote_prefill": True, "transfer_id": "t", "remote_engine": p.sides[0].engine, "mode": "push"})
    _until(lambda: p.sides[0].w.producer._grants or p.sides[0].w.producer._by_tid)
    t0 = time.monotonic()
    p.sides[0].w.shutdown()
    _until(d.poll, timeout=20)
    assert d.failed == [{"d"}, {"d"}] and time.monotonic() - t0 < 15
