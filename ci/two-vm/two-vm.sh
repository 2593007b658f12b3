#!/usr/bin/env bash
# Two QEMU/TCG guests (virtme-ng, Debian 6.1 kernel) joined by a QEMU link on 127.0.0.1 (TCP
# "stream" by default, UDP "dgram" optional); each runs Soft-RoCE rxe0 on its virtio-net NIC; guest.sh
# runs TV_CMD_A / TV_CMD_B in them (tier 4: tests/twohost), or else ib_write_bw phases.
# Usage: ci/two-vm/two-vm.sh    (env: see ci/two-vm/README.md)
# Exit: 0 if both guests exit 0 (a guest removed on request does not count); else the first non-zero
# of A, B; 124 on total timeout.
set -uo pipefail
# The state dir (shared writable with both guests: sync files, logs, results); the guest script is
# read from this repository (the guests see the host's root read-only).
DIR="${TV_DIR:-/tmp/twovm}"
GUEST_SH="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)/guest.sh"
KERNEL="${TV_KERNEL:-$(ls -1 /boot/vmlinuz-*-amd64 | sort -V | tail -n 1)}"
TOTAL_T="${TV_TIMEOUT:-900}"; GRACE="${TV_GRACE:-60}"
LINK="${TV_LINK:-stream}"   # dgram (UDP, lossy under host load) | stream (TCP, lossless)
CPUS="${TV_CPUS:-1}"; MEM="${TV_MEM:-2G}"
TV_VERBOSE="${TV_VERBOSE-1}"   # 1: guest kernel console in the log (set empty to disable)
RUN="$(date +%Y%m%d-%H%M%S)"; ST="$DIR/state/$RUN"; mkdir -p "$ST"; DIR="$(cd "$DIR" && pwd -P)"; ST="$DIR/state/$RUN"
ln -sfn "$ST" "$DIR/state/latest"
VNG="$(command -v vng)"
for _ in $(seq 1 50); do  # two ports nobody listens on (other work may run beside this, e.g. vLLM in CI)
    base=$(( 40000 + (RANDOM % 1000) * 2 ))
    ss -Htan | awk '{print $4}' | grep -Eq ":($base|$((base + 1)))\$" || break
done
PORT_A=$base; PORT_B=$((base + 1))
log() { echo "[host $(date +%T)] $*" | tee -a "$ST/host.log"; }

# What the guests get: the phase settings, the commands, the repository and its Python (the guest
# sees the host's root read-only; PATH as here, so the same python3 runs there).
ENV_FILE="$ST/guest-env.sh"
. "$(dirname "$GUEST_SH")/../cached-dirs.sh"  # the interpreters' trees, through the guests' page cache
mapfile -t CACHED < <(cached_dirs "${PYTHON:-$(command -v python3)}" ${TV_CACHED_DIRS:-})
{
    echo '#!/usr/bin/env bash'
    cached_dirs_mounts "${CACHED[@]}"
    for v in TV_PHASES TV_ITERS TV_SIZE TV_PHASE_T TV_DUR TV_TEST TV_CMD_A TV_CMD_B TV_REPO PATH PYTHONPATH \
             VIRTUAL_ENV HIXL_LOG_LEVEL PYTEST_DISABLE_PLUGIN_AUTOLOAD; do
        [ -n "${!v+x}" ] && printf 'export %s=%q\n' "$v" "${!v}"
    done
    printf 'exec bash %q "$1" %q\n' "$GUEST_SH" "$ST"
} > "$ENV_FILE"

