"""`hixl bench` (python -m hixl_tools.bench): the report files, their columns and units, the ratio table,
argument errors (exit code 2), and a tiny rdma sweep against perftest (marked rdma: the rxe VM)."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hixl_tools import bench

# Tiny and fast: two sizes, few iterations, short time budgets.
TINY = ["--sizes", "8,4K", "--lat-iters", "20", "--bw-bytes", "256K", "--trials", "1", "--budget-s", "0.2",
        "--no-progress"]
UNIT_HEADERS = ["size[B]", "lat_med[us]", "lat_p99[us]", "bw_med[MiB/s]", "bw_min[MiB/s]", "descs[#]",
                "window[#req]", "threads[#]", "rate[Mdesc/s]", "req_p99[us]"]


def _bench(args, timeout=300):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "hixl_tools.bench", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _ok(cp):
    assert cp.returncode == 0, "rc=%d\nstdout:\n%s\nstderr:\n%s" % (cp.returncode, cp.stdout[-4000:], cp.stderr[-4000:])
    return cp


def _files(out: Path, name: str):
    return {k: out / (name + ext) for k, ext in (("txt", ".txt"), ("json", ".json"), ("csv", ".csv"),
                                                   ("ratios", "_ratios.csv"), ("bw", "_bw.png"), ("lat", "_lat.png"))}


def test_shm_tcp_sweep_writes_table_json_csv(tmp_path):
    cp = _ok(_bench(["--transport", "shm,tcp", "--op", "write,read", *TINY, "--no-plots",
                     "--out", str(tmp_path), "--name", "t"]))
    f = _files(tmp_path, "t")
    for k in ("txt", "json", "csv", "ratios"):
        assert f[k].is_file(), k
    assert not f["bw"].exists() and not f["lat"].exists()  # --no-plots
    # The table: units in every numeric header, the unit legend, one row per configuration.
    out = cp.stdout
    assert "MiB = 2^20 B" in out and "== hixl ==" in out
    header = next(line for line in out.splitlines() if line.startswith("transport"))
    for h in UNIT_HEADERS:
        assert h in header, h
    assert f["txt"].read_text().strip() == out.strip()
    # JSON: every configuration with median and p99, units spelled out.
    doc = json.loads(f["json"].read_text())
    assert "2^20" in doc["units"]["bw"] and "us" in doc["units"]["lat"]
    rows = doc["rows"]
    assert {(r["transport"], r["op"], r["size_B"]) for r in rows} == \
        {(t, o, s) for t in ("shm", "tcp") for o in ("write", "read") for s in (8, 4096)}
    for r in rows:
        assert r["path"] == "engine" and r["descs"] == 1 and r["window"] == 128 and r["threads"] == 1
        assert 0 < r["lat_med_us"] <= r["lat_p99_us"]
        assert r["bw_med_MiBps"] > 0 and r["bw_min_MiBps"] <= r["bw_med_MiBps"]
    assert doc["ratios"] == [] and doc["peers"] == []
    assert [g["status"] for g in doc["goals"]] == ["not measured"] * 5
    # CSV: the same columns as the table (with units), one line per row.
    with open(f["csv"]) as fh:
        table = list(csv.reader(fh))
    for h in UNIT_HEADERS:
        assert h in table[0], h
    assert len(table) == 1 + len(rows)
    assert table[0][0] == "impl" and {line[0] for line in table[1:]} == {"hixl"}


def test_sweep_dimensions_descs_window_threads_python_path(tmp_path):
    _ok(_bench(["--transport", "tcp", "--op", "write_imm", "--path", "engine,python", "--descs", "1,4",
                "--window", "1,8", "--threads", "1,2", *TINY, "--sizes", "4K", "--no-plots",
                "--out", str(tmp_path)]))
    doc = json.loads((tmp_path / "hixl_bench.json").read_text())
    keys = {(r["path"], r["descs"], r["window"], r["threads"]) for r in doc["rows"]}
    assert keys == {(p, d, w, t) for p in ("engine", "python") for d in (1, 4) for w in (1, 8) for t in (1, 2)}
    assert all(r["op"] == "write_imm" and r["bw_med_MiBps"] > 0 for r in doc["rows"])


def _check_plots(cp, f):
    if importlib.util.find_spec("matplotlib") is None:
        assert "plots skipped: matplotlib is not installed" in cp.stdout
    else:
        for k in ("bw", "lat"):
            assert f[k].is_file() and f[k].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_into_tmp_path_or_skip_message(tmp_path):
    cp = _ok(_bench(["--transport", "shm", *TINY, "--out", str(tmp_path), "--name", "p"]))
    _check_plots(cp, _files(tmp_path, "p"))


def test_report_again_from_json(tmp_path):
    """--no-plots where plotting is slow (the rxe VM), then the plots from the JSON elsewhere."""
    first = _ok(_bench(["--transport", "tcp", *TINY, "--no-plots", "--out", str(tmp_path), "--name", "r"]))
    f = _files(tmp_path, "r")
    assert not f["bw"].exists()
    rows = json.loads(f["json"].read_text())["rows"]
    again = _ok(_bench(["--from-json", str(f["json"])]))
    _check_plots(again, f)
    assert json.loads(f["json"].read_text())["rows"] == rows
    table = lambda out: out.split("== hixl ==")[1].split("\n\n")[0]  # noqa: E731
    assert table(again.stdout) == table(first.stdout)


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="mooncake-transfer-engine not installed")
def test_ratio_table_vs_mooncake_tcp(tmp_path):
    cp = _ok(_bench(["--transport", "tcp", "--vs", "mooncake-tcp", *TINY, "--no-plots", "--out", str(tmp_path)]))
    assert "== peers (same run) ==" in cp.stdout and "== ratio: ours / peer" in cp.stdout
    doc = json.loads((tmp_path / "hixl_bench.json").read_text())
    assert {(p["peer"], p["protocol"], p["size_B"]) for p in doc["peers"]} == {("mooncake", "tcp", 8),
                                                                                ("mooncake", "tcp", 4096)}
    rat = doc["ratios"]
    assert {r["size_B"] for r in rat} == {8, 4096}
    for r in rat:
        assert r["peer"] == "mooncake-tcp" and r["bw_ratio"] > 0 and r["lat_ratio"] > 0
        assert r["bw_ratio"] == pytest.approx(r["ours_bw_MiBps"] / r["peer_bw_MiBps"])
    with open(tmp_path / "hixl_bench_ratios.csv") as fh:
        table = list(csv.reader(fh))
    assert "bw_ours/peer[x]" in table[0] and "lat_ours/peer[x]" in table[0] and len(table) == 1 + len(rat)


@pytest.mark.skipif(bench.peers.nixl_unavailable() is not None, reason="NIXL (nixl-cu12) not installed")
def test_ratio_table_vs_nixl_tcp(tmp_path):
    """NIXL's UCX backend over tcp against our tcp transport, on the same sizes, in the same run."""
    cp = _ok(_bench(["--transport", "tcp", "--vs", "nixl", *TINY, "--no-plots", "--out", str(tmp_path)]))
    doc = json.loads((tmp_path / "hixl_bench.json").read_text())
    assert not [n for n in doc["notes"] if "nixl" in n], doc["notes"]
    got = {(p["peer"], p["protocol"], p["ucx_tls"], p["size_B"]) for p in doc["peers"]}
    assert got == {("nixl", "tcp", "tcp,self", 8), ("nixl", "tcp", "tcp,self", 4096)}
    assert all(p["bw_med_MiBps"] > 0 and p["lat_med_us"] > 0 for p in doc["peers"])
    assert {(r["peer"], r["size_B"]) for r in doc["ratios"]} == {("nixl-tcp", 8), ("nixl-tcp", 4096)}
    assert "nixl-tcp" in cp.stdout.split("== ratio: ours / peer")[1]


