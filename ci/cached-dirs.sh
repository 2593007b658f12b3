# Sourced by ci/rxe-vm.sh and ci/two-vm/two-vm.sh: read-only trees a guest reads most (the Python
# interpreters and their packages) get a 9p share of their own, mounted in the guest with cache=loose.
#
# A guest sees the host's root over 9p without a cache: every import re-reads its files (and stats its
# directories) through the emulated device, and under TCG that is most of an import's time (numpy about
# 13 s, torch about 2 minutes). With the guest's page cache on these trees an import takes about half as
# long the first time and less after. They must not change while a guest runs: nothing writes there
# during a run (the wheels are installed before, bytecode is not written).
#
# cached_dirs PYTHON [DIR...]: the interpreter's prefixes and the extra dirs that exist, one per line.
# cached_dirs_qemu DIR...: the QEMU options sharing them (tags hixlro0, hixlro1, ...).
# cached_dirs_mounts DIR...: guest shell lines mounting them over the same paths.

cached_dirs() {
    local py="$1" d
    shift
    {
        [ -n "$py" ] && "$py" -c 'import sys; print(sys.base_prefix); print(sys.prefix)' 2>/dev/null
        for d in "$@"; do [ -n "$d" ] && echo "$d"; done
    } | while read -r d; do
        [ -d "$d" ] || continue
        d="$(cd "$d" && pwd -P)"
        case "$d" in /|/usr|/proc*|/sys*|/dev*|*,*|*" "*) continue ;; esac  # not shareable this way
        echo "$d"
    done | sort -u
}

cached_dirs_qemu() {
    local i=0 d
    for d in "$@"; do
        printf -- '-virtfs local,path=%s,mount_tag=hixlro%d,security_model=none,readonly=on ' "$d" "$i"
        i=$((i + 1))
    done
}

cached_dirs_mounts() {
    local i=0 d
    for d in "$@"; do
        printf 'mount -t 9p -o trans=virtio,version=9p2000.L,cache=loose,msize=512000,ro hixlro%d %q' "$i" "$d"
        printf ' || echo "[ci] WARNING: no cached mount of %s (it stays on the uncached root)"\n' "$d"
        i=$((i + 1))
    done
}
