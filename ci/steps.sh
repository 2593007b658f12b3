# Sourced by ci/test-all.sh and ci/bench.sh: runs named steps, times each, and prints a table of them
# last (also when a step fails). With a budget, a run that passes it fails, naming the budget.
#   step NAME CMD [ARG...]    run CMD as step NAME (its exit status is the step's)
#   steps_budget SECONDS      fail the run once it passes SECONDS (checked between steps and at the end)
_STEP_NAMES=()
_STEP_SECS=()
_STEP_RCS=()
_STEPS_T0=$(date +%s)
_STEPS_BUDGET=0

log() { echo "[ci] $*"; }

steps_budget() { _STEPS_BUDGET="$1"; }

_steps_over_budget() {
    local total=$(( $(date +%s) - _STEPS_T0 ))
    [ "$_STEPS_BUDGET" -gt 0 ] && [ "$total" -gt "$_STEPS_BUDGET" ]
}

_steps_budget_message() {
    local total=$(( $(date +%s) - _STEPS_T0 ))
    log "FAIL: this run took ${total}s, over its budget of ${_STEPS_BUDGET}s (CI's hard limit is 5400s)."
    log "      The table below says which steps took the time: make them cheaper before adding more."
}

step() {
    local name="$1"; shift
    if _steps_over_budget; then
        _steps_budget_message
        log "not started: $name"
        exit 3
    fi
    local t0 rc
    t0=$(date +%s)
    log "=== step: $name ($(( t0 - _STEPS_T0 ))s into the run)"
    set +e
    ( set -euo pipefail; "$@" )   # a subshell: a step's own failure ends the step, not the run's bookkeeping
    rc=$?
    set -e
    _STEP_NAMES+=("$name")
    _STEP_SECS+=("$(( $(date +%s) - t0 ))")
    _STEP_RCS+=("$rc")
    log "=== step: $name: exit $rc after ${_STEP_SECS[-1]}s"
    return "$rc"
}

_steps_table() {
    local rc=$? i total=$(( $(date +%s) - _STEPS_T0 ))
    if [ "$rc" -eq 0 ] && _steps_over_budget; then
        _steps_budget_message
        rc=3
    fi
    echo
    echo "[ci] time per step (seconds):"
    printf '[ci]   %-66s %7s %5s\n' "step" "seconds" "exit"
    for i in "${!_STEP_NAMES[@]}"; do
        printf '[ci]   %-66s %7d %5d\n' "${_STEP_NAMES[$i]}" "${_STEP_SECS[$i]}" "${_STEP_RCS[$i]}"
    done
    printf '[ci]   %-66s %7d %5d\n' "total" "$total" "$rc"
    [ "$_STEPS_BUDGET" -eq 0 ] || printf '[ci]   %-66s %7d\n' "budget" "$_STEPS_BUDGET"
    exit "$rc"
}
trap _steps_table EXIT
