#!/usr/bin/env bash
# Runs INSIDE the guest (as root): bring up Soft-RoCE device rxe0 on a veth pair.
# Usage: ci/guest-setup-rxe.sh [ARTIFACT_DIR]
# Writes ARTIFACT_DIR/rxe-up only once rxe0 port 1 is PORT_ACTIVE with a GID at index 1.
# Only the local veth address 192.168.77.1 is used; no traffic leaves the guest.
set -euo pipefail

log() { echo "[ci] $*"; }

ART="${1:-${RXE_ARTIFACTS:-}}"
RXE_DEV="${RXE_DEV:-rxe0}"
RXE_IP="${RXE_IP:-192.168.77.1}"
WAIT_S="${RXE_WAIT_S:-60}"

if [ -n "$ART" ]; then
    rm -f "$ART/rxe-up"
fi

log "guest kernel $(uname -r), $(nproc) cpus, $(awk '/MemTotal/ {print $2" kB"}' /proc/meminfo)"
log "modprobe rdma_rxe"
modprobe rdma_rxe

if ! ip link show veth0 >/dev/null 2>&1; then
    log "creating veth0/veth1, $RXE_IP/24 on veth0"
    ip link add veth0 type veth peer name veth1
    ip addr add "$RXE_IP/24" dev veth0
fi
ip link set lo up
ip link set veth0 up
ip link set veth1 up

if ! rdma link show "$RXE_DEV/1" >/dev/null 2>&1; then
    log "rdma link add $RXE_DEV type rxe netdev veth0"
    rdma link add "$RXE_DEV" type rxe netdev veth0
fi

GID_FILE="/sys/class/infiniband/$RXE_DEV/ports/1/gids/1"
ZERO_GID="0000:0000:0000:0000:0000:0000:0000:0000"
log "waiting up to ${WAIT_S}s for $RXE_DEV PORT_ACTIVE"
ok=0
for _ in $(seq 1 "$((WAIT_S * 2))"); do
    if ibv_devinfo -d "$RXE_DEV" 2>/dev/null | grep -q PORT_ACTIVE \
        && [ -r "$GID_FILE" ] && [ "$(cat "$GID_FILE")" != "$ZERO_GID" ]; then
        ok=1
        break
    fi
    sleep 0.5
done

log "ibv_devices:"
ibv_devices || true
log "ibv_devinfo -v -d $RXE_DEV (head):"
ibv_devinfo -v -d "$RXE_DEV" 2>&1 | head -n 30 || true
log "GID[1] of $RXE_DEV port 1: $(cat "$GID_FILE" 2>/dev/null || echo '<missing>')"
log "rdma link: $(rdma link show 2>&1 | tr '\n' ' ')"

if [ "$ok" -ne 1 ]; then
    log "ERROR: $RXE_DEV did not become PORT_ACTIVE with a valid GID[1] within ${WAIT_S}s"
    exit 1
fi
log "$RXE_DEV is PORT_ACTIVE"
if [ -n "$ART" ]; then
    echo "$RXE_DEV $(cat "$GID_FILE")" > "$ART/rxe-up"
fi
