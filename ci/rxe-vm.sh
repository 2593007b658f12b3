#!/usr/bin/env bash
# Boot a QEMU/TCG guest (virtme-ng, Debian's own kernel), bring up Soft-RoCE rxe0
# inside it (ci/guest-setup-rxe.sh) and run CMD... in the repository directory.
# The exit status of CMD is handed back through a file in the artifact dir and
# becomes this script's exit status.
#
# Usage: ci/rxe-vm.sh CMD [ARG...]
#   e.g. ci/rxe-vm.sh python3 -m pytest -p no:cacheprovider tests
#
# Environment (all optional):
#   RXE_VNG          vng executable            (default: vng on PATH)
#   RXE_VM_KERNEL    guest kernel image        (default: newest /boot/vmlinuz-*-amd64)
#   RXE_VM_CPUS      guest vCPUs               (default: 2)
#   RXE_VM_MEMORY    guest RAM                 (default: 4G)
#   RXE_VM_TIMEOUT   seconds for the whole VM  (default: 1800)
#   RXE_ARTIFACTS    host dir for rc/markers/logs (default: <repo>/ci-artifacts)
#   RXE_VM_RWDIRS    extra space-separated host dirs to make writable in the guest
#   RXE_WAIT_S       seconds to wait for rxe0 PORT_ACTIVE in the guest (default: 60)
#   RXE_VM_CACHED_DIRS  extra space-separated read-only dirs the guest reads with a page cache
#                    (ci/cached-dirs.sh; the python's prefixes and HIXL_VLLM_VENV always are)
#   RXE_VM_PASS_ENV  extra space-separated variable names to pass into the guest
#                    (PATH, PYTHON, PYTHONPATH, VIRTUAL_ENV, PYENV_VERSION, LANG, LC_ALL,
#                     CI and every HIXL_* / PYTEST_* variable are always passed)
# In the guest: RXE_DEV=rxe0 RXE_IP=192.168.77.1 RXE_GID_INDEX=1 are exported, and
# HIXL_DEVICE / HIXL_GID_INDEX are not set: the library's own device and GID auto-selection is
# what runs (and is tested) in the guest; pass them from the host to override.
#
# Exit status: CMD's status; 97 if rxe0 never came up; 98 if the guest produced no
# status (crash, panic); 124 if RXE_VM_TIMEOUT expired; 2 on usage/setup errors.
set -euo pipefail

log() { echo "[ci] $*"; }
die() { local rc="$1"; shift; echo "[ci] ERROR: $*" >&2; exit "$rc"; }

[ "$#" -ge 1 ] || die 2 "usage: $0 CMD [ARG...]"

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
ART="${RXE_ARTIFACTS:-$REPO/ci-artifacts}"
mkdir -p "$ART"
ART="$(cd "$ART" && pwd -P)"
CPUS="${RXE_VM_CPUS:-2}"
MEMORY="${RXE_VM_MEMORY:-4G}"
TIMEOUT_S="${RXE_VM_TIMEOUT:-1800}"

if [ -n "${RXE_VM_KERNEL:-}" ]; then
    KERNEL="$RXE_VM_KERNEL"
else
    KERNEL="$(ls -1 /boot/vmlinuz-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)"
fi
[ -n "$KERNEL" ] && [ -r "$KERNEL" ] \
    || die 2 "no readable guest kernel (/boot/vmlinuz-*-amd64); run ci/install-deps.sh or set RXE_VM_KERNEL"
KVER="${KERNEL##*/vmlinuz-}"
find "/lib/modules/$KVER" -name 'rdma_rxe.ko*' 2>/dev/null | grep -q . \
    || die 2 "no rdma_rxe module under /lib/modules/$KVER"
VNG="${RXE_VNG:-$(command -v vng || true)}"
if [ -z "$VNG" ]; then  # pip-installed but not on PATH (e.g. pyenv without rehash)
    VNG="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)/vng"
fi
[ -x "$VNG" ] || die 2 "vng (virtme-ng) not found; run ci/install-deps.sh"
command -v qemu-system-x86_64 >/dev/null || die 2 "qemu-system-x86_64 not found"

# Python the tests should use; resolved on the host so pyenv shims are not needed in the guest.
HOST_PY="${PYTHON:-$(python3 -c 'import sys; print(sys.executable)' 2>/dev/null || command -v python3 || true)}"

# The interpreters' trees, read through a page cache in the guest (ci/cached-dirs.sh).
. "$REPO/ci/cached-dirs.sh"
mapfile -t CACHED < <(cached_dirs "$HOST_PY" ${HIXL_VLLM_VENV:-} ${RXE_VM_CACHED_DIRS:-})

# One VM per artifact dir: parallel runs must use distinct RXE_ARTIFACTS.
exec 9>"$ART/.lock"
flock -n 9 || die 2 "another ci/rxe-vm.sh is using $ART; set RXE_ARTIFACTS to a different dir"

RC_FILE="$ART/rc"
UP_FILE="$ART/rxe-up"
GUEST_SCRIPT="$ART/guest-run.sh"
CONSOLE_LOG="$ART/vm-console.log"
rm -f "$RC_FILE" "$RC_FILE.tmp" "$UP_FILE" "$GUEST_SCRIPT"

