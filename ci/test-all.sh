#!/usr/bin/env bash
# The one command that runs every test (README; .ci/run calls it):
#   tier 1 (no device: ctest + pytest) on the host; the vLLM tier (hixl inside vLLM: ci/install-vllm.sh
#   makes its environment, then tests/vllm_tier with vLLM itself, then bench/vllm_pd.py); then tiers 2 (rdma)
#   and 3 (pyverbs interop) inside a QEMU/TCG guest with Soft-RoCE rxe0, and the benchmarks in that VM.
# Fails when rxe0 cannot be brought up, or when the RDMA or vLLM tiers were skipped or ran no test.
# HIXL_SKIP_DEPS=1 skips the apt/pip installation step (for repeated local runs); HIXL_VLLM_VENV picks
# the vLLM environment (default build/vllm-venv, made or updated by ci/install-vllm.sh).
set -euo pipefail
log() { echo "[ci] $*"; }
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO"
ART="${RXE_ARTIFACTS:-$REPO/ci-artifacts}"
mkdir -p "$ART"
export RXE_ARTIFACTS="$ART"
start=$(date +%s)

if [ "${HIXL_SKIP_DEPS:-0}" != 1 ]; then
    bash ci/install-deps.sh
fi
PY="$(python3 -c 'import sys; print(sys.executable)')"

log "build the package once (a wheel), install it here (and into the vLLM environment below)"
rm -rf build/wheelhouse
"$PY" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -w build/wheelhouse .
WHEEL="$(ls build/wheelhouse/hixl-*.whl)"
"$PY" -m pip install --disable-pip-version-check --force-reinstall --no-deps "$WHEEL"

log "tier 1: C++ unit tests (ctest)"
cmake -S . -B build/ctest -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build/ctest
ctest --test-dir build/ctest --output-on-failure

log "tier 1: libFuzzer over the wire and control-frame parsers (bounded time)"
bash ci/fuzz.sh "${HIXL_FUZZ_SECONDS:-60}"

log "tier 1: pytest (no device)"
"$PY" -m pytest -p no:cacheprovider -q -m "not rdma and not interop and not vllm" --junitxml="$ART/host-junit.xml" tests

log "bench: same-host and tcp transports vs memcpy and Mooncake (host, same run)"
"$PY" bench/host_sweep.py --json "$ART/host_sweep.json" 2>&1 | tee "$ART/host_sweep.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "FAIL: bench/host_sweep.py"; exit 1; }

log "bench: PD pipeline with SmolLM2, 512-token prompt: overlap and TTFT vs monolithic (host, same run)"
"$PY" bench/pd_bench.py --json "$ART/pd_bench.json" 2>&1 | tee "$ART/pd_bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "FAIL: bench/pd_bench.py"; exit 1; }

log "bench: descriptor-heavy transfers from Python: lists, numpy arrays, prepared lists vs NIXL's prepared path (host)"
"$PY" -m hixl.bench --desc-sweep --transport shm,tcp --vs nixl --quick --out "$ART/descs" 2>&1 | tee "$ART/descs.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "FAIL: hixl bench --desc-sweep"; exit 1; }
"$PY" - "$ART/descs/hixl_descs.json" <<'PYEOF' || { log "FAIL: the descriptor sweep did not measure every way"; exit 1; }
import json, sys
doc = json.load(open(sys.argv[1]))
ways = {(r["transport"], r["way"]) for r in doc["rows"]}
need = {(t, w) for t in ("shm", "tcp") for w in ("list", "numpy", "prepped")} | {("tcp", "nixl-prepped")}
print("desc sweep: %d rows; goals: %s" % (len(doc["rows"]), "; ".join(
    "%s: %s" % (g["goal"], "met" if g["met"] else "missed") for g in doc["goals"])))
sys.exit(0 if need <= ways and len(doc["single"]) == 2 else 1)
PYEOF
VLLM_VENV="${HIXL_VLLM_VENV:-$REPO/build/vllm-venv}"
log "vLLM tier: the vLLM environment (ci/install-vllm.sh $VLLM_VENV)"
HIXL_WHEEL="$WHEEL" bash ci/install-vllm.sh "$VLLM_VENV"
log "vLLM tier: tests/vllm_tier (the connector's parts; vllm serve instances behind hixl proxy vs one instance)"
mkdir -p "$ART/vllm"
rm -f "$ART/vllm-junit.xml"
set +e
HIXL_REQUIRE_VLLM=1 HIXL_VLLM_LOGS="$ART/vllm" HIXL_VLLM_MODEL="$REPO/build/smollm2-hf" \
    "$VLLM_VENV/bin/python" -m pytest -p no:cacheprovider -q -rA --durations=15 -m "vllm and not rdma" \
    --junitxml="$ART/vllm-junit.xml" tests/vllm_tier
vllm_rc=$?
set -e
"$PY" ci/check_junit.py "$ART/vllm-junit.xml" --min-tests 35 \
    --require tests.vllm_tier.test_connector_units --require tests.vllm_tier.test_pd_e2e \
    || { log "FAIL: the vLLM tier did not really pass"; exit 1; }
