#!/usr/bin/env bash
# The one command that runs every test (README; .ci/run calls it):
#   tier 1 on the host (ctest, the fuzzer, pytest with no device); the vLLM tier (hixl inside real vLLM
#   instances, in the environment ci/install-vllm.sh makes); tiers 2 and 3 (rdma, pyverbs interop) in a
#   QEMU/TCG guest with Soft-RoCE rxe0; tier 4 across two guests joined by a link. Every benchmark runs as
#   a smoke run (few sizes and rounds: it still works, writes well-formed JSON and computes its goals);
#   the full sweeps are `bash ci/bench.sh`, outside CI.
# Fails when a tier skipped or ran fewer tests than it should, and when the whole run passes its budget
# (HIXL_CI_BUDGET_S, default 3600 s, well inside CI's 5400 s limit). Prints, last, the seconds per step.
# HIXL_SKIP_DEPS=1 skips the apt/pip step; HIXL_SKIP_BENCH=1 the benchmark smoke runs; HIXL_VLLM_VENV
# picks the vLLM environment (default ~/.cache/hixl/vllm-venv: made once, then only checked);
# HIXL_TWOHOST_MARK=twohost also runs tier 4's comparisons of other rdma settings (marker compare).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO"
source ci/steps.sh
steps_budget "${HIXL_CI_BUDGET_S:-3600}"
ART="${RXE_ARTIFACTS:-$REPO/ci-artifacts}"
mkdir -p "$ART"
ART="$(cd "$ART" && pwd -P)"
export RXE_ARTIFACTS="$ART"
PY="$(python3 -c 'import sys; print(sys.executable)')"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/hixl"
VLLM_VENV="${HIXL_VLLM_VENV:-$CACHE/vllm-venv}"
BENCH=$([ "${HIXL_SKIP_BENCH:-0}" = 1 ] && echo 0 || echo 1)
# Tier 4's comparisons of other rdma settings (marker compare) are for the record, not checks: out of CI.
TWOHOST_MARK="${HIXL_TWOHOST_MARK:-twohost and not compare}"

deps() { bash ci/install-deps.sh; }

# C++ objects are kept across runs (ccache, in ~/.cache/ccache): a change touches a few files, and the
# wheels and ctest's build compile the same sources each run. Paths count from the clone
# (CCACHE_BASEDIR), so a fresh clone elsewhere hits too.
ccache_on() {
    command -v ccache >/dev/null || return 0
    export CMAKE_C_COMPILER_LAUNCHER=ccache CMAKE_CXX_COMPILER_LAUNCHER=ccache CCACHE_BASEDIR="$REPO" \
        CCACHE_NOHASHDIR=1 CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-2G}"
    ccache --zero-stats >/dev/null
}
ccache_said() {  # after a build: how much of it came from the cache
    command -v ccache >/dev/null || return 0
    ccache --print-stats | awk '/^(direct|preprocessed)_cache_hit\t/ {h += $2} /^cache_miss\t/ {m = $2}
        END {printf "[ci] ccache: %d compiles from the cache, %d compiled\n", h, m}'
    ccache --zero-stats >/dev/null
}

