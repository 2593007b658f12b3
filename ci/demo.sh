#!/usr/bin/env bash
# README's first command: set up everything and run the main job, the prefill/decode (PD) demo:
# SmolLM2-135M-Instruct split into a prefill process and a decode process, the KV cache pushed layer
# by layer with hixl.kv, the generated tokens checked against a monolithic run of the same model.
#   bash ci/demo.sh [demo options]        on this host (rdma when it has an active device, else shm)
#   bash ci/demo.sh --vm [demo options]   on Soft-RoCE rxe0 inside the QEMU guest (transport rdma)
# Demo options: python3 -m hixl_tools.demo --help (e.g. --decoders 2 --shard, --prefills 2, --prompt-tokens 512).
# HIXL_SKIP_DEPS=1 skips apt/pip.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO"
[ "${HIXL_SKIP_DEPS:-0}" = 1 ] || bash ci/install-deps.sh
python3 -m pip install --disable-pip-version-check --no-build-isolation -q . ./tools
if [ "${1:-}" = "--vm" ]; then
    shift
    echo "[demo] running on Soft-RoCE rxe0 inside a QEMU guest (slow: TCG emulation)"
    export RXE_ARTIFACTS="${RXE_ARTIFACTS:-$REPO/ci-artifacts/demo}"
    exec bash ci/rxe-vm.sh python3 -m hixl_tools.demo --transport rdma --no-progress "$@"
fi
exec python3 -m hixl_tools.demo "$@"
