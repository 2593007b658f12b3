#!/usr/bin/env bash
# README's first command: set up everything and run the main job (the put/get demo over one-sided
# RDMA). On a host with an ACTIVE RDMA device it runs right here; otherwise it boots the Soft-RoCE
# VM (ci/rxe-vm.sh) and runs it on rxe0 inside. HIXL_SKIP_DEPS=1 skips apt/pip.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$REPO"
[ "${HIXL_SKIP_DEPS:-0}" = 1 ] || bash ci/install-deps.sh
python3 -m pip install --disable-pip-version-check --no-build-isolation -q .
if python3 -c 'import hixl, sys; sys.exit(0 if hixl.has_active_device() else 1)'; then
    exec python3 -m hixl.demo "$@"
fi
echo "[demo] no RDMA device on this host: running the demo on Soft-RoCE rxe0 inside a QEMU guest"
export RXE_ARTIFACTS="${RXE_ARTIFACTS:-$REPO/ci-artifacts/demo}"
exec bash ci/rxe-vm.sh python3 -m hixl.demo "$@"