wheels() {  # the library and its tools, installed here and (below) into the vLLM environment
    rm -rf build/wheelhouse
    "$PY" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -w build/wheelhouse . ./tools
    "$PY" -m pip install --disable-pip-version-check --force-reinstall --no-deps build/wheelhouse/*.whl
    ccache_said
}

ctest_() {
    cmake -S . -B build/ctest -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
    cmake --build build/ctest
    ccache_said
    ctest --test-dir build/ctest --output-on-failure
}

tier1() {
    "$PY" -m pytest -p no:cacheprovider -q -m "not rdma and not interop and not vllm" \
        --junitxml="$ART/host-junit.xml" tests
}

# The fuzzer is one process on one core for a fixed time: ctest and the host pytest run beside it on the
# other, instead of after it.
tier1_all() {
    local frc=0 crc=0 prc=0
    bash ci/fuzz.sh "${HIXL_FUZZ_SECONDS:-60}" > "$ART/fuzz.log" 2>&1 &
    local fuzz=$!
    ctest_ || crc=$?
    [ "$crc" -ne 0 ] || tier1 || prc=$?
    wait "$fuzz" || frc=$?
    cat "$ART/fuzz.log"
    [ "$frc" -eq 0 ] || log "FAIL: libFuzzer (ci/fuzz.sh) exited $frc"
    [ "$crc" -eq 0 ] || log "FAIL: ctest exited $crc"
    [ "$prc" -eq 0 ] || log "FAIL: the host pytest exited $prc"
    [ "$frc" -eq 0 ] && [ "$crc" -eq 0 ] && [ "$prc" -eq 0 ]
}

bench_host() {
    bash ci/bench.sh --smoke host
}

vllm_env() { HIXL_WHEELS="$(ls "$REPO"/build/wheelhouse/*.whl | tr '\n' ' ')" bash ci/install-vllm.sh "$VLLM_VENV"; }

vllm_pytest() {  # JUNIT PYTEST-ARGS...: the vLLM tier's tests in the vLLM environment
    local junit="$1"; shift
    mkdir -p "$ART/vllm"
    rm -f "$junit"
    HIXL_REQUIRE_VLLM=1 HIXL_VLLM_LOGS="$ART/vllm" HIXL_VLLM_MODEL="$REPO/build/smollm2-hf" \
        "$VLLM_VENV/bin/python" -m pytest -p no:cacheprovider -q -rA --durations=15 \
        -m "vllm and not rdma and not open_defect" --junitxml="$junit" "$@"
}

# The vLLM tier in two parts: the PD module's five instances (with vllm.LLM in the test process) take
# most of the host's memory; the modules after it start three at a time and leave room for tier 4.
SMALL=(tests/vllm_tier/test_tiny_models.py tests/vllm_tier/test_hybrid_e2e.py)
vllm_tier() {
    local rc=0
    vllm_pytest "$ART/vllm-junit.xml" tests/vllm_tier "${SMALL[@]/#/--ignore=}" || rc=$?
    "$PY" ci/check_junit.py "$ART/vllm-junit.xml" --min-tests 140 \
        --require tests.vllm_tier.test_connector_units --require tests.vllm_tier.test_pd_e2e \
        --require tests.vllm_tier.test_worker_parts --require tests.vllm_tier.test_contracts \
        --require tests.vllm_tier.test_tp_parts --require tests.vllm_tier.test_groups \
        || { log "FAIL: the vLLM tier did not really pass"; return 1; }
    [ "$rc" -eq 0 ] || { log "FAIL: vLLM tier exited $rc"; return "$rc"; }
}

# Three instances at a time: one cluster per hybrid architecture (the tiny models first: the clusters serve
# the exports they keep).
vllm_tier_small() {
    local rc=0
    vllm_pytest "$ART/vllm-small-junit.xml" "${SMALL[@]}" || rc=$?
    "$PY" ci/check_junit.py "$ART/vllm-small-junit.xml" --min-tests 27 \
        --require tests.vllm_tier.test_tiny_models \
        --require tests.vllm_tier.test_hybrid_e2e \
        || { log "FAIL: the vLLM tier's second part did not really pass"; return 1; }
    [ "$rc" -eq 0 ] || { log "FAIL: vLLM tier (second part) exited $rc"; return "$rc"; }
}

bench_vllm() { HIXL_VLLM_VENV="$VLLM_VENV" HIXL_VLLM_MODEL="$REPO/build/smollm2-hf" bash ci/bench.sh --smoke vllm; }

vm_tiers() {  # tiers 2 and 3, the connector's rdma tests and the VM's benchmark smoke runs, one boot
    rm -f "$ART/rdma-junit.xml" "$ART/rdma-exclusive-junit.xml" "$ART/vllm-rdma-junit.xml"
    local rc=0
    HIXL_VLLM_VENV="$VLLM_VENV" RXE_VM_TIMEOUT="${RXE_VM_TIMEOUT:-2400}" bash ci/rxe-vm.sh bash ci/in-vm.sh || rc=$?
    "$PY" ci/check_junit.py "$ART/rdma-junit.xml" "$ART/rdma-exclusive-junit.xml" --min-tests 228 \
        --require tests.rdma.test_data_path --require tests.test_hixl_engine --require tests.test_kv \
        --require tests.test_demo --require tests.reliability --require tests.interop.test_pyverbs \
        || { log "FAIL: RDMA tiers did not really pass"; return 1; }
    "$PY" ci/check_junit.py "$ART/vllm-rdma-junit.xml" --min-tests 13 --require tests.vllm_tier.test_connector_units \
        --require tests.vllm_tier.test_groups \
        || { log "FAIL: the connector's rdma tests did not really pass in the VM"; return 1; }
    [ "$rc" -eq 0 ] || { log "FAIL: VM run exited $rc"; return "$rc"; }
    [ "$BENCH" = 0 ] || bash ci/bench.sh --smoke vm-report
}

two_host() {
    rm -rf "$ART/twohost"
    mkdir -p "$ART/twohost"
    local rc=0
    TV_DIR="$ART/twohost" TV_REPO="$REPO" TV_TIMEOUT="${HIXL_TWOHOST_TIMEOUT:-2400}" TV_VERBOSE= \
        PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 TV_CMD_A="$PY -m tests.twohost.peer" \
        TV_CMD_B="$PY -m pytest -p no:cacheprovider -q -rA -m '$TWOHOST_MARK' --junitxml=\$TV_ST/twohost-junit.xml tests/twohost" \
        bash ci/two-vm/two-vm.sh || rc=$?
    cat "$ART/twohost/state/latest/faults.txt" 2>/dev/null || true
    "$PY" ci/check_junit.py "$ART/twohost/state/latest/twohost-junit.xml" --min-tests 118 \
        --require tests.twohost.test_faults --require tests.twohost.test_engine_suite \
        || { log "FAIL: the two-host tier did not really pass"; return 1; }
    [ "$rc" -eq 0 ] || { log "FAIL: the two-host run exited $rc"; return "$rc"; }
}

# Tier 4's guests mostly wait on each other across their link: alone, they kept the host's two cores
# 29% busy. It starts once the PD cluster's tests are done (its five instances and the guests together
# do not fit in memory) and runs beside the rest of the vLLM tier, tier 1 and the benchmark smoke runs;
# the rxe VM, whose tests are the most sensitive to a loaded host, starts after it ends. Its log is
# printed then, with its own seconds.
TIER4_RC="$ART/twohost.rc"
tier4_begin() {
    rm -f "$TIER4_RC" "$ART/twohost.log"
    ( s=$(date +%s); r=0; two_host || r=$?; log "tier 4: exit $r after $(( $(date +%s) - s ))s"
      echo "$r" > "$TIER4_RC.tmp" && mv "$TIER4_RC.tmp" "$TIER4_RC" ) > "$ART/twohost.log" 2>&1 &
    TIER4_PID=$!
    log "tier 4 (ci/two-vm) started beside the next steps (its log: $ART/twohost.log)"
}
tier4_end() {  # a step: waits for it (not a child of this subshell: its status comes through a file)
    while [ ! -f "$TIER4_RC" ] && kill -0 "$TIER4_PID" 2>/dev/null; do sleep 5; done
    cat "$ART/twohost.log"
    [ -f "$TIER4_RC" ] || { log "FAIL: tier 4 ended without a status"; return 1; }
    return "$(cat "$TIER4_RC")"
}
tier4_stop() { [ -z "${TIER4_PID:-}" ] || kill -- "-$TIER4_PID" 2>/dev/null || true; }

[ "${HIXL_SKIP_DEPS:-0}" = 1 ] || step "install: apt and pip (ci/install-deps.sh)" deps
ccache_on
step "build: the wheels of hixl and hixl-tools, installed here" wheels
step "vLLM: its environment (ci/install-vllm.sh)" vllm_env
step "vLLM tier: connector parts, the PD cluster (5 instances)" vllm_tier
set -m  # tier 4 in a process group of its own, so that a failing step below takes it down too
trap 'rc_=$?; tier4_stop; (exit "$rc_"); _steps_table' EXIT  # the table reads the run's status from $?
tier4_begin
set +m
step "vLLM tier: MLA, sliding-window and Mamba models (TP 2, FP8, default threads)" vllm_tier_small
step "tier 1: ctest, then pytest with no device; libFuzzer beside them" tier1_all
[ "$BENCH" = 0 ] || step "bench smoke: host (sweep, PD pipeline, descriptors)" bench_host
[ "$BENCH" = 0 ] || step "bench smoke: vLLM PD (bench/vllm_pd.py)" bench_vllm
step "tier 4 (ci/two-vm), begun after the PD cluster: the rest of it" tier4_end
step "tiers 2+3 in the rxe VM: rdma, interop, vLLM parts, bench smoke" vm_tiers
log "all tiers passed"