def test_nixl_absent_is_a_note_not_a_failure(tmp_path, monkeypatch):
    """Without NIXL the run still succeeds and says why the peer is missing."""
    monkeypatch.setattr(bench.peers, "_nixl_api", lambda: None)
    res = bench.run(bench.resolve(bench.build_parser().parse_args(
        ["--transport", "tcp", "--vs", "nixl", *TINY, "--sizes", "8", "--no-pin"])))
    assert res["peers"] == [] and any(n.startswith("nixl-tcp skipped: NIXL not importable") for n in res["notes"])


def test_hixl_bench_subcommand(capsys):
    """`hixl bench` (the console script) dispatches to hixl_tools.bench with its own usage errors."""
    from hixl.cli import main as hixl_main
    assert hixl_main(["bench", "--help"]) == 0
    assert "--vs" in capsys.readouterr().out
    assert hixl_main(["bench", "--op", "send"]) == 2
    assert "hixl bench: error:" in capsys.readouterr().err



def test_hixl_tool_commands_without_hixl_tools(capsys, monkeypatch):
    """Without hixl-tools' entry points, `hixl bench|demo|model` say how to install them and exit 2."""
    import hixl.cli
    monkeypatch.setattr(hixl.cli, "entry_points", lambda: {})
    for cmd in ("bench", "demo", "model"):
        assert hixl.cli.main([cmd, "--help"]) == 2
        assert "hixl %s comes with hixl-tools" % cmd in capsys.readouterr().err
    assert hixl.cli.main(["--help"]) == 0  # the rest of the command line is the library's

