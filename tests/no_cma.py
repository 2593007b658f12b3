"""Forbid cross-memory attach in this process, as a container's seccomp profile does.

Docker's default seccomp profile refuses process_vm_readv/process_vm_writev to a container without
CAP_SYS_PTRACE; Yama's ptrace_scope refuses them between processes that are not ancestor and
descendant. Both end in EPERM. ``forbid_cross_memory_attach()`` installs a seccomp filter on every
thread of this process that makes exactly these two system calls fail with EPERM, then checks that
they do (so a test built on it cannot pass with the filter silently missing).
"""
import ctypes
import ctypes.util
import errno
import os
import platform

# (AUDIT_ARCH_*, process_vm_readv, process_vm_writev)
_ARCH = {"x86_64": (0xC000003E, 310, 311), "aarch64": (0xC00000B7, 270, 271)}
_SECCOMP_SYSCALL = {"x86_64": 317, "aarch64": 277}
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def supported() -> bool:
    return platform.system() == "Linux" and platform.machine() in _ARCH


def forbid_cross_memory_attach() -> None:
    arch, nr_read, nr_write = _ARCH[platform.machine()]
    ld_w_abs, jeq_k, ret_k = 0x20, 0x15, 0x06
    insns = [
        (ld_w_abs, 0, 0, 4),         # 0: A = seccomp_data.arch
        (jeq_k, 0, 3, arch),         # 1: another ABI: allow (jump to 5)
        (ld_w_abs, 0, 0, 0),         # 2: A = seccomp_data.nr
        (jeq_k, 2, 0, nr_read),      # 3: -> 6
        (jeq_k, 1, 0, nr_write),     # 4: -> 6
        (ret_k, 0, 0, _RET_ALLOW),   # 5
        (ret_k, 0, 0, _RET_ERRNO | errno.EPERM),  # 6
    ]
    arr = (_Insn * len(insns))(*[_Insn(*i) for i in insns])
    prog = _Prog(len(insns), arr)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.syscall(_SECCOMP_SYSCALL[platform.machine()], _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC,
                    ctypes.byref(prog)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER, TSYNC)")
    # Prove it: reading our own memory through process_vm_readv must now fail with EPERM.
    src, dst = ctypes.c_uint64(42), ctypes.c_uint64(0)
    local = _Iovec(ctypes.cast(ctypes.byref(dst), ctypes.c_void_p), 8)
    remote = _Iovec(ctypes.cast(ctypes.byref(src), ctypes.c_void_p), 8)
    n = libc.syscall(nr_read, os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if n != -1 or ctypes.get_errno() != errno.EPERM:
        raise RuntimeError("seccomp filter installed but process_vm_readv still returned %d (errno %d)"
                           % (n, ctypes.get_errno()))
