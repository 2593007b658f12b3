#!/usr/bin/env bash
# libFuzzer run over the wire / control-frame parsers (csrc/tests/fuzz_wire.cc) for a bounded time,
# under AddressSanitizer + UndefinedBehaviorSanitizer, from a seed corpus of valid frames of every
# type. Fails on any crash, sanitizer report, leak, uncaught exception, round-trip mismatch, slow
# input (-timeout) or single allocation over -malloc_limit_mb (an allocation not bounded by the
# input is a finding too).
#
# Needs clang with its libFuzzer runtime: on Debian 12, apt-get install clang libclang-rt-14-dev
# (clang only Recommends the runtime).
#
# Usage: ci/fuzz.sh [SECONDS]    (default: $HIXL_FUZZ_SECONDS or 60)
# Env:   HIXL_FUZZ_CXX  compiler (default: clang++, else clang++-14)
#        RXE_ARTIFACTS  where a crashing input is written (default: <repo>/ci-artifacts), as fuzz-crash-*
set -euo pipefail
log() { echo "[ci] $*"; }
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO"
SECS="${1:-${HIXL_FUZZ_SECONDS:-60}}"
ART="${RXE_ARTIFACTS:-$REPO/ci-artifacts}"
OUT="$REPO/build/fuzz"
mkdir -p "$ART" "$OUT"

CXX="${HIXL_FUZZ_CXX:-}"
if [ -z "$CXX" ]; then
    for c in clang++ clang++-14; do
        if command -v "$c" >/dev/null; then CXX="$c"; break; fi
    done
fi
[ -n "$CXX" ] || { log "ERROR: clang++ not found (apt-get install clang libclang-rt-14-dev)"; exit 2; }

SRCS=(csrc/wire/wire.cc csrc/wire/control.cc csrc/wire/frame_reader.cc csrc/transport/oob.cc csrc/tests/fuzz_wire.cc)
FLAGS=(-std=c++17 -g -O1 -fno-omit-frame-pointer -Icsrc -fsanitize=address,undefined -fno-sanitize-recover=all)
log "build fuzz_wire with $CXX ($("$CXX" --version | head -n 1))"
"$CXX" "${FLAGS[@]}" -fsanitize=fuzzer "${SRCS[@]}" -o "$OUT/fuzz_wire" \
    || { log "ERROR: building with -fsanitize=fuzzer failed (is libclang-rt-14-dev installed?)"; exit 2; }
"$CXX" "${FLAGS[@]}" -DHIXL_FUZZ_SEEDS "${SRCS[@]}" -o "$OUT/fuzz_wire_seeds"

rm -rf "$OUT/seeds" "$OUT/corpus"
mkdir -p "$OUT/seeds" "$OUT/corpus"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:allocator_may_return_null=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
"$OUT/fuzz_wire_seeds" "$OUT/seeds"

log "fuzz_wire: ${SECS}s"
start=$(date +%s)
# New inputs go to corpus/ (seeds/ stays as generated); -fork is not used: one process, one report.
set +e
"$OUT/fuzz_wire" -max_total_time="$SECS" -max_len=65536 -malloc_limit_mb=64 -rss_limit_mb=2048 -timeout=10 \
    -print_final_stats=1 -artifact_prefix="$ART/fuzz-crash-" "$OUT/corpus" "$OUT/seeds" 2>&1 | tail -n 25
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
    # libFuzzer exits 72 when it was interrupted (SIGINT/SIGTERM): nothing was found, and no input written.
    found=$(ls "$ART"/fuzz-crash-* 2>/dev/null | head -n 5 | tr '\n' ' ')
    if [ -n "$found" ]; then
        log "FAIL: fuzz_wire exited $rc; the input: $found"
    else
        log "FAIL: fuzz_wire exited $rc and wrote no input (libFuzzer exits 72 when interrupted)"
    fi
    exit "$rc"
fi
log "fuzz_wire: no finding in $(( $(date +%s) - start ))s ($(ls "$OUT/corpus" | wc -l) corpus inputs)"