@pytest.mark.parametrize("args, message", [
    (["--sizes", "0"], "out of range"),
    (["--sizes", "4Q"], "bad size"),
    (["--op", "send"], "unknown 'send'"),
    (["--descs", "5000"], "--descs must be integers in 1..4096"),
    (["--window", "x"], "--window"),
    (["--qps", "17"], "--qps must be 1..16"),
    (["--threads", "0"], "--threads"),
    (["--transport", "ib"], "unknown 'ib'"),
    (["--path", "endpoint", "--transport", "tcp"], "rdma only"),
    (["--vs", "gloo"], "unknown 'gloo'"),
    (["--budget-s", "0"], "--budget-s"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--serve", "--server-ip", "127.0.0.1"], "exclude each other"),
    (["--from-json", "/nonexistent/x.json"], "not a hixl bench JSON"),
])
def test_bad_arguments_exit_2(capsys, args, message):
    assert bench.main(args) == 2
    err = capsys.readouterr().err
    assert "hixl bench: error:" in err and message in err


def test_bad_arguments_exit_code_from_the_command_line():
    cp = _bench(["--sizes", "-5"])
    assert cp.returncode == 2 and "error:" in cp.stderr and cp.stdout == ""


@pytest.mark.skipif(bench.active_rdma(), reason="an RDMA device is active here")
def test_rdma_without_a_device_is_a_clear_usage_error(capsys):
    assert bench.main(["--transport", "rdma"]) == 2
    assert "no RDMA device with an ACTIVE port" in capsys.readouterr().err


def test_size_lists_and_ranges():
    assert bench.parse_sizes("8,4K,1M") == [8, 4096, 1 << 20]
    assert bench.parse_sizes("1K-8K") == [1024, 2048, 4096, 8192]
    assert bench.parse_sizes("8-512:x4") == [8, 32, 128, 512]
    assert bench.parse_sizes("64MiB,64M") == [64 << 20]
    assert bench.main(["--help"]) == 0


@pytest.mark.rdma
def test_rdma_sweep_vs_perftest(tmp_path):
    if shutil.which("ib_write_bw") is None:
        pytest.skip("perftest not installed")
    cp = _ok(_bench(["--transport", "rdma", "--vs", "perftest", *TINY, "--sizes", "8,4K", "--no-goals",
                     "--no-plots", "--out", str(tmp_path)], timeout=600))
    doc = json.loads((tmp_path / "hixl_bench.json").read_text())
    rows = {(r["path"], r["size_B"]): r for r in doc["rows"]}
    assert set(rows) == {(p, s) for p in ("endpoint", "engine") for s in (8, 4096)}
    for s in (8, 4096):
        assert rows[("endpoint", s)]["half_rtt_med_us"] > 0  # the ib_write_lat-style ping-pong
    assert {(p["peer"], p["size_B"]) for p in doc["peers"]} == {("perftest", 8), ("perftest", 4096)}
    for p in doc["peers"]:
        # perftest ran every round and its lines were read. Its values themselves are not judged: with 20
        # iterations in a busy TCG guest it prints 0.00 MB/s and "inf" latencies (a null here), honestly.
        assert (p["tool_lat"], p["tool_bw"]) == ("ib_write_lat", "ib_write_bw"), p
        assert len(p["lat_rounds_us"]) == 5 and len(p["bw_calls"]) == len(p["bw_rounds_MiBps"]) >= 1, p
        assert all(v is None or v > 0 for v in p["lat_rounds_us"]), p
        assert all(v is None or v >= 0 for v in p["bw_rounds_MiBps"] + [p["bw_med_MiBps"]]), p
    half = [r for r in doc["ratios"] if r["lat_metric"].startswith("half RTT")]
    assert {r["size_B"] for r in half} == {8, 4096}
    assert all(r["lat_ratio"] is None or r["lat_ratio"] > 0 for r in half), half
    assert "== ratio: ours / peer" in cp.stdout


PERFTEST_BW_OUT = """
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 4096       5000             1060.23            1059.88              0.271330
---------------------------------------------------------------------------------------
"""
PERFTEST_LAT_OUT = """
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]
 8       1000          2.01           10.48        2.09                2.12             0.23            3.15                    inf
"""


def test_perftest_result_lines_are_read_by_column():
    from hixl_tools.bench import peers
    assert peers.parse_perftest("ib_write_bw", PERFTEST_BW_OUT, 4096) == {
        "bw_med_MiBps": 1059.88, "bw_peak_MiBps": 1060.23, "msg_rate_Mpps": 0.27133, "bw_calls": [5000]}
    lat = peers.parse_perftest("ib_write_lat", PERFTEST_LAT_OUT, 8)
    assert (lat["lat_med_us"], lat["lat_p99_us"], lat["lat_iters"]) == (2.09, 3.15, 1000)
    with pytest.raises(RuntimeError, match="could not parse ib_write_lat"):
        peers.parse_perftest("ib_write_lat", PERFTEST_LAT_OUT, 4096)  # no line for that size


def test_bench_server_runs_only_what_the_bench_needs():
    """The bench server (no authentication, like perftest) must not be a remote shell: only perftest's
    tools with their flags, MC_* settings for Mooncake, bounded buffers."""
    from hixl_tools.bench import server as srv
    ok = ["ib_write_bw", "-d", "rxe0", "-x", "1", "-s", "4096", "-n", "100", "-F", "-p", "18515", "-t", "128"]
    assert srv.checked_perftest_args(ok) == ok
    for bad in (["sh", "-c", "id"], ["ib_write_bw", "-p", "1", "--run_infinitely"], ["ib_write_bw", "-d", "x;id"],
                ["ib_write_bw", "-p", "1", "-d"], ["/usr/bin/ib_write_bw", "-p", "1"], ["ib_write_bw", "-s", "8"],
                "ib_write_bw -p 1", [], ["ib_write_bw", "-p", 5]):
        with pytest.raises(ValueError):
            srv.checked_perftest_args(bad)
    assert srv.checked_mooncake_env({"MC_GID_INDEX": "1", "MC_LOG_LEVEL": "ERROR"}) == {"MC_GID_INDEX": "1",
                                                                                       "MC_LOG_LEVEL": "ERROR"}
    for bad in ({"LD_PRELOAD": "/tmp/x.so"}, {"MC_X": "a b"}, {"MC_X": 1}, ["MC_X"]):
        with pytest.raises(ValueError):
            srv.checked_mooncake_env(bad)
    assert srv.checked_bytes(4096) == 4096
    for bad in (0, -1, 1 << 40, "4096", True, 1.5):
        with pytest.raises(ValueError):
            srv.checked_bytes(bad)


def test_bench_server_refuses_a_bad_command_over_the_wire(tmp_path):
    """Through the real JSON-lines protocol: an error reply, and the server keeps serving."""
    import subprocess as sp
    from hixl_tools.bench.server import Ctl
    proc = sp.Popen([sys.executable, "-m", "hixl_tools.bench", "--serve", "--once", "--listen", "127.0.0.1:0"],
                    stdout=sp.PIPE, stdin=sp.DEVNULL, text=True)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        ctl = Ctl("127.0.0.1", port)
        marker = tmp_path / "pwned"
        with pytest.raises(RuntimeError, match="must be one of"):
            ctl.call("perftest", args=["sh", "-c", "touch %s" % marker])
        with pytest.raises(RuntimeError, match="not allowed"):
            ctl.call("mooncake_target", protocol="tcp", bytes=4096, device="", env={"LD_PRELOAD": str(marker)})
        with pytest.raises(RuntimeError, match="bytes must be"):
            ctl.call("engine_target", transport="tcp", bytes=1 << 40)
        assert ctl.call("hello")  # still serving
        ctl.close()
        assert proc.wait(30) == 0
        assert not marker.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_desc_sweep_three_ways_and_nixl_prepped(tmp_path):
    """--desc-sweep: lists, descriptor arrays and prepared lists (and NIXL's prepared path over tcp)
    for each count and size asked, with units in every column header, JSON beside the table, the
    single-request comparison and the goals."""
    cp = _ok(_bench(["--desc-sweep", "--transport", "shm,tcp", "--vs", "nixl", "--descs", "1,1000",
                     "--sizes", "64", "--quick", "--out", str(tmp_path)], timeout=600))
    doc = json.loads((tmp_path / "hixl_descs.json").read_text())
    got = {(r["transport"], r["way"], r["count"]) for r in doc["rows"]}
    want = {(t, w, c) for t in ("shm", "tcp") for w in ("list", "numpy", "prepped") for c in (1, 1000)}
    assert want <= got
    if not doc["notes"]:  # NIXL installed (CI): its prepared path is measured too
        assert {("tcp", "nixl-prepped", 1), ("tcp", "nixl-prepped", 1000)} <= got
    assert all(0 < r["submit_med_us"] <= r["total_med_us"] for r in doc["rows"])
    assert {s["transport"] for s in doc["single"]} == {"shm", "tcp"}
    assert all(s["cpp_Mreq_s"] > 0 and s["python_Mreq_s"] > 0 for s in doc["single"])
    for s in doc["single"]:  # the ceiling is the C++ loop's time plus the no-op bindings' loop's
        assert s["binding_Mreq_s"] > 0 and s["floor_Mreq_s"] > 0
        assert s["ceiling/cpp"] == pytest.approx(s["floor_Mreq_s"] / (s["floor_Mreq_s"] + s["cpp_Mreq_s"]))
        assert s["c_floor_Mreq_s"] > 0
        assert s["c_ceiling/cpp"] == pytest.approx(s["c_floor_Mreq_s"] / (s["c_floor_Mreq_s"] + s["cpp_Mreq_s"]))
        assert s["c_floor_gil_Mreq_s"] > 0
        assert s["c_ceiling_gil/cpp"] == pytest.approx(
            s["c_floor_gil_Mreq_s"] / (s["c_floor_gil_Mreq_s"] + s["cpp_Mreq_s"]))
    assert "no-op pybind11" in cp.stdout and "no-op C calls" in cp.stdout and "ceiling" in cp.stdout
    assert any("5 M desc/s" in g["goal"] for g in doc["goals"])
    for header in ("count[#desc]", "submit_med[us]", "submit_p99[us]", "total_med[us]", "submit_rate[Mdesc/s]"):
        assert header in cp.stdout
    assert (tmp_path / "hixl_descs.txt").read_text().startswith("hixl bench --desc-sweep")


@pytest.mark.parametrize("iters,window", [(1, 128), (5, 128), (400, 16), (1000, 128)])
def test_engine_stream_counts_every_request_and_orders_its_percentiles(iters, window):
    """The C++ stream behind the engine rows (shm): every request submitted and reaped through its
    ring of `window` slots (fewer when the stream is shorter), its bytes counted, and the latency
    summary (two selections, not a sort) gives 0 < p50 <= p99."""
    from hixl_tools import _perf
    from hixl_tools.bench.descsweep import _Pair
    p = _Pair("shm", 1 << 16)
    try:
        p.ini.transfer_sync(p.peer, p.h.WRITE, [p.h.TransferOpDesc(p.ia, p.ta, 8)])  # nothing left over
        p.ibuf[:] = 7
        r = _perf.perf_engine_stream(p.ini._engine, p.peer, 1, -1, p.ia, p.ta, 1 << 16, 64, 1, iters, window, 60000)
        assert r["requests"] == iters and r["bytes"] == 64 * iters
        assert 0 < r["req_p50_ns"] <= r["req_p99_ns"]
        touched = min(iters * 64, 1 << 16)
        assert (p.tbuf[:touched] == 7).all()  # each slot's bytes landed: every request ran
    finally:
        p.close()


def test_perf_loops_take_the_library_s_objects_and_raise_its_errors():
    """hixl_tools._perf's loops are handed hixl._core's Engine (another extension module's type) and
    raise hixl's HixlError; anything else is a TypeError."""
    import hixl
    from hixl_tools import _perf
    from hixl_tools.bench.descsweep import _Pair
    p = _Pair("shm", 1 << 16)
    try:
        with pytest.raises(hixl.HixlError, match="engine_stream: size, descs_per_req and window must be > 0"):
            _perf.perf_engine_stream(p.ini._engine, p.peer, 1, -1, p.ia, p.ta, 1 << 16, 0, 1, 10, 4, 60000)
        with pytest.raises(hixl.HixlError, match="perf: transfer_sync returned NOT_CONNECTED"):
            _perf.perf_engine_latency(p.ini._engine, "127.0.0.1:1", 1, -1, p.ia, p.ta, 8, 1, 1, 1000)
        with pytest.raises(TypeError):
            _perf.perf_engine_stream(object(), p.peer, 1, -1, p.ia, p.ta, 1 << 16, 8)
        assert len(_perf.perf_engine_latency(p.ini._engine, p.peer, 1, -1, p.ia, p.ta, 8, 1, 5, 60000)) == 5
    finally:
        p.close()
