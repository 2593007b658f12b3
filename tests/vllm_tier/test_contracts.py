"""The routers' contracts on the scheduler side, without a vLLM server: what a prefill answers (NIXL's
fields and ours, no memory map), which request descriptions a decoder accepts (ours, NIXL's as vLLM's
proxies and vllm-router forward or rebuild them, Mooncake's, a rewritten remote_host), the bootstrap
endpoint (MooncakeBootstrapServer's answer shape, off with port 0, a busy port) and a decoder's
bootstrap lookups (found later, failing, timing out: the load fails, the scheduler never waits)."""
from __future__ import annotations

import json
import logging
import socket
import time
import urllib.request
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from hixl.vllm import contracts  # noqa: E402
from hixl.vllm.config import ConnectorConfig  # noqa: E402
from hixl.vllm.lookups import BootstrapLookups  # noqa: E402
from hixl.vllm.metadata import HixlHandshake  # noqa: E402
from hixl.vllm.specs import GroupSpec  # noqa: E402
from hixl.vllm.scheduler import HixlScheduler  # noqa: E402

TOKENS = 16
GROUPS = [GroupSpec("full", TOKENS)]
P0, P1 = "10.0.0.1:50123", "10.0.0.1:50124"
VLLM_ID = "c4f6e1a2-1b2c-4d5e-8f90-123456789abc"


def _request(rid, n, params):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=n, kv_transfer_params=params)


def _blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def _so(new=(), scheduled=None):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=scheduled or {}, total_num_scheduled_tokens=sum((scheduled or {}).values()))


def _prefill(engines=(P0,), mode="push", **cfg):
    s = HixlScheduler(ConnectorConfig(mode=mode, **cfg), GROUPS, "kv_producer", engine_id=VLLM_ID)
    s.set_handshake({r: HixlHandshake(engine=e) for r, e in enumerate(engines)})
    return s


def _decoder(mode="push", lookups=None, **cfg):
    return HixlScheduler(ConnectorConfig(mode=mode, **cfg), GROUPS, "kv_consumer", engine_id="dec", lookups=lookups)


def _finish_prefill(s, rid, params, n=155, blocks=tuple(range(100, 110))):
    req = _request(rid, n, params)
    s.update_state_after_alloc(req, _blocks([]), 0)
    s.build_connector_meta(_so(new=[(rid, list(blocks), 0)], scheduled={rid: n}))
    return s.request_finished(req, list(blocks))


def _load(d, params, rid="d", n=155, blocks=tuple(range(7, 17)), external=155):
    d.update_state_after_alloc(_request(rid, n, params), _blocks(blocks), external)
    return d.build_connector_meta(_so()).loads.get(rid)


# ---------------------------------------------------------------------------------- the prefill's answer
def test_the_prefill_answers_nixl_fields_and_ours_and_no_memory_map():
    s = _prefill()
    hold, a = _finish_prefill(s, "cmpl-1234567890abcdef-0", {"do_remote_decode": True, "transfer_id": "t-1"})
    assert hold
    assert {k: a[k] for k in ("do_remote_prefill", "do_remote_decode", "remote_request_id", "remote_block_ids",
                              "remote_host", "remote_port", "remote_num_tokens", "tp_size", "pp_size",
                              "transfer_mode")} == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": "t-1",
        "remote_block_ids": [list(range(100, 110))], "remote_host": "10.0.0.1", "remote_port": 50123,
        "remote_num_tokens": 155, "tp_size": 1, "pp_size": 1, "transfer_mode": "push"}
    assert {k: a[k] for k in ("transfer_id", "remote_engine", "remote_engines", "mode", "num_tokens",
                              "remote_blocks")} == {
        "transfer_id": "t-1", "remote_engine": P0, "remote_engines": [P0], "mode": "push", "num_tokens": 155,
        "remote_blocks": list(range(100, 110))}
    assert a["remote_engine_id"] == f"{VLLM_ID}@{P0}" and contracts.decode_engine_id(a["remote_engine_id"]) == [P0]
    assert "remote_memory" not in a and "remote_layout" not in a
    # the memory map alone used to be ~644 characters; the whole answer (NIXL's and our fields) is less
    assert len(json.dumps(a)) < 640, len(json.dumps(a))


def test_a_tp2_prefill_names_both_ranks_engines():
    s = _prefill(engines=(P0, P1))
    _, a = _finish_prefill(s, "r", {"do_remote_decode": True})
    assert a["tp_size"] == 2 and a["remote_engines"] == [P0, P1] and a["remote_engine"] == P0
    assert contracts.decode_engine_id(a["remote_engine_id"]) == [P0, P1]
    assert (a["remote_host"], a["remote_port"]) == ("10.0.0.1", 50123)