start_guest() {  # ROLE MAC LOCALPORT REMOTEPORT
    local r=$1 mac=$2 lp=$3 rp=$4
    local nd
    case "$LINK" in
      dgram)  nd="dgram,id=xn0,local.type=inet,local.host=127.0.0.1,local.port=$lp,remote.type=inet,remote.host=127.0.0.1,remote.port=$rp" ;;
      stream) if [ "$r" = A ]; then nd="stream,id=xn0,server=on,addr.type=inet,addr.host=127.0.0.1,addr.port=$lp"
              else nd="stream,id=xn0,server=off,addr.type=inet,addr.host=127.0.0.1,addr.port=$rp"; fi ;;
    esac
    local qo="-netdev $nd -device virtio-net-pci,netdev=xn0,mac=$mac $(cached_dirs_qemu "${CACHED[@]}")"
    # setsid: own process group (= this PID) so the whole vng+qemu tree can be killed at once
    setsid timeout -k 15 "$TOTAL_T" "$VNG" --run "$KERNEL" --disable-kvm --disable-microvm \
        --cpus "$CPUS" --memory "$MEM" --name "vm-$r" ${TV_VERBOSE:+--verbose} --rwdir "$DIR" --cwd "$DIR" \
        --qemu-opts="$qo" \
        --exec "bash $ENV_FILE $r" \
        </dev/null >>"$ST/$r-console.log" 2>&1 &   # >>: qemu reopens fd 1 via /proc/self/fd/1 without O_APPEND
    PID[$r]=$!   # no $(...): the guest must stay a child of this shell for wait
}
log "run $ST kernel=$KERNEL cpus=$CPUS mem=$MEM link=$LINK 127.0.0.1:$PORT_A<->$PORT_B timeout=${TOTAL_T}s"
log "read through the guests' page cache: ${CACHED[*]:-<none>}"
t0=$(date +%s)
declare -A PID=() RC=()
# Stopped from outside (CI's run ends early): the guests, each in a session of its own, go too.
stop_guests() { for r in "${!PID[@]}"; do [ -n "${RC[$r]+x}" ] || kill -KILL -- "-${PID[$r]}" 2>/dev/null; done; }
trap stop_guests EXIT
trap 'exit 143' TERM INT
start_guest A 52:54:00:88:00:01 "$PORT_A" "$PORT_B"
if [ "$LINK" = stream ]; then  # QEMU 7.2 stream client does not retry: wait for A's listener
    for _ in $(seq 1 100); do ss -ltn | grep -q "127.0.0.1:$PORT_A " && break; sleep 0.2; done
fi
start_guest B 52:54:00:88:00:02 "$PORT_B" "$PORT_A"
first=""; deadline=""
while [ "${#RC[@]}" -lt 2 ]; do
    for r in A B; do  # a guest asked the host to remove the other one (a host that vanishes)
        if [ -e "$ST/kill.$r" ] && [ -z "${RC[$r]+x}" ] && [ ! -e "$ST/killed.$r" ]; then
            log "killing guest $r on request (kill.$r)"
            kill -KILL -- "-${PID[$r]}" 2>/dev/null; touch "$ST/killed.$r"
        fi
        # ... or to freeze it (a host that hangs: its QEMU stopped, its NIC silent, its sockets open)
        # and, later, to let it go on
        if [ -e "$ST/stop.$r" ] && [ -z "${RC[$r]+x}" ]; then
            log "freezing guest $r on request (stop.$r)"
            rm -f "$ST/stop.$r"; kill -STOP -- "-${PID[$r]}" 2>/dev/null; touch "$ST/stopped.$r"
        fi
        if [ -e "$ST/cont.$r" ] && [ -z "${RC[$r]+x}" ]; then
            log "resuming guest $r on request (cont.$r)"
            rm -f "$ST/cont.$r" "$ST/stopped.$r"; kill -CONT -- "-${PID[$r]}" 2>/dev/null; touch "$ST/resumed.$r"
        fi
    done
    for r in A B; do
        [ -n "${RC[$r]+x}" ] && continue
        if ! kill -0 "${PID[$r]}" 2>/dev/null; then
            wait "${PID[$r]}"; RC[$r]=$?
            log "guest $r exited rc=${RC[$r]} after $(( $(date +%s) - t0 ))s"
            touch "$ST/$r.dead"   # lets the other guest's wait loops give up early
            if [ -z "$first" ] && [ ! -e "$ST/killed.$r" ]; then  # (a guest removed on request: no grace)
                first=$r
                g=$GRACE; [ "${RC[$r]}" -eq 0 ] || g=30
                deadline=$(( $(date +%s) + g ))
            fi
        fi
    done
    if [ -n "$deadline" ] && [ "${#RC[@]}" -lt 2 ] && [ "$(date +%s)" -ge "$deadline" ]; then
        for r in A B; do
            [ -n "${RC[$r]+x}" ] && continue
            log "killing guest $r (peer $first exited, grace over)"
            kill -TERM -- "-${PID[$r]}" 2>/dev/null; sleep 5; kill -KILL -- "-${PID[$r]}" 2>/dev/null
        done
        deadline=""
    fi
    sleep 0.2  # a guest's kill/stop/cont request is acted on within this
done
for r in A B; do
    g="$(cat "$ST/$r.rc" 2>/dev/null || echo none)"
    log "guest $r: vng rc=${RC[$r]} guest rc file=$g; userspace-up: $(grep -m1 -o 'userspace up (uptime [0-9.]*s)' "$ST/$r-console.log")"
done
log "results:"; cat "$ST/results.txt" 2>/dev/null | tee -a "$ST/host.log"
rc=0
for r in A B; do [ -e "$ST/killed.$r" ] || [ "${RC[$r]}" -eq 0 ] || { rc=${RC[$r]}; break; }; done
log "total $(( $(date +%s) - t0 ))s, exit $rc"
exit "$rc"
