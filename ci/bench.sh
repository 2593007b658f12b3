#!/usr/bin/env bash
# Every benchmark of hixl, with the same JSON, tables and plots in CI (as a smoke run) and outside it
# (the full sweeps; bench/README.md says what each measures).
#   bash ci/bench.sh                  full sweeps: host, vLLM PD, then the rxe VM (about 2 hours here)
#   bash ci/bench.sh host vm          only those parts (host, vllm, vm)
#   bash ci/bench.sh --smoke PART...  CI's smoke runs: few sizes and rounds (ci/test-all.sh runs them)
# Parts: host (same-host and tcp sweep vs memcpy and Mooncake, the PD pipeline's overlap, descriptor-heavy
# transfers vs NIXL); vllm (vLLM PD: one instance vs HixlConnector push / pull vs NixlConnector; needs the
# environment of ci/install-vllm.sh: HIXL_VLLM_VENV); vm (boots the rxe VM and runs vm-guest there: WRITE
# sweep vs perftest, hixl bench vs perftest / Mooncake / NIXL, callgrind's instructions per request; then
# vm-report here: the plots and the checks of that run). Results: $RXE_ARTIFACTS (default bench/results).
# Assumes hixl and its tools are installed (ci/test-all.sh or the README's first command does that).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO"
MODE=full
if [ "${1:-}" = "--smoke" ]; then MODE=smoke; shift; fi
PARTS=("$@")
[ "${#PARTS[@]}" -gt 0 ] || PARTS=(host vllm vm)
ART="${RXE_ARTIFACTS:-$REPO/bench/results}"
mkdir -p "$ART"
ART="$(cd "$ART" && pwd -P)"
export RXE_ARTIFACTS="$ART"
PY="${PYTHON:-$(python3 -c 'import sys; print(sys.executable)')}"
HIXL_BENCH=("$PY" -m hixl_tools.bench)
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/hixl"
log() { echo "[bench] $*"; }
smoke() { [ "$MODE" = smoke ]; }

host() {
    log "same-host and tcp transports vs memcpy and Mooncake (bench/host_sweep.py)"
    local a=(); smoke && a=(--sizes 8,1048576 --lat-iters 50)
    "$PY" bench/host_sweep.py "${a[@]}" --json "$ART/host_sweep.json" 2>&1 | tee "$ART/host_sweep.txt"
    log "PD pipeline with SmolLM2: overlap and TTFT vs monolithic (bench/pd_bench.py)"
    a=(); smoke && a=(--prompt-tokens 128 --max-new-tokens 4 --repeat 1 --warmup 0)
    "$PY" bench/pd_bench.py "${a[@]}" --json "$ART/pd_bench.json" 2>&1 | tee "$ART/pd_bench.txt"
    log "descriptor-heavy transfers from Python vs NIXL's prepared path (hixl bench --desc-sweep)"
    a=(); smoke && a=(--quick --descs 1,100000 --sizes 64)
    "${HIXL_BENCH[@]}" --desc-sweep --transport shm,tcp --vs nixl "${a[@]}" --out "$ART/descs" 2>&1 \
        | tee "$ART/descs.log"
    "$PY" - "$ART/descs/hixl_descs.json" <<'PYEOF' || { log "FAIL: the descriptor sweep did not measure every way"; return 1; }
import json, sys
doc = json.load(open(sys.argv[1]))
ways = {(r["transport"], r["way"]) for r in doc["rows"]}
need = {(t, w) for t in ("shm", "tcp") for w in ("list", "numpy", "prepped")} | {("tcp", "nixl-prepped")}
print("desc sweep: %d rows; goals: %s" % (len(doc["rows"]), "; ".join(
    "%s: %s" % (g["goal"], "met" if g["met"] else "missed") for g in doc["goals"])))
sys.exit(0 if need <= ways and len(doc["single"]) == 2 and doc["goals"] else 1)
PYEOF
}

vllm() {
    local venv="${HIXL_VLLM_VENV:-$CACHE/vllm-venv}"
    local model="${HIXL_VLLM_MODEL:-$CACHE/smollm2-hf}"
    [ -x "$venv/bin/python" ] || { log "FAIL: no vLLM environment at $venv (bash ci/install-vllm.sh $venv)"; return 1; }
    log "vLLM PD: one instance vs HixlConnector push / pull vs NixlConnector (bench/vllm_pd.py)"
    # The smoke run leaves NixlConnector, the reference, to the full run: its pair alone took ~50 s here.
    local a=(--configs all); smoke && a=(--configs mono,push,pull --requests 2 --warmup 0 --words 300 --max-tokens 8)
    "$venv/bin/python" bench/vllm_pd.py "${a[@]}" --model "$model" --out "$ART/vllm_pd" 2>&1 | tee "$ART/vllm_pd.log"
    "$PY" bench/vllm_pd.py --from-json "$ART/vllm_pd/vllm_pd.json" >/dev/null  # the plot, with this matplotlib
    "$PY" - "$ART/vllm_pd/vllm_pd.json" <<'PYEOF' || { log "FAIL: bench/vllm_pd.py did not measure hixl push and pull"; return 1; }
import json, sys
doc = json.load(open(sys.argv[1]))
s = doc["summary"]
ok = all(isinstance(s.get(k), dict) and "ttft_ms" in s[k] for k in ("mono", "hixl-push", "hixl-pull"))
print("vllm_pd: " + "; ".join(f"{k} TTFT {v['ttft_ms']['median']:.0f} ms" if isinstance(v, dict) and "ttft_ms" in v
                              else f"{k}: {v}" for k, v in s.items()))
print("vllm_pd goals: " + "; ".join(f"{g['goal']}: {g['status']}" for g in doc["goals"]))
sys.exit(0 if ok and doc["goals"] else 1)
PYEOF
}