def test_set_handshake_takes_one_per_rank_and_refuses_pipeline_ranks():
    s = _prefill(engines=(P0, P1))
    assert s.engines == [P0, P1] and s.engine == P0
    with pytest.raises(NotImplementedError, match="pipeline"):
        s.set_handshake({(0, 0): HixlHandshake(engine=P0), (1, 0): HixlHandshake(engine=P1)})
    with pytest.raises(RuntimeError, match="TP ranks"):
        s.set_handshake({0: HixlHandshake(engine=P0), 2: HixlHandshake(engine=P1)})
    s.set_handshake({(0, 1): HixlHandshake(engine=P1), (0, 0): HixlHandshake(engine=P0)})
    assert s.engines == [P0, P1]


def test_the_prefill_takes_what_each_router_sends_it():
    s = _prefill()
    # vllm-router nixl mode (and vLLM's toy proxies): NIXL's fields, null; the transfer id is vLLM's request id
    nixl = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
    _, a = _finish_prefill(s, "cmpl-abc-0", nixl)
    assert a["transfer_id"] == a["remote_request_id"] == "cmpl-abc-0"
    # vllm-router mooncake mode: its transfer id
    _, a = _finish_prefill(s, "cmpl-def-0", {"do_remote_decode": True, "transfer_id": "mc-42"})
    assert a["transfer_id"] == a["remote_request_id"] == "mc-42"
    # vLLM's random suffix is not part of it: the decoder, given the same X-Request-Id, can name it
    _, a = _finish_prefill(s, "cmpl-ghi-0-1a2b3c4d", nixl)
    assert a["transfer_id"] == a["remote_request_id"] == "cmpl-ghi-0"
    # ids that are no transfer id (too long, odd characters) are hashed, the same way on both sides
    _, a = _finish_prefill(s, "x" * 200, {"do_remote_decode": True, "transfer_id": "a b/c"})
    assert a["transfer_id"] == contracts.transfer_id_of("a b/c") and a["transfer_id"].startswith("h-")
    _, a = _finish_prefill(s, "r e q", dict(nixl))
    assert a["remote_request_id"] == contracts.transfer_id_of("r e q")


# ---------------------------------------------------------------------------------- what a decoder accepts
def _answer(**cfg):
    return _finish_prefill(_prefill(**cfg), "cmpl-abc-0", {"do_remote_decode": True})[1]


def test_the_decoder_accepts_our_description():
    ld = _load(_decoder(), {"do_remote_prefill": True, "transfer_id": "t", "remote_engine": P0, "mode": "push"})
    assert (ld.transfer_id, ld.mode, ld.peer, ld.peers, ld.remote_tp) == ("t", "push", P0, [P0], 1)
    assert (ld.first_block, ld.group_blocks(), ld.source) == (0, [list(range(7, 17))], None)


