#!/usr/bin/env bash
# Runs INSIDE a guest (root). Usage: guest.sh A|B STATE_DIR
# A = 192.168.88.1 (ib_write_bw server / receiver), B = 192.168.88.2 (client / sender); with
# TV_CMD_A / TV_CMD_B set, that role runs the command instead of the phases (cwd: TV_REPO).
# Sync is via files in STATE_DIR (host dir shared with --rwdir). Only 192.168.88.0/24 is used.
set -uo pipefail
ROLE="$1"; ST="$2"
MAC_A=52:54:00:88:00:01; MAC_B=52:54:00:88:00:02
if [ "$ROLE" = A ]; then PEER=B; MYMAC=$MAC_A; MYIP=192.168.88.1; PEERIP=192.168.88.2
else PEER=A; MYMAC=$MAC_B; MYIP=192.168.88.2; PEERIP=192.168.88.1; fi
SIZE="${TV_SIZE:-65536}"; ITERS="${TV_ITERS:-2000}"; PHASE_T="${TV_PHASE_T:-150}"
PHASES="${TV_PHASES:-clean loss1 loss10_d flap flap_u20}"
t0=$(cut -d' ' -f1 /proc/uptime)
log() { echo "[$ROLE $(cut -d' ' -f1 /proc/uptime)] $*"; }
finish() { local rc=$1; log "exit $rc"; echo "$rc" > "$ST/$ROLE.rc"; sync; exit "$rc"; }
# wait_for FILE SECONDS: 0 when FILE appears; 1 on timeout or when the peer/host gave up
wait_for() {
    local f="$1" n=$(( $2 * 5 ))
    while [ "$n" -gt 0 ]; do
        [ -e "$f" ] && return 0
        if [ -e "$ST/$PEER.dead" ] || [ -e "$ST/$PEER.rc" ] || [ -e "$ST/abort" ]; then
            log "peer $PEER gone/abort while waiting for ${f##*/}"; return 1; fi
        sleep 0.2; n=$((n - 1))
    done
    log "timeout waiting for ${f##*/}"; return 1
}
log "userspace up (uptime ${t0}s), kernel $(uname -r), $(nproc) cpu"
ulimit -l unlimited
NIC=""
for a in /sys/class/net/*/address; do
    [ "$(cat "$a")" = "$MYMAC" ] && NIC="$(basename "$(dirname "$a")")"
done
[ -n "$NIC" ] || { log "ERROR: no NIC with MAC $MYMAC"; ip -br link; finish 3; }
log "NIC $NIC ($MYMAC) -> $MYIP/24"
ip link set lo up
ip addr add "$MYIP/24" dev "$NIC"
ip link set "$NIC" up
modprobe rdma_rxe || finish 4
rdma link add rxe0 type rxe netdev "$NIC" || finish 4
GIDX=""
for _ in $(seq 1 120); do
    if ibv_devinfo -d rxe0 2>/dev/null | grep -q PORT_ACTIVE; then
        for g in /sys/class/infiniband/rxe0/ports/1/gids/*; do
            i="${g##*/}"
            if grep -q '^0000:0000:0000:0000:0000:ffff:' "$g" 2>/dev/null &&
               grep -q 'v2' "/sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$i" 2>/dev/null; then
                GIDX=$i; break; fi
        done
        [ -n "$GIDX" ] && break
    fi
    sleep 0.5
done
[ -n "$GIDX" ] || { log "ERROR: rxe0 not ACTIVE / no IPv4 RoCEv2 GID"; ibv_devinfo -d rxe0; finish 5; }
log "rxe0 PORT_ACTIVE, IPv4 RoCEv2 GID index $GIDX = $(cat /sys/class/infiniband/rxe0/ports/1/gids/$GIDX)"
ibv_devinfo -d rxe0 | grep -E 'state|active_mtu|link_layer'
touch "$ST/$ROLE.up"
[[ " ${TV_TEST:-} " == *" fail$ROLE "* ]] && { log "TEST: failing on purpose"; finish 42; }
[[ " ${TV_TEST:-} " == *" hang$ROLE "* ]] && { log "TEST: hanging on purpose"; sleep 100000; }
wait_for "$ST/$PEER.up" 400 || finish 6
busybox ping -c 3 -W 2 "$PEERIP" || { log "ERROR: ping $PEERIP failed"; finish 7; }