[ "$vllm_rc" -eq 0 ] || { log "FAIL: vLLM tier exited $vllm_rc"; exit "$vllm_rc"; }
if [ "${HIXL_SKIP_BENCH:-0}" != 1 ]; then
    log "bench: vLLM PD - mono vs HixlConnector push / pull vs NixlConnector (bench/vllm_pd.py, same run)"
    "$VLLM_VENV/bin/python" bench/vllm_pd.py --requests "${HIXL_VLLM_BENCH_REQUESTS:-4}" \
        --model "$REPO/build/smollm2-hf" --out "$ART/vllm_pd" 2>&1 | tee "$ART/vllm_pd.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { log "FAIL: bench/vllm_pd.py"; exit 1; }
    "$PY" bench/vllm_pd.py --from-json "$ART/vllm_pd/vllm_pd.json" >/dev/null  # the plot, with the host's matplotlib
    "$PY" - "$ART/vllm_pd/vllm_pd.json" <<'PYEOF' || { log "FAIL: bench/vllm_pd.py did not measure hixl push and pull"; exit 1; }
import json, sys
doc = json.load(open(sys.argv[1]))
s = doc["summary"]
ok = all(isinstance(s.get(k), dict) and "ttft_ms" in s[k] for k in ("mono", "hixl-push", "hixl-pull"))
print("vllm_pd: " + "; ".join(f"{k} TTFT {v['ttft_ms']['median']:.0f} ms" if isinstance(v, dict) and "ttft_ms" in v
                              else f"{k}: {v}" for k, v in s.items()))
print("vllm_pd goals: " + "; ".join(f"{g['goal']}: {g['status']}" for g in doc["goals"]))
sys.exit(0 if ok else 1)
PYEOF
fi

log "tiers 2+3 in the rxe VM"
rm -f "$ART/rdma-junit.xml" "$ART/vllm-rdma-junit.xml"
set +e
HIXL_VLLM_VENV="$VLLM_VENV" RXE_VM_TIMEOUT="${RXE_VM_TIMEOUT:-2700}" bash ci/rxe-vm.sh bash ci/in-vm.sh
vm_rc=$?
set -e
"$PY" ci/check_junit.py "$ART/rdma-junit.xml" --min-tests 160 \
    --require tests.rdma.test_data_path --require tests.test_hixl_engine --require tests.test_kv \
    --require tests.test_demo --require tests.reliability --require tests.interop.test_pyverbs || { log "FAIL: RDMA tiers did not really pass"; exit 1; }
"$PY" ci/check_junit.py "$ART/vllm-rdma-junit.xml" --min-tests 13 --require tests.vllm_tier.test_connector_units \
    || { log "FAIL: the connector's rdma tests did not really pass in the VM"; exit 1; }
[ "$vm_rc" -eq 0 ] || { log "FAIL: VM run exited $vm_rc"; exit "$vm_rc"; }
if [ "${HIXL_SKIP_BENCH:-0}" != 1 ]; then
    log "hixl bench report of the VM run, with plots (matplotlib is slow under TCG, so they are drawn here)"
    "$PY" -m hixl.bench --from-json "$ART/bench/hixl_bench.json" >/dev/null \
        || { log "FAIL: no hixl bench report from the VM run"; exit 1; }
    "$PY" - "$ART/bench/hixl_bench.json" <<'PYEOF' || { log "FAIL: the VM's hixl bench did not measure rdma against perftest and Mooncake"; exit 1; }
import json, sys
doc = json.load(open(sys.argv[1]))
ours = {r["transport"] for r in doc["rows"] if r.get("bw_med_MiBps", 0) > 0}
peers = {(p["peer"], p["protocol"]) for p in doc["peers"] if p.get("bw_med_MiBps", 0) > 0}
print("hixl bench (VM): ours %s, peers %s, goals %s" % (sorted(ours), sorted(peers),
      ", ".join("%s %s" % (g["goal"], g["status"]) for g in doc["goals"])))
sys.exit(0 if "rdma" in ours and {("perftest", "rdma"), ("mooncake", "rdma")} <= peers else 1)
PYEOF
    ls -l "$ART/bench"
    "$PY" - "$ART/callgrind/callgrind.json" <<'PYEOF' || { log "FAIL: bench/callgrind.py did not count perftest and the engine path in the VM"; exit 1; }
import json, sys
rows = {r["path"]: r for r in json.load(open(sys.argv[1]))["rows"]}
eng, pt = rows.get("engine"), rows.get("perftest (ib_write_bw)")
print("callgrind (VM): instructions per 8 B WRITE, both sides: perftest %.0f, engine %.0f (%.2fx)"
      % (pt["both"], eng["both"], eng["vs_perftest"]))
sys.exit(0 if eng and pt and eng["both"] > 0 and pt["both"] > 0 else 1)
PYEOF
fi
log "tier 4: a real link - two QEMU guests joined by a link (ci/two-vm/two-vm.sh): the two-engine suite across it, then the faults, rdma and tcp"
rm -rf "$ART/twohost"
mkdir -p "$ART/twohost"
set +e
TV_DIR="$ART/twohost" TV_REPO="$REPO" TV_TIMEOUT="${HIXL_TWOHOST_TIMEOUT:-2400}" TV_VERBOSE= \
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 TV_CMD_A="$PY -m tests.twohost.peer" \
    TV_CMD_B="$PY -m pytest -p no:cacheprovider -q -rA -m twohost --junitxml=\$TV_ST/twohost-junit.xml tests/twohost" \
    bash ci/two-vm/two-vm.sh
tv_rc=$?
set -e
cat "$ART/twohost/state/latest/faults.txt" 2>/dev/null || true
"$PY" ci/check_junit.py "$ART/twohost/state/latest/twohost-junit.xml" --min-tests 115 \
    --require tests.twohost.test_faults --require tests.twohost.test_engine_suite || { log "FAIL: the two-host tier did not really pass"; exit 1; }
[ "$tv_rc" -eq 0 ] || { log "FAIL: the two-host run exited $tv_rc"; exit "$tv_rc"; }
log "all tiers passed in $(( $(date +%s) - start ))s"