def test_the_decoder_accepts_the_whole_answer_forwarded_as_vllm_router_nixl_mode_does():
    a = _answer()
    ld = _load(_decoder(mode="pull"), dict(a))  # the answer's mode (push) wins over the decoder's
    assert (ld.transfer_id, ld.mode, ld.peers) == ("cmpl-abc-0", "push", [P0])
    ld = _load(_decoder(), dict(_answer(mode="pull")))
    assert ld.mode == "pull" and ld.source == {"remote_blocks": [list(range(100, 110))]}


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_decoder_accepts_only_nixl_fields_as_vllm_push_proxy_rebuilds_them(mode):
    a = _answer(engines=(P0, P1))
    kept = {k: a[k] for k in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")}
    ld = _load(_decoder(mode=mode), {"do_remote_prefill": True, "do_remote_decode": False, **kept})
    # no mode in NIXL's fields: the decoder's own; no block ids: pull becomes push (the prefill holds them)
    assert (ld.transfer_id, ld.mode, ld.peers, ld.peer, ld.remote_tp) == ("cmpl-abc-0", "push", [P0, P1], P0, 2)
    nixl_pull = {k: a[k] for k in ("remote_engine_id", "remote_request_id", "remote_block_ids", "tp_size")}
    ld = _load(_decoder(mode=mode), {"do_remote_prefill": True, **nixl_pull}, rid="e")
    assert ld.mode == mode and (ld.source == {"remote_blocks": [list(range(100, 110))]} if mode == "pull" else True)


def test_a_rewritten_remote_host_does_not_hide_the_hixl_engine():
    a = _answer()
    rewritten = {k: a[k] for k in ("remote_engine_id", "remote_request_id", "remote_port", "tp_size")}
    ld = _load(_decoder(), {"do_remote_prefill": True, "remote_host": "prefill.svc.cluster.local", **rewritten})
    assert ld.peers == [P0]
    # without our engine id, remote_host and remote_port are all there is
    ld = _load(_decoder(), {"do_remote_prefill": True, "remote_request_id": "t2", "remote_engine_id": VLLM_ID,
                            "remote_host": "10.0.0.9", "remote_port": 7000, "tp_size": 1}, rid="e")
    assert ld.peers == ["10.0.0.9:7000"]


def test_the_decoder_accepts_mooncakes_description_naming_our_engine_id():
    ld = _load(_decoder(), {"do_remote_prefill": True, "transfer_id": "mc-42",
                            "remote_bootstrap_addr": "http://10.0.0.1:8998", "remote_engine_id": f"{VLLM_ID}@{P0}"})
    assert (ld.transfer_id, ld.peers) == ("mc-42", [P0])


def test_descriptions_the_decoder_cannot_use_fail_the_load_with_the_reason(caplog):
    d = _decoder()
    caplog.set_level(logging.WARNING, "hixl.vllm")
    for i, p in enumerate([{"remote_engine": P0},  # no transfer id
                           {"transfer_id": "t", "remote_engine": P0, "mode": "both"},
                           {"transfer_id": "t", "remote_engine_id": VLLM_ID},  # no engine anywhere
                           {"remote_request_id": "t", "remote_engine_id": f"{VLLM_ID}@{P0}", "tp_size": 2}]):
        ld = _load(d, {"do_remote_prefill": True, **p}, rid=f"r{i}")
        assert ld.peer == "" and ld.peers == [], p  # the worker fails it at once: kv_load_failure_policy
    text = caplog.text
    assert "no transfer id" in text and "'both'" in text and "no hixl engine" in text and "tp_size 2" in text


def test_a_decoder_holding_the_whole_prompt_cancels_at_every_prefill_rank():
    d = _decoder()
    a = _answer(engines=(P0, P1))
    d.update_state_after_alloc(_request("d", 155, dict(a)), _blocks([1]), 0)
    m = d.build_connector_meta(_so())
    assert m.cancels == {"cmpl-abc-0": [P0, P1]} and not m.loads  # every prefill rank hears it


# ---------------------------------------------------------------------------------- the bootstrap endpoint
def _get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(engines=(P0, P1), **cfg):
    s = _prefill(engines=engines, host="127.0.0.1", bootstrap_port=_free_port(), **cfg)
    srv = s.serve_bootstrap()
    return s, srv, f"http://127.0.0.1:{srv.port}"


def _vllms_own_answer(engine_id, engines):
    """What vLLM's MooncakeBootstrapServer answers once the ranks registered ``engines``."""
    utils = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils")
    srv = utils.MooncakeBootstrapServer("127.0.0.1", 0)
    srv.start()
    try:
        for r, e in enumerate(engines):
            req = urllib.request.Request(f"http://127.0.0.1:{srv.port}/register", method="POST",
                                         headers={"Content-Type": "application/json"},
                                         data=json.dumps({"engine_id": engine_id, "dp_rank": 0, "tp_rank": r,
                                                          "pp_rank": 0, "addr": e}).encode())
            urllib.request.urlopen(req, timeout=5).read()
        return _get(f"http://127.0.0.1:{srv.port}/query")
    finally:
        srv.shutdown()


def test_the_bootstrap_endpoint_answers_as_mooncakes_does():
    s, srv, url = _serving()
    try:
        got = _get(url + "/query")
        assert got == {"0": {"engine_id": f"{VLLM_ID}@{P0},{P1}", "worker_addr": {"0": {"0": P0}, "1": {"0": P1}}}}
        assert got == _vllms_own_answer(f"{VLLM_ID}@{P0},{P1}", [P0, P1])
        assert contracts.engines_from_query(got, f"{VLLM_ID}@{P0},{P1}") == [P0, P1]
        with pytest.raises(urllib.error.HTTPError, match="404"):
            _get(url + "/register")
    finally:
        s.close()


def test_the_bootstrap_endpoint_names_no_engine_before_the_workers_handshake():
    s = HixlScheduler(ConnectorConfig(host="127.0.0.1", bootstrap_port=_free_port()), GROUPS, "kv_both",
                      engine_id=VLLM_ID)
    url = f"http://127.0.0.1:{s.serve_bootstrap().port}/query"
    try:
        assert _get(url) == {}
        s.set_handshake({0: HixlHandshake(engine=P0)})
        assert _get(url)["0"]["worker_addr"] == {"0": {"0": P0}}
    finally:
        s.close()
    with pytest.raises(OSError):
        _get(url, timeout=2)  # closed


def test_the_bootstrap_endpoint_is_off_with_port_0_and_on_decoders():
    assert _prefill(bootstrap_port=0).serve_bootstrap() is None
    d = HixlScheduler(ConnectorConfig(bootstrap_port=_free_port()), GROUPS, "kv_consumer")
    assert d.serve_bootstrap() is None
    assert ConnectorConfig.parse({}, env={}).bootstrap_port is None  # 8998 when free
    assert ConnectorConfig.parse({}, env={"HIXL_VLLM_BOOTSTRAP_PORT": "0"}).bootstrap_port == 0
    with pytest.raises(ValueError, match="bootstrap_port"):
        ConnectorConfig.parse({"bootstrap_port": 70000}, env={})


def test_a_busy_bootstrap_port_is_a_start_up_error_naming_it():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        s = _prefill(host="127.0.0.1", bootstrap_port=port)
        with pytest.raises(RuntimeError, match=rf"127\.0\.0\.1:{port} \(it is in use\).*'bootstrap_port'.*"
                                               r"HIXL_VLLM_BOOTSTRAP_PORT"):
            s.serve_bootstrap()


def test_the_default_bootstrap_port_busy_is_a_warning_not_an_error(monkeypatch, caplog):
    """A second prefill on one host with the defaults: it starts, without the endpoint, and says so."""
    from hixl.vllm import scheduler as sched_mod
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setattr(sched_mod, "DEFAULT_BOOTSTRAP_PORT", busy.getsockname()[1])
        s = _prefill(host="127.0.0.1")
        with caplog.at_level(logging.WARNING, logger="hixl.vllm"):
            assert s.serve_bootstrap() is None
        assert "it is in use" in caplog.text and "Serving no bootstrap endpoint" in caplog.text, caplog.text
        s.close()


# ---------------------------------------------------------------------------------- a decoder's lookups
def _mooncake(addr, engine_id=VLLM_ID, tid="mc-1"):
    return {"do_remote_prefill": True, "transfer_id": tid, "remote_bootstrap_addr": addr, "remote_engine_id": engine_id}


def _until_load(d, rid, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = d.build_connector_meta(_so())
        if rid in m.loads:
            return m.loads[rid]
        time.sleep(0.01)
    raise AssertionError(f"no load for {rid} within {timeout} s")


def test_a_mooncake_description_is_looked_up_at_the_bootstrap_endpoint_off_the_scheduler_loop():
    s, srv, url = _serving()
    asked = []

    def fetch(u, timeout_s):
        asked.append(u)
        time.sleep(0.2)  # a slow endpoint: the scheduler goes on meanwhile
        return _get(u, timeout_s)

    try:
        d = _decoder(lookups=BootstrapLookups(timeout_s=2.0, refresh_s=60.0, fetch=fetch))
        t0 = time.monotonic()
        d.update_state_after_alloc(_request("d", 155, _mooncake(url)), _blocks(range(7, 17)), 155)
        assert not d.build_connector_meta(_so()).loads and time.monotonic() - t0 < 0.15
        ld = _until_load(d, "d")
        assert (ld.transfer_id, ld.peers, ld.peer, ld.remote_tp) == ("mc-1", [P0, P1], P0, 2)
        # cached per address: the next request loads in the same step
        d.update_state_after_alloc(_request("e", 155, _mooncake(url, tid="mc-2")), _blocks([1]), 155)
        assert d.build_connector_meta(_so()).loads["e"].peers == [P0, P1]
        assert asked == [url + "/query"]
    finally:
        s.close()


def test_a_bootstrap_endpoint_that_is_down_fails_the_load_cleanly(caplog):
    caplog.set_level(logging.WARNING, "hixl.vllm")
    d = _decoder(lookups=BootstrapLookups(timeout_s=2.0))
    addr = f"127.0.0.1:{_free_port()}"  # nothing listens
    d.update_state_after_alloc(_request("d", 155, _mooncake(addr)), _blocks([1]), 155)
    ld = _until_load(d, "d")
    assert ld.peer == "" and ld.transfer_id == "mc-1"
    assert f"GET http://{addr}/query failed" in caplog.text and "request d: nothing to load" in caplog.text


def test_a_bootstrap_endpoint_that_never_answers_fails_the_load_after_the_timeout(caplog):
    caplog.set_level(logging.WARNING, "hixl.vllm")
    with socket.socket() as mute:  # accepts connections (the backlog), never answers
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        d = _decoder(lookups=BootstrapLookups(timeout_s=0.3))
        t0 = time.monotonic()
        d.update_state_after_alloc(_request("d", 155, _mooncake(f"127.0.0.1:{mute.getsockname()[1]}")),
                                   _blocks([1]), 155)
        assert time.monotonic() - t0 < 0.2  # the scheduler did not wait
        ld = _until_load(d, "d", timeout=5.0)
        assert ld.peer == "" and 0.25 < time.monotonic() - t0 < 3.0
    assert "timed out" in caplog.text


def test_a_request_aborted_during_its_lookup_still_reaches_the_worker_failed():
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        d = _decoder(lookups=BootstrapLookups(timeout_s=5.0))
        req = _request("d", 155, _mooncake(f"127.0.0.1:{mute.getsockname()[1]}"))
        d.update_state_after_alloc(req, _blocks([1]), 155)
        assert not d.build_connector_meta(_so()).loads
        assert d.request_finished(req, []) == (False, None)
        ld = d.build_connector_meta(_so()).loads["d"]  # vLLM frees its blocks once the worker reports it
        assert ld.peer == ""


def test_engines_from_a_query_answer():
    answer = {"0": {"engine_id": "a", "worker_addr": {"1": {"0": P1}, "0": {"0": P0}}},
              "1": {"engine_id": "b", "worker_addr": {"0": {"0": "10.0.0.2:1"}}}}
    assert contracts.engines_from_query(answer, "a") == [P0, P1]
    assert contracts.engines_from_query(answer, "b") == ["10.0.0.2:1"]
    with pytest.raises(ValueError, match="no engine 'c'"):
        contracts.engines_from_query(answer, "c")
    assert contracts.engines_from_query({"0": answer["0"]}, "other") == [P0, P1]  # the only one
    with pytest.raises(ValueError, match="TP ranks"):
        contracts.engines_from_query({"0": {"engine_id": "a", "worker_addr": {"1": {"0": P1}}}}, "a")
    with pytest.raises(ValueError, match="names no engine"):
        contracts.engines_from_query({}, "a")


def test_addresses_and_engine_ids():
    assert contracts.split_addr("[::1]:5") == ("::1", 5) and contracts.split_addr("h:1") == ("h", 1)
    for bad in ("h", "h:0", "h:x", ":5", "::1:5", "a,b:5", None):
        assert not contracts.valid_addr(bad)
    assert contracts.decode_engine_id(f"x@y@{P0},[::1]:7") == [P0, "[::1]:7"]
    for bad in (VLLM_ID, f"{VLLM_ID}@", f"{VLLM_ID}@nope", None, 5):
        assert contracts.decode_engine_id(bad) is None
    assert contracts.transfer_id_of("ok-1") == "ok-1" and contracts.transfer_id_of("") is None
    assert contracts.transfer_id_of("x y") == contracts.transfer_id_of("x y") != contracts.transfer_id_of("x z")


def test_vllm_routers_rebuilt_params_name_the_transfer_by_the_shared_request_id():
    """vllm-router's nixl mode gives the prefill and the decoder the same X-Request-Id and rebuilds the
    decoder's params: remote_request_id is its own id, not the prefill's answer. Both vLLMs make
    ``cmpl-<X>-0-<8 random hex>`` of it: the prefill's transfer id and the decoder's agree."""
    xid = "___prefill_addr_127.0.0.1:8100___decode_addr_127.0.0.1:8200_0123456789abcdef0123456789abcdef"
    s = _prefill()
    _, a = _finish_prefill(s, f"cmpl-{xid}-0-1a2b3c4d", {"do_remote_decode": True, "do_remote_prefill": False,
                                                          "remote_engine_id": None, "remote_block_ids": None,
                                                          "remote_host": None, "remote_port": None})
    rebuilt = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": a["remote_engine_id"],
               "remote_host": a["remote_host"], "remote_port": a["remote_port"], "tp_size": 1,
               "remote_request_id": xid}
    spec = _load(_decoder(), rebuilt, rid=f"cmpl-{xid}-0-9f8e7d6c")
    assert spec is not None and spec.transfer_id == a["transfer_id"] == f"cmpl-{xid}-0"
    # the answer passed on as it is (hixl proxy, vLLM's toy proxy): its transfer id, whatever the decoder's id
    spec = _load(_decoder(), {k: a[k] for k in ("do_remote_prefill", "remote_engine_id", "remote_host",
                                                "remote_port", "tp_size", "remote_request_id")}, rid="other-1")
    assert spec is not None and spec.transfer_id == a["transfer_id"]
