#!/usr/bin/env bash
# Runs INSIDE the rxe VM (via ci/rxe-vm.sh): the `rdma` and `interop` test tiers, then the
# WRITE sweep benchmark against perftest and `hixl bench` (rdma vs perftest, Mooncake, NIXL) on the
# same rxe0, and bench/callgrind.py (instructions per request, engine path vs ib_write_bw). Reports go to
# ci-artifacts/ (the bench's plots are drawn on the host: ci/test-all.sh).
set -uo pipefail
log() { echo "[ci] $*"; }
ART="${RXE_ARTIFACTS:-ci-artifacts}"
PY="${PYTHON:-python3}"
export HIXL_REQUIRE_RDMA=1
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1  # site-packages plugins cost seconds per start under TCG

log "tier 2+3: pytest -m 'rdma or interop' on $(ibv_devices | awk 'NR>2 {print $1}' | xargs)"
# tests/vllm_tier needs the vLLM environment: it runs below with that environment's python (here it
# would only be skipped, and a skip fails the tier).
"$PY" -m pytest -p no:cacheprovider -q -rA --durations=10 -m "rdma or interop" --ignore=tests/vllm_tier \
    --junitxml="$ART/rdma-junit.xml" tests
test_rc=$?
log "pytest exit status: $test_rc"

if [ -n "${HIXL_VLLM_VENV:-}" ]; then
    # vLLM itself is far too slow under TCG (importing it alone takes minutes): the connector's worker
    # sides run here over rdma without a vLLM server (tests/vllm_tier/test_connector_units.py).
    log "vLLM tier over rdma: the connector's parts on rxe0 ($HIXL_VLLM_VENV)"
    "$HIXL_VLLM_VENV/bin/python" -m pytest -p no:cacheprovider -q -rA -m "vllm and rdma" \
        --junitxml="$ART/vllm-rdma-junit.xml" tests/vllm_tier/test_connector_units.py
    vrc=$?
    log "vLLM tier over rdma exit status: $vrc"
    [ "$test_rc" -ne 0 ] || test_rc=$vrc
fi

bench_rc=0
if [ "${HIXL_SKIP_BENCH:-0}" != 1 ]; then
    log "bench: hixl WRITE vs ib_write_lat / ib_write_bw on rxe0 (same VM run)"
    "$PY" bench/write_sweep.py --sizes "${HIXL_BENCH_SIZES:-8,4096,65536,1048576,16777216}" \
        --lat-iters "${HIXL_BENCH_LAT_ITERS:-500}" --json "$ART/write_sweep.json" 2>&1 | tee "$ART/write_sweep.txt"
    bench_rc=${PIPESTATUS[0]}
    log "bench exit status: $bench_rc"
    log "hixl bench: rdma sweep vs perftest, Mooncake, NIXL on rxe0 (same VM run)"
    "$PY" -m hixl.bench --transport rdma --op "${HIXL_BENCH_OPS:-write,read}" --vs perftest,mooncake,nixl \
        --quick --no-plots --no-progress --out "$ART/bench" 2>&1
    hb_rc=$?
    log "hixl bench exit status: $hb_rc"
    [ "$bench_rc" -ne 0 ] || bench_rc=$hb_rc
    log "bench/callgrind.py: instructions per request, both sides, engine path vs ib_write_bw (same VM run)"
    "$PY" bench/callgrind.py --paths engine --n1 200 --n2 600 --out "$ART/callgrind" 2>&1 | grep -v '^==' | tail -8
    cg_rc=${PIPESTATUS[0]}
    log "callgrind exit status: $cg_rc"
    [ "$bench_rc" -ne 0 ] || bench_rc=$cg_rc
fi
[ "$test_rc" -eq 0 ] || exit "$test_rc"
exit "$bench_rc"
