"""HixlConnector's parts without a vLLM server: two worker sides on real hixl engines (rdma in the rxe VM,
shm, tcp) over
torch tensors laid out as vLLM's CPU KV cache, driven step by step the way vLLM drives them, and the
scheduler side over stand-ins for vLLM's request and scheduler-output objects.

These are the paths a server run hits only by chance: a grant before, during (catch-up) and after the
prefill (the whole-request fallback), chunked prefill, a decoder prefix hit, pull, the prefill dying,
time-outs with the cancel handshake, the lease, a layout mismatch."""
from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from hixl import kv  # noqa: E402
from hixl.vllm import messages  # noqa: E402
from hixl.vllm.config import ConnectorConfig  # noqa: E402
from hixl.vllm.metadata import HixlConnectorMetadata, HixlHandshake, LoadSpec, SendStep  # noqa: E402
from hixl.vllm.scheduler import HixlScheduler  # noqa: E402
from hixl.vllm.cache import describe_kv_caches  # noqa: E402
from hixl.vllm.specs import GroupSpec  # noqa: E402
from hixl.vllm.worker import HixlWorker  # noqa: E402

LAYERS, BLOCKS, HEADS, TOKENS, HEAD = 4, 32, 2, 16, 8


def _caches(seed=None, head=HEAD):
    """vLLM CPU layout: one [blocks, heads, tokens, 2 * head] tensor per layer, views of one allocation."""
    raw = torch.empty((LAYERS, BLOCKS, HEADS, TOKENS, 2 * head), dtype=torch.float32)
    if seed is None:
        raw.fill_(-1.0)
    else:
        raw.copy_(torch.randn(raw.shape, generator=torch.Generator().manual_seed(seed)))
    return raw, {f"model.layers.{i}.self_attn.attn": raw[i] for i in range(LAYERS)}


class Side:
    def __init__(self, role, transport, seed=None, head=HEAD, **cfg):
        self.raw, caches = _caches(seed, head)
        config = ConnectorConfig.parse(dict({"transport": transport, "host": "127.0.0.1"}, **cfg), env={})
        self.w = HixlWorker(config, role, "e", BLOCKS, [GroupSpec("full", TOKENS, (), HEADS, head)])
        self.w.register_kv_caches(caches)
        self.engine = self.w.engine.local_engine

    def step(self, meta=None, layers=True, finished=()):
        """One vLLM step: bind, the layers' save hooks, wait_for_save, get_finished."""
        meta = meta or HixlConnectorMetadata(idle=True)
        self.w.bind(meta)
        if layers:
            for i in range(LAYERS):
                self.w.save_kv_layer(f"model.layers.{i}.self_attn.attn")
        self.w.wait_for_save()
        return self.w.transfer_results(set(finished))

    def close(self):
        self.w.shutdown()


@pytest.fixture(params=[pytest.param("rdma", marks=pytest.mark.rdma), "shm", "tcp"])
def transport(request):
    return request.param


# For the tests whose outcome is decided before any byte moves (a refusal, a lease, bad params): shm and
# tcp only. Under the VM's emulation each rdma case costs about a minute; the transfer cases cover rdma.
NO_TRANSFER = pytest.mark.parametrize("transport", ["shm", "tcp"])


@pytest.fixture
def pd(transport):
    made = []

    def make(role, seed=None, **cfg):
        s = Side(role, transport, seed, **cfg)
        made.append(s)
        return s
    yield make
    for s in reversed(made):
        s.close()