# ---- guest script (generated so that CMD's quoting survives --exec untouched) ----
{
    echo '#!/usr/bin/env bash'
    echo 'set -uo pipefail'
    echo 'echo "[ci] guest userspace up at uptime $(cut -d" " -f1 /proc/uptime)s"'
    printf 'export HOME=/root\n'
    cached_dirs_mounts "${CACHED[@]}"
    # Put the real interpreter's bin dir first: a pyenv shim costs ~15-20 s per call under TCG.
    GUEST_PATH="$PATH"
    if [ -n "$HOST_PY" ] && [ -x "$(dirname "$HOST_PY")/python3" ]; then
        GUEST_PATH="$(dirname "$HOST_PY"):$PATH"
    fi
    printf 'export PATH=%q\n' "$GUEST_PATH"
    [ -n "$HOST_PY" ] && printf 'export PYTHON=%q\n' "$HOST_PY"
    printf 'export PYTHONDONTWRITEBYTECODE=1\n'
    printf 'export RXE_ARTIFACTS=%q\n' "$ART"
    printf 'export RXE_DEV=rxe0 RXE_IP=192.168.77.1 RXE_GID_INDEX=1\n'
    pass=(PYTHONPATH VIRTUAL_ENV PYENV_VERSION LANG LC_ALL CI RXE_WAIT_S ${RXE_VM_PASS_ENV:-})
    pass+=($(compgen -v | grep -E '^(HIXL_|PYTEST_)' || true))
    for v in "${pass[@]}"; do
        if [ -n "${!v+x}" ]; then printf 'export %s=%q\n' "$v" "${!v}"; fi
    done
    echo '[ -w "$HOME" ] || export XDG_CACHE_HOME=/tmp/.cache'
    printf 'cd %q || exit 1\n' "$REPO"
    printf 'if ! bash %q %q; then\n' "$REPO/ci/guest-setup-rxe.sh" "$ART"
    echo '    echo "[ci] ERROR: rxe setup failed in guest"; sync; exit 1'
    echo 'fi'
    echo 'ulimit -l unlimited || echo "[ci] WARNING: ulimit -l unlimited failed"'
    echo 'ulimit -n 65536 2>/dev/null || true'
    printf 'echo %q\n' "[ci] guest running (cwd $REPO): $(printf '%q ' "$@")"
    printf '%q ' "$@"; echo '</dev/null'
    echo 'rc=$?'
    echo 'echo "[ci] guest command exit status: $rc"'
    printf 'echo "$rc" > %q && mv %q %q\n' "$RC_FILE.tmp" "$RC_FILE.tmp" "$RC_FILE"
    echo 'sync'
    echo 'exit "$rc"'
} > "$GUEST_SCRIPT"
chmod +x "$GUEST_SCRIPT"

RWDIRS=("$REPO")
case "$ART/" in "$REPO"/*) ;; *) RWDIRS+=("$ART");; esac
for d in ${RXE_VM_RWDIRS:-}; do RWDIRS+=("$(cd "$d" && pwd -P)"); done
VNG_ARGS=(--run "$KERNEL" --disable-kvm --disable-microvm
          --memory "$MEMORY" --cpus "$CPUS" --cwd "$REPO")
for d in "${RWDIRS[@]}"; do VNG_ARGS+=(--rwdir "$d"); done
[ "${#CACHED[@]}" -eq 0 ] || VNG_ARGS+=(--qemu-opts="$(cached_dirs_qemu "${CACHED[@]}")")
VNG_ARGS+=(--exec "bash $(printf '%q' "$GUEST_SCRIPT")")

log "kernel $KERNEL, TCG, cpus=$CPUS memory=$MEMORY timeout=${TIMEOUT_S}s"
log "rwdirs: ${RWDIRS[*]}; artifacts: $ART; python: ${HOST_PY:-<none>}"
log "read through the guest's page cache: ${CACHED[*]:-<none>}"
log "command: $*"
start=$(date +%s)
set +e
# stdin from /dev/null: CI has none, and an interactive tty must not be put in raw mode.
timeout -k 30 "$TIMEOUT_S" "$VNG" "${VNG_ARGS[@]}" </dev/null 2>&1 | tee "$CONSOLE_LOG"
vng_rc=${PIPESTATUS[0]}
set -e
log "VM finished after $(( $(date +%s) - start ))s (vng exit status $vng_rc)"

if [ -f "$RC_FILE" ]; then
    [ -f "$UP_FILE" ] || die 97 "exit status present but no $UP_FILE (stale artifacts?)"
    rc="$(tr -dc '0-9' < "$RC_FILE")"
    [ -n "$rc" ] || die 98 "unparsable exit status in $RC_FILE"
    log "guest command exit status: $rc"
    exit "$rc"
fi
# No status file.  (vng mirrors the guest's exit status, so 124 is only trusted here.)
if [ "$vng_rc" -eq 124 ] || [ "$vng_rc" -eq 137 ]; then
    if [ -f "$UP_FILE" ]; then up="rxe0 had come up"; else up="rxe0 had NOT come up yet"; fi
    die 124 "VM killed by timeout after ${TIMEOUT_S}s ($up); raise RXE_VM_TIMEOUT or see $CONSOLE_LOG"
fi
if [ ! -f "$UP_FILE" ]; then
    die 97 "rxe0 never came up in the guest (no $UP_FILE); see $CONSOLE_LOG"
fi
die 98 "guest wrote no exit status ($RC_FILE missing: crash or panic); see $CONSOLE_LOG"
