#!/usr/bin/env bash
# Runs INSIDE the rxe VM (via ci/rxe-vm.sh): the `rdma` and `interop` test tiers, then the connector's
# rdma tests beside the VM's benchmark smoke runs (ci/bench.sh --smoke vm-guest) on the same rxe0.
# Reports go to ci-artifacts/ (plots are drawn on the host: ci/bench.sh vm-report).
set -uo pipefail
log() { echo "[ci $(cut -d" " -f1 /proc/uptime) s] $*"; }  # the guest's uptime: when each phase began and ended
ART="${RXE_ARTIFACTS:-ci-artifacts}"
PY="${PYTHON:-python3}"
export HIXL_REQUIRE_RDMA=1
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # site-packages plugins cost seconds per start under TCG
# How busy the guest's vCPUs were over a phase: what is left to overlap there (the rest waits on 9p,
# on sleeps in tests, on the other end).
cpu_ticks() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8}' /proc/stat; }
cpu_mark() { read -r BUSY0 ALL0 < <(cpu_ticks); }
cpu_said() {
    local busy all
    read -r busy all < <(cpu_ticks)
    log "$1: the vCPUs were busy $(( 100 * (busy - BUSY0) / (all - ALL0 > 0 ? all - ALL0 : 1) ))% of the time"
}

log "tier 2+3: pytest -m 'rdma or interop' on $(ibv_devices | awk 'NR>2 {print $1}' | xargs), two tests at a time"
cpu_mark
# tests/vllm_tier needs the vLLM environment: it runs below with that environment's python (here it
# would only be skipped, and a skip fails the tier). Two pytest workers (pytest-xdist) keep both vCPUs
# busy: under TCG a test is mostly one interpreter's work, and the tier takes about half as long. The
# tests marked exclusive change what every engine shares (the port goes down): they run after, alone.
"$PY" -m pytest -p no:cacheprovider -p xdist -n 2 --dist load -q -rA --durations=10 \
    -m "(rdma or interop) and not exclusive" --ignore=tests/vllm_tier --junitxml="$ART/rdma-junit.xml" tests
test_rc=$?
log "pytest exit status: $test_rc"
cpu_said "tier 2+3"
"$PY" -m pytest -p no:cacheprovider -q -rA -m "(rdma or interop) and exclusive" --ignore=tests/vllm_tier \
    --junitxml="$ART/rdma-exclusive-junit.xml" tests
rc=$?
log "pytest (exclusive tests) exit status: $rc"
[ "$test_rc" -ne 0 ] || test_rc=$rc

# The connector's rdma tests and the benchmark smoke runs go side by side: the first is mostly one
# interpreter importing torch (minutes under TCG), the second mostly perftest and callgrind, and each
# alone left a vCPU idle. Neither is a timing test (the smoke runs' numbers are not judged here).
vllm_pid=""
if [ -n "${HIXL_VLLM_VENV:-}" ]; then
    # vLLM itself is far too slow under TCG (importing it alone takes minutes): the connector's worker
    # sides run here over rdma without a vLLM server (test_connector_units.py; test_groups.py: the KV
    # cache groups of hybrid models).
    log "vLLM tier over rdma: the connector's parts on rxe0 ($HIXL_VLLM_VENV), beside the bench smoke runs"
    "$HIXL_VLLM_VENV/bin/python" -m pytest -p no:cacheprovider -q -rA --durations=10 -m "vllm and rdma" \
        --junitxml="$ART/vllm-rdma-junit.xml" tests/vllm_tier/test_connector_units.py tests/vllm_tier/test_groups.py \
        > "$ART/vllm-rdma.log" 2>&1 &
    vllm_pid=$!
fi

cpu_mark
bench_rc=0
if [ "${HIXL_SKIP_BENCH:-0}" != 1 ]; then
    log "bench smoke in this VM (ci/bench.sh --smoke vm-guest): WRITE sweep, hixl bench, callgrind"
    PYTHON="$PY" bash ci/bench.sh --smoke vm-guest
    bench_rc=$?
    log "bench smoke exit status: $bench_rc"
fi
if [ -n "$vllm_pid" ]; then
    wait "$vllm_pid"
    vrc=$?
    cat "$ART/vllm-rdma.log"
    log "vLLM tier over rdma exit status: $vrc"
    cpu_said "the connector's rdma tests beside the bench smoke runs"
    [ "$test_rc" -ne 0 ] || test_rc=$vrc
fi
[ "$test_rc" -eq 0 ] || exit "$test_rc"
exit "$bench_rc"