def _until(fn, timeout=10.0, step=None):
    """Calls fn (optionally running ``step`` between calls) until it returns a truthy value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        if step is not None:
            step()
        time.sleep(0.01)
    raise AssertionError(f"not within {timeout} s")


def _load(tid, peer, blocks, n_tokens, first_block=0, mode="push", source=None):
    return LoadSpec(transfer_id=tid, mode=mode, peer=peer, blocks=list(blocks), first_block=first_block,
                    n_tokens=n_tokens, source=source)


class Decoder:
    """Drives a decode side: steps until its load ends; returns (finished, failed)."""

    def __init__(self, side):
        self.side, self.done, self.failed = side, set(), set()

    def poll(self, meta=None):
        _, recv, failed = self.side.step(meta, layers=False)
        self.done |= recv
        self.failed |= failed
        return self.done

    def start(self, **loads):
        self.poll(HixlConnectorMetadata(loads=loads))

    def wait(self, rid, timeout=10.0):
        _until(lambda: rid in self.poll(), timeout)
        return rid in self.failed


def _granted(p, tid, timeout=10.0):
    _until(lambda: tid in p.w.producer._grants or tid in p.w.producer._by_tid and
           p.w.producer._by_tid[tid].grant is not None, timeout)


def _same(p, d, p_blocks, d_blocks, js):
    for j in js:
        assert torch.equal(d.raw[:, d_blocks[j]], p.raw[:, p_blocks[j]]), f"request block {j}"


# ------------------------------------------------------------------------------------ push
def test_grant_before_the_prefill_then_layer_by_layer_with_the_flag_last(pd):
    p, d = pd("kv_producer", seed=1), pd("kv_consumer")
    dec = Decoder(d)
    n, p_blocks, d_blocks = 40, [5, 6, 7], [20, 3, 11]
    before = d.raw.clone()
    dec.start(d1=_load("t1", p.engine, d_blocks, n))
    _granted(p, "t1")
    # one prefill step computes the whole prompt; the flag rides on the last layer's write
    sending, _, _ = p.step(HixlConnectorMetadata(sends={"p1": SendStep("t1", p_blocks, n, 0, 3, True)}))
    assert dec.wait("d1") is False
    _same(p, d, p_blocks, d_blocks, range(3))
    others = [b for b in range(BLOCKS) if b not in d_blocks]
    assert torch.equal(d.raw[:, others], before[:, others])
    # the prefill request finished: its blocks are given back once the push completed
    sending = _until(lambda: p.step(HixlConnectorMetadata(held={"p1": "t1"}), layers=False, finished={"p1"})[0])
    assert sending == {"p1"}
    st = p.w.stats.take().data
    assert st["send_bytes"] == [LAYERS * 3 * TOKENS * HEADS * 2 * HEAD * 4]
    assert st["send_descriptors"] == [LAYERS * 3]  # one per (layer, block): 20, 3, 11 are not adjacent
    assert st["send_exposed_s"][0] <= st["send_busy_s"][0]
    r = d.w.stats.take().data
    assert r["recv_tokens"] == [n] and r["recv_failed"] == 0


def test_a_grant_during_a_chunked_prefill_catches_up_then_goes_layer_by_layer(pd):
    p, d = pd("kv_producer", seed=2), pd("kv_consumer")
    dec = Decoder(d)
    n, p_blocks, d_blocks = 60, [1, 2, 3, 4], [9, 8, 7, 6]
    # chunk 1 (tokens 0..20: block 0 complete) runs before any grant
    p.step(HixlConnectorMetadata(sends={"p": SendStep("t", p_blocks[:2], n, 0, 1, False)}))
    # chunk 2 (tokens 20..50: blocks 1, 2 complete): the grant arrives after layer 1
    p.w.bind(HixlConnectorMetadata(sends={"p": SendStep("t", p_blocks, n, 1, 3, False)}))
    for i in range(2):
        p.w.save_kv_layer(f"model.layers.{i}.self_attn.attn")
    dec.start(d=_load("t", p.engine, d_blocks, n))
    _granted(p, "t")
    for i in range(2, LAYERS):
        p.w.save_kv_layer(f"model.layers.{i}.self_attn.attn")
    p.w.wait_for_save()
    assert "d" not in dec.poll()  # block 3 is not there yet: no flag
    p.step(HixlConnectorMetadata(sends={"p": SendStep("t", p_blocks, n, 3, 4, True)}))
    assert dec.wait("d") is False
    _same(p, d, p_blocks, d_blocks, range(4))


def test_a_grant_after_the_prefill_finished_gets_the_whole_request(pd):
    p, d = pd("kv_producer", seed=3), pd("kv_consumer")
    dec = Decoder(d)
    n, p_blocks, d_blocks = 33, [10, 11, 12], [1, 2, 3]
    p.step(HixlConnectorMetadata(sends={"p": SendStep("t", p_blocks, n, 0, 3, True)}))
    assert p.step(HixlConnectorMetadata(held={"p": "t"}), layers=False, finished={"p"})[0] == set()  # held
    dec.start(d=_load("t", p.engine, d_blocks, n))
    assert dec.wait("d") is False  # pushed whole by the prefill's inbox thread
    _same(p, d, p_blocks, d_blocks, range(3))
    assert _until(lambda: p.step(layers=False)[0]) == {"p"}


def test_a_decoder_prefix_hit_gets_only_the_blocks_it_lacks(pd):
    p, d = pd("kv_producer", seed=4), pd("kv_consumer")
    dec = Decoder(d)
    n, p_blocks, d_blocks = 64, [1, 2, 3, 4], [30, 31, 12, 13]
    before = d.raw.clone()
    dec.start(d=_load("t", p.engine, d_blocks[2:], n, first_block=2))
    _granted(p, "t")
    p.step(HixlConnectorMetadata(sends={"p": SendStep("t", p_blocks, n, 0, 4, True)}))
    assert dec.wait("d") is False
    _same(p, d, p_blocks, d_blocks, [2, 3])
    assert torch.equal(d.raw[:, [30, 31]], before[:, [30, 31]])  # the decoder's own blocks untouched
    assert d.w.stats.take().data["recv_tokens"] == [n - 2 * TOKENS]


def test_two_prefills_into_one_decoder_at_once(pd):
    p1, p2, d = pd("kv_producer", seed=5), pd("kv_producer", seed=6), pd("kv_consumer")
    dec = Decoder(d)
    dec.start(a=_load("ta", p1.engine, [1, 2], 30), b=_load("tb", p2.engine, [3, 4, 5], 40))
    _granted(p1, "ta")
    _granted(p2, "tb")
    p1.w.bind(HixlConnectorMetadata(sends={"x": SendStep("ta", [7, 8], 30, 0, 2, True)}))
    p2.w.bind(HixlConnectorMetadata(sends={"y": SendStep("tb", [7, 8, 9], 40, 0, 3, True)}))
    for i in range(LAYERS):  # interleaved, as two instances would be
        p1.w.save_kv_layer(f"model.layers.{i}.self_attn.attn")
        p2.w.save_kv_layer(f"model.layers.{i}.self_attn.attn")
    p1.w.wait_for_save()
    p2.w.wait_for_save()
    _until(lambda: {"a", "b"} <= dec.poll())
    assert not dec.failed
    _same(p1, d, [7, 8], [1, 2], range(2))
    _same(p2, d, [7, 8, 9], [3, 4, 5], range(3))


# ------------------------------------------------------------------------------------ pull
def test_pull_reads_the_prefill_blocks_and_releases_them(pd):
    p, d = pd("kv_producer", seed=7), pd("kv_consumer")
    dec = Decoder(d)
    n, p_blocks, d_blocks = 45, [4, 9, 2], [6, 7, 8]
    p.step(HixlConnectorMetadata(sends={"p": SendStep("t", p_blocks, n, 0, 3, True)}))
    p.step(HixlConnectorMetadata(held={"p": "t"}), layers=False, finished={"p"})
    src = {"remote_blocks": p_blocks}  # its memory map: learned with describe, once per peer
    dec.start(d=_load("t", p.engine, d_blocks, n, mode="pull", source=src))
    assert dec.wait("d") is False
    _same(p, d, p_blocks, d_blocks, range(3))
    assert _until(lambda: p.step(layers=False)[0]) == {"p"}  # released by the decoder, not by the lease
    assert d.w.stats.take().data["recv_pull"] == [1]


@NO_TRANSFER
def test_pull_of_a_foreign_layout_fails_with_the_reason(pd):
    p, d = pd("kv_producer", seed=8, head=HEAD * 2), pd("kv_consumer")  # its heads twice as wide
    dec = Decoder(d)
    src = {"remote_blocks": [1]}
    dec.start(d=_load("t", p.engine, [2], 10, mode="pull", source=src))
    assert dec.wait("d") is True
    assert d.w.stats.take().data["recv_failed"] == 1


# ------------------------------------------------------------------------------------ failures
def test_a_prefill_that_dies_fails_the_decoder_request_at_once(pd):
    p, d = pd("kv_producer", seed=9), pd("kv_consumer", timeout_s=60)
    dec = Decoder(d)
    dec.start(d=_load("t", p.engine, [1, 2], 20))
    _granted(p, "t")
    t0 = time.monotonic()
    p.close()  # finalize: the link closes
    assert dec.wait("d", timeout=10) is True
    assert time.monotonic() - t0 < 5  # not the 60 s timeout


def test_a_timeout_cancels_at_the_prefill_which_confirms(pd):
    p, d = pd("kv_producer", seed=10), pd("kv_consumer", timeout_s=0.5)
    dec = Decoder(d)
    # the prefill never schedules the request: the decoder times out, cancels, and the prefill confirms
    dec.start(d=_load("t", p.engine, [1, 2], 20))
    _granted(p, "t")
    t0 = time.monotonic()
    assert dec.wait("d", timeout=10) is True
    assert time.monotonic() - t0 < 4  # confirmed, not waiting out cancel_grace_s and closing the link
    assert p.w.linked(d.engine)
    # the prefill's request comes later: it is not served (the decoder's blocks are not its any more)
    before = d.raw.clone()
    p.step(HixlConnectorMetadata(sends={"p": SendStep("t", [3, 4], 20, 0, 2, True)}))
    assert _until(lambda: p.step(HixlConnectorMetadata(held={"p": "t"}), layers=False, finished={"p"})[0]) == {"p"}
    assert torch.equal(d.raw, before)
    assert d.w.stats.take().data["recv_timeouts"] == 1


def test_an_unconfirmed_cancel_closes_the_link(pd):
    p, d = pd("kv_producer", seed=11), pd("kv_consumer", timeout_s=0.3, cancel_grace_s=0.3)
    dec = Decoder(d)
    dec.start(d=_load("t", p.engine, [1, 2], 20))
    _granted(p, "t")
    p.w.producer.on_cancel = lambda tid, msg: None  # a prefill that never answers the cancel
    assert dec.wait("d", timeout=10) is True
    assert not d.w.linked(p.engine)


@NO_TRANSFER
def test_a_prefill_without_a_grant_frees_its_blocks_after_the_lease_and_aborts_a_late_grant(pd):
    p, d = pd("kv_producer", seed=12, lease_s=0.3), pd("kv_consumer", timeout_s=30)
    dec = Decoder(d)
    p.step(HixlConnectorMetadata(sends={"p": SendStep("t", [1], 10, 0, 1, True)}))
    p.step(HixlConnectorMetadata(held={"p": "t"}), layers=False, finished={"p"})
    assert _until(lambda: p.step(layers=False)[0], timeout=5) == {"p"}
    assert p.w.stats.take().data["send_expired"] == 1
    dec.start(d=_load("t", p.engine, [2], 10))
    t0 = time.monotonic()
    assert dec.wait("d") is True  # aborted by the prefill, not timed out
    assert time.monotonic() - t0 < 5


@NO_TRANSFER
def test_a_grant_for_another_block_interior_is_refused(pd):
    p, d = pd("kv_producer", seed=13), pd("kv_consumer", head=HEAD * 2)  # the decoder's heads twice as wide
    dec = Decoder(d)
    dec.start(d=_load("t", p.engine, [1], 10))
    assert dec.wait("d") is True


@NO_TRANSFER
def test_a_load_with_bad_params_fails_without_a_grant(pd):
    d = pd("kv_consumer")
    dec = Decoder(d)
    dec.start(d=_load("invalid", "", [1], 10))
    assert dec.wait("d") is True


# ------------------------------------------------------------------------------------ pieces
def test_config_defaults_environment_and_errors():
    c = ConnectorConfig.parse({}, env={})
    assert (c.mode, c.transport, c.port, c.timeout_s, c.lease_s) == ("push", "auto", 0, 120.0, 60.0)
    c = ConnectorConfig.parse({"mode": "pull"}, env={"HIXL_VLLM_MODE": "push", "HIXL_VLLM_PORT": "7000"})
    assert c.mode == "pull" and c.port == 7000  # the extra config wins, the environment fills in
    for extra, msg in [({"mode": "both"}, "mode"), ({"port": 70000}, r"port.*\[0, 65535\]"),
                       ({"timeout_s": "soon"}, "timeout_s"), ({"max_inflight": 1.5}, "integer"),
                       ({"transport": "udp"}, "transport"), ({"typo": 1}, "unknown"), ({"port": True}, "bool")]:
        with pytest.raises(ValueError, match=msg):
            ConnectorConfig.parse(extra, env={})
    with pytest.raises(ValueError, match=r"\$HIXL_VLLM_TIMEOUT_S"):
        ConnectorConfig.parse({}, env={"HIXL_VLLM_TIMEOUT_S": "-1"})


def test_messages_split_and_reassemble_a_long_grant():
    payload = json.dumps({"grant": {"blocks": list(range(2000))}})
    parts = messages.encode("grant", "tid-1", payload)
    assert len(parts) > 1 and all(len(m) <= messages.MAX_MSG for _, m in parts)
    r = messages.Reassembler()
    out = None
    for name, msg in parts:
        kind, tid, i, n = messages.decode_name(name)
        assert (kind, tid) == ("grant", "tid-1")
        out = r.add(tid, i, n, msg)
    assert out == json.loads(payload)
    assert messages.decode_name("hixl.vllm/grant/x/3/2") is None
    assert messages.decode_name("hixl.vllm/evil/x") is None
    assert messages.decode_name("other") is None
    with pytest.raises(ValueError):
        messages.encode("cancel", "bad tid with spaces")
    with pytest.raises(ValueError, match="not JSON"):
        r.add("t", 0, 1, "{")
    assert r.add("t2", 0, 3, "x", now=0.0) is None
    r.add("t3", 0, 2, "y", now=1000.0)  # t2 is past its time: dropped
    assert r.dropped == 1


def test_describe_kv_caches_knows_the_cpu_layout_and_refuses_others():
    raw, caches = _caches()
    names = sorted(caches)
    layout, mem, interior = describe_kv_caches(caches, names, BLOCKS, TOKENS, HEADS, HEAD)
    assert layout == kv.KVLayout(LAYERS, HEADS, HEAD, "float32", TOKENS)
    assert mem.parts == 1 and mem.unit_bytes == HEADS * TOKENS * 2 * HEAD * 4 and not mem.token_major
    assert mem.layer_addrs[1] == raw[1].data_ptr() and mem.ranges() == [(raw.data_ptr(), raw.nbytes)]
    assert interior == f"float32:packed({HEADS}, {TOKENS}, {2 * HEAD})"
    split = {n: torch.zeros((2, BLOCKS, TOKENS, HEADS, HEAD)) for n in names}  # K and V outermost
    _, mem2, _ = describe_kv_caches(split, names, BLOCKS, TOKENS, HEADS, HEAD)
    assert mem2.parts == 2 and mem2.part_stride == BLOCKS * TOKENS * HEADS * HEAD * 4
    with pytest.raises(NotImplementedError, match="not a layout it knows"):
        describe_kv_caches({n: torch.zeros((BLOCKS, 3)) for n in names}, names, BLOCKS, TOKENS, HEADS, HEAD)


def _request(rid, n, params, block_ids=None):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=n, kv_transfer_params=params)


def _blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _so(new=(), cached=(), scheduled=None):
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached], new_block_ids=[(b,) for _, b, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached], resumed_req_ids=set()),
        num_scheduled_tokens=scheduled or {}, total_num_scheduled_tokens=sum((scheduled or {}).values()))


def test_scheduler_plans_the_blocks_each_prefill_step_completes():
    s = HixlScheduler(ConnectorConfig(), [GroupSpec("full", TOKENS)], "kv_producer")
    s.set_handshake({0: HixlHandshake(engine="127.0.0.1:1")})
    req = _request("p", 70, {"do_remote_decode": True, "transfer_id": "t"})
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, _blocks([1, 2]), 0)
    m = s.build_connector_meta(_so(new=[("p", [1, 2], 0)], scheduled={"p": 20}))  # a chunk of 20
    assert (m.sends["p"].lo, m.sends["p"].hi, m.sends["p"].final) == (0, 1, False)
    m = s.build_connector_meta(_so(cached=[("p", [3, 4, 5], 20)], scheduled={"p": 50}))  # the rest
    st = m.sends["p"]
    assert (st.lo, st.hi, st.final, st.group_blocks()) == (1, 5, True, [[1, 2, 3, 4, 5]])
    hold, params = s.request_finished(req, [1, 2, 3, 4, 5])
    assert hold and params["remote_engine"] == "127.0.0.1:1" and params["remote_blocks"] == [1, 2, 3, 4, 5]
    assert s.has_pending_push_work() and s.build_connector_meta(_so()).held == {"p": "t"}
    s._held["p"] -= 10  # held long: no more stepping for it (its blocks go back at the next step anyway)
    assert not s.has_pending_push_work()
    s.update_connector_output(SimpleNamespace(finished_sending={"p"}))
    assert not s._held
    hold, params = s.request_finished(_request("q", 5, {"hixl_discover": True}), [9])
    assert not hold and params["remote_engine"] == "127.0.0.1:1"


def test_scheduler_loads_past_the_decoder_prefix_hit():
    s = HixlScheduler(ConnectorConfig(), [GroupSpec("full", TOKENS)], "kv_consumer")
    def params(tid):
        return {"do_remote_prefill": True, "transfer_id": tid, "remote_engine": "10.0.0.1:5", "mode": "push"}
    req = _request("d", 70, params("t"))
    assert s.get_num_new_matched_tokens(req, 32) == (38, True)  # two blocks cached here
    s.update_state_after_alloc(req, _blocks([7, 8, 9, 10, 11]), 38)
    assert s.get_num_new_matched_tokens(req, 32) == (0, False)  # staged once only
    m = s.build_connector_meta(_so())
    ld = m.loads["d"]
    assert (ld.first_block, ld.group_blocks(), ld.n_tokens, ld.peer) == (2, [[None, None, 9, 10, 11]], 70, "10.0.0.1:5")
    assert m.idle
    # a decoder holding the whole prompt tells the prefill not to wait for a grant
    req2 = _request("e", 70, params("t2"))
    s.update_state_after_alloc(req2, _blocks([1]), 0)
    assert s.build_connector_meta(_so()).cancels == {"t2": "10.0.0.1:5"}