# A command for this role (TV_CMD_A / TV_CMD_B): run it instead of the ib_write_bw phases, with the
# link described in its environment; its exit status is the guest's.
CMD_VAR="TV_CMD_$ROLE"
if [ -n "${!CMD_VAR:-}" ]; then
    export TV_ROLE="$ROLE" TV_ST="$ST" TV_NIC="$NIC" TV_MYIP="$MYIP" TV_PEERIP="$PEERIP" TV_GIDX="$GIDX"
    export HIXL_DEVICE=rxe0 HIXL_GID_INDEX="$GIDX" PYTHONDONTWRITEBYTECODE=1 HOME=/root
    [ -n "${TV_REPO:-}" ] && cd "$TV_REPO"
    log "running: ${!CMD_VAR}"
    bash -c "${!CMD_VAR}" </dev/null
    finish $?
fi

HWC=/sys/class/infiniband/rxe0/ports/1/hw_counters
hwc() { for f in "$HWC"/*; do echo "${f##*/}=$(cat "$f")"; done; }
hwdelta() {  # nonzero deltas between two hwc snapshots
    awk -F= 'NR==FNR {a[$1]=$2; next} ($2-a[$1])!=0 {printf "%s+%d ", $1, $2-a[$1]}' "$1" "$2"; }
stat_() { cat "/sys/class/net/$NIC/statistics/$1"; }
bw_of() { awk -v s="$SIZE" '$1==s && NF>=5 {print $4}' "$1" | tail -1; }
fail=0; p=0
for P in $PHASES; do
    p=$((p + 1)); port=$((18600 + p)); extra=(); iters=$ITERS
    case "$P" in flap*) iters=$((ITERS * 2));; esac
    case "$P" in *_u20) extra=(-u 20);; esac
    nopt=(-n "$iters")
    case "$P" in *_d) nopt=(-D "${TV_DUR:-30}");; esac   # duration mode: BW even if slow
    out="$ST/$ROLE.$P.out"
    hwc > "$ST/$ROLE.$P.hw0";
    tx0=$(stat_ tx_bytes); rx0=$(stat_ rx_bytes); s0=$(date +%s.%N)
    if [ "$ROLE" = A ]; then
        timeout "$PHASE_T" ib_write_bw -d rxe0 -x "$GIDX" -s "$SIZE" "${nopt[@]}" -F -p "$port" "${extra[@]}" >"$out" 2>&1 &
        spid=$!
        for _ in $(seq 1 100); do ss -ltn | grep -q ":$port " && break; sleep 0.2; done
        touch "$ST/A.$P.ready"
        wait "$spid"; rc=$?
    else
        wait_for "$ST/A.$P.ready" 200 || finish 8
        case "$P" in
            loss1|loss1_d)  tc qdisc add dev "$NIC" root netem loss 1% ;;
            loss10|loss10_d) tc qdisc add dev "$NIC" root netem loss 10% ;;
        esac
        timeout "$PHASE_T" ib_write_bw -d rxe0 -x "$GIDX" -s "$SIZE" "${nopt[@]}" -F -p "$port" "${extra[@]}" "$PEERIP" >"$out" 2>&1 &
        cpid=$!
        case "$P" in flap*)
            sleep 4; log "$P: link down"; ip link set "$NIC" down; sleep 0.5; ip link set "$NIC" up; log "$P: link up"
            ;; esac
        wait "$cpid"; rc=$?
        case "$P" in flap*) log "$P: GID[$GIDX] now $(cat /sys/class/infiniband/rxe0/ports/1/gids/$GIDX)"; dmesg | tail -n 4;; esac
        tc -s qdisc show dev "$NIC" | grep -A2 netem | tr '\n' ' '; echo
        tc qdisc del dev "$NIC" root 2>/dev/null
    fi
    s1=$(date +%s.%N); tx1=$(stat_ tx_bytes); rx1=$(stat_ rx_bytes)
    hwc > "$ST/$ROLE.$P.hw1"
    echo "HW role=$ROLE phase=$P $(hwdelta "$ST/$ROLE.$P.hw0" "$ST/$ROLE.$P.hw1")" | tee -a "$ST/results.txt"
    [ "$rc" -eq 0 ] || { fail=$((fail + 1)); tail -n 5 "$out" | sed "s/^/[$ROLE $P out] /"; }
    echo "RESULT role=$ROLE phase=$P rc=$rc bw_avg_MBps=$(bw_of "$out") iters=$iters wall_s=$(echo "$s1 - $s0" | bc) tx_bytes=$((tx1 - tx0)) rx_bytes=$((rx1 - rx0)) port=$(ibv_devinfo -d rxe0 | awk '/state:/{print $2}')" | tee -a "$ST/results.txt"
    touch "$ST/$ROLE.$P.done"
    wait_for "$ST/$PEER.$P.done" $((PHASE_T + 60)) || finish 9
    # make sure the link (and route/neighbour) is usable before the next phase
    [ "$P" = "${PHASES##* }" ] || busybox ping -c 1 -W 3 "$PEERIP" >/dev/null || log "WARN: ping after $P failed"
done
finish $(( fail > 0 ? 1 : 0 ))