vm_guest() {  # inside the rxe VM (ci/in-vm.sh in CI, or part vm below)
    log "hixl WRITE vs ib_write_lat / ib_write_bw on rxe0 (bench/write_sweep.py)"
    local a=(); smoke && a=(--sizes 8,65536 --lat-iters 100 --trials 1 --bw-bytes 8388608)
    "$PY" bench/write_sweep.py "${a[@]}" --json "$ART/write_sweep.json" 2>&1 | tee "$ART/write_sweep.txt"
    log "hixl bench: rdma vs perftest, Mooncake, NIXL on rxe0"
    a=(--op write,read,write_imm); smoke && a=(--op write,read --quick --sizes 8,64K --lat-rounds 1 --bw-rounds 1)
    "${HIXL_BENCH[@]}" --transport rdma "${a[@]}" --vs perftest,mooncake,nixl --no-plots --no-progress \
        --out "$ART/bench" 2>&1
    log "instructions per request, both sides, vs ib_write_bw (bench/callgrind.py)"
    a=(); smoke && a=(--paths engine --n1 100 --n2 300)
    "$PY" bench/callgrind.py "${a[@]}" --out "$ART/callgrind" 2>&1 | { grep -v '^==' || true; } | tail -8
}

vm_report() {  # on the host, after vm_guest: plots (matplotlib is slow under TCG) and the run's checks
    "${HIXL_BENCH[@]}" --from-json "$ART/bench/hixl_bench.json" >/dev/null \
        || { log "FAIL: no hixl bench report from the VM run"; return 1; }
    "$PY" - "$ART/bench/hixl_bench.json" <<'PYEOF' || { log "FAIL: the VM's hixl bench did not measure rdma against perftest and Mooncake"; return 1; }
import json, sys
doc = json.load(open(sys.argv[1]))
ours = {r["transport"] for r in doc["rows"] if r.get("bw_med_MiBps", 0) > 0}
peers = {(p["peer"], p["protocol"]) for p in doc["peers"] if p.get("bw_med_MiBps", 0) > 0}
print("hixl bench (VM): ours %s, peers %s, goals %s" % (sorted(ours), sorted(peers),
      ", ".join("%s %s" % (g["goal"], g["status"]) for g in doc["goals"])))
sys.exit(0 if "rdma" in ours and {("perftest", "rdma"), ("mooncake", "rdma")} <= peers else 1)
PYEOF
    "$PY" - "$ART/callgrind/callgrind.json" <<'PYEOF' || { log "FAIL: bench/callgrind.py did not count perftest and the engine path in the VM"; return 1; }
import json, sys
rows = {r["path"]: r for r in json.load(open(sys.argv[1]))["rows"]}
eng, pt = rows.get("engine"), rows.get("perftest (ib_write_bw)")
print("callgrind (VM): instructions per 8 B WRITE, both sides: perftest %.0f, engine %.0f (%.2fx)"
      % (pt["both"], eng["both"], eng["vs_perftest"]))
sys.exit(0 if eng and pt and eng["both"] > 0 and pt["both"] > 0 else 1)
PYEOF
    "$PY" - "$ART/write_sweep.json" <<'PYEOF' || { log "FAIL: bench/write_sweep.py wrote no rows"; return 1; }
import json, sys
doc = json.load(open(sys.argv[1]))
rows = doc.get("rows", doc) if isinstance(doc, dict) else doc
sys.exit(0 if rows else 1)
PYEOF
}

vm() {
    local flag=(); smoke && flag=(--smoke)
    RXE_VM_TIMEOUT="${RXE_VM_TIMEOUT:-7200}" bash ci/rxe-vm.sh bash ci/bench.sh "${flag[@]}" vm-guest
    vm_report
}

for part in "${PARTS[@]}"; do
    case "$part" in
        host) host ;;
        vllm) vllm ;;
        vm) vm ;;
        vm-guest) vm_guest ;;
        vm-report) vm_report ;;
        *) echo "usage: bash ci/bench.sh [--smoke] [host] [vllm] [vm]" >&2; exit 2 ;;
    esac
done
log "done ($MODE): results in $ART"
