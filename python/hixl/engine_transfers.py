"""The data-moving methods of ``hixl.Hixl``: one-sided READ/WRITE by descriptor list or array,
prepared descriptor lists, and the requests' status. A mixin of :class:`hixl.Hixl` (its state and
helpers: ``_engine``, ``_finalized``, ``_tls``, ``_marks``, ``_good_remotes``, ``_refuse``,
``_refuse_transfer``, ``_set_error``, ``_done``, ``_failed``, ``_remote``, ``_timeout``,
``_wait_ms``), kept in its own file so that ``engine.py`` stays the engine's lifecycle, memory,
links and notifies.

The per-request calls of a Python loop (``transfer_async`` with one descriptor, ``transfer_wait``,
``get_transfer_status``) also exist in C (``_core.fast_call``, csrc/bindings/fast_calls.cc): an
initialized engine holds them in its instance dict, where ``h.transfer_async(...)`` finds them
first. They take the same common call as the Python methods' own fast paths, with the same checks,
and hand every other call to the Python method below, which stays the definition of the API.
"""
from __future__ import annotations

import operator
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core
from .descs import as_desc_array, as_u64_vector
from .engine_signals import _DEFAULT_TIMEOUT_MS, _INT32_MAX, _U64_LIMIT, _U64_MAX, _enum, _int
from .types import (
    FAILED,
    SUCCESS,
    GetTransferStatusArgs,
    TransferArgs,
    TransferOp,
    TransferResult,
    TransferStatus,
    validate_op_desc,
)

_STATUS = {int(m): m for m in TransferStatus}  # TransferStatus(v) costs a microsecond per call
_STATUSES = tuple(TransferStatus(v) for v in range(len(TransferStatus)))

# (method, _core.fast_call kind)
_FAST_CALLS = (("transfer_async", 0), ("transfer_wait", 1), ("get_transfer_status", 2))


class Transfers:
    """READ/WRITE, prepared descriptor lists and request status of a :class:`hixl.Hixl` (see the module)."""

    _engine: Any
    _finalized: bool
    _tls: Any
    _good_remotes: set
    _marks: Any

    def _install_fast_calls(self) -> None:
        """Put the C versions of the per-request calls in this engine's instance dict (after a
        successful initialize). A subclass that overrides one of these methods keeps its own."""
        d = self.__dict__
        for name, kind in _FAST_CALLS:
            method = getattr(type(self), name)
            if method is getattr(Transfers, name):
                d[name] = _core.fast_call(kind, self._engine, self._good_remotes, self._tls, self._marks, TransferOp,
                                          _STATUSES, method, self)

    def _drop_fast_calls(self) -> None:
        """Back to the Python methods (finalize, fork); a C call someone still holds hands every later
        call to the Python method too."""
        d = self.__dict__
        for name, _ in _FAST_CALLS:
            if type(d.get(name)) is _core.FastCall:  # (not what a user put there)
                d.pop(name).close()

    def _flag(self, v: Any, op: int) -> Optional[int]:
        """None -> -1 (no flag); a u32 with a WRITE -> itself; anything else None."""
        if v is None:
            return -1
        f = _int(v, 0, 2 ** 32 - 1)
        return f if f is not None and op == int(TransferOp.WRITE) else None

    def _descs(self, op_descs: Any) -> Union[np.ndarray, List[Tuple[int, int, int]], None]:
        """A list or tuple of TransferOpDesc as an (N, 3) uint64 array (fields that are plain ints, read
        in C++: no Python object per descriptor) or as (la, ra, len) tuples (numpy integers and the
        like), or None when it is not a valid one."""
        if not isinstance(op_descs, (list, tuple)) or not op_descs:
            return None
        if len(op_descs) > 1:
            arr = _core.descs_from_list(op_descs)
            if arr is not None:
                return arr
        out = []
        for d in op_descs:
            la, ra, n = (getattr(d, "local_addr", None), getattr(d, "remote_addr", None), getattr(d, "len", None))
            if type(la) is int and type(ra) is int and type(n) is int:  # the per-call fast path: plain ints
                if n <= 0 or la <= 0 or ra <= 0 or la + n > _U64_MAX + 1 or ra + n > _U64_MAX + 1:
                    return None
                out.append((la, ra, n))
            elif validate_op_desc(d) == SUCCESS and operator.index(la) and operator.index(ra):  # numpy ints etc.
                out.append((operator.index(la), operator.index(ra), operator.index(n)))
            else:
                return None
        return out

    # ----------------------------------------------------------------- transfers
    def transfer_sync(self, remote_engine: str, op: Any, op_descs: Sequence[Any],
                      timeout_in_millis: int = _DEFAULT_TIMEOUT_MS, *, flag: Optional[int] = None) -> int:
        """One-sided READ/WRITE of the peer's registered memory; TIMEOUT tears the link down
        so that no write of this call can land afterwards.

        ``flag`` (beyond CANN, WRITE only, u32): the peer receives it from :meth:`wait_flags` /
        :meth:`poll_flags` once every byte of this write, and of every earlier request to it, is in
        its memory (RDMA: WRITE_WITH_IMM; shm/tcp: a flag frame sent after the bytes landed)."""
        try:
            if self._finalized:
                return FAILED
            if self._remote(remote_engine) is None:
                return self._refuse_transfer("transfer_sync: bad remote_engine %r" % (remote_engine,))
            o = _enum(op, TransferOp)
            if o is None:
                return self._refuse_transfer("transfer_sync: op %r is not a TransferOp" % (op,))
            arr = as_desc_array(op_descs) if isinstance(op_descs, np.ndarray) else None
            descs = arr if arr is not None else self._descs(op_descs)
            if descs is None:
                return self._refuse_transfer("transfer_sync: op_descs must be a non-empty list of TransferOpDesc "
                                    "with non-zero u64 addresses and len > 0, or a descriptor array "
                                    "((N, 3) u64 or hixl.DESC_DTYPE)")
            t = self._timeout(timeout_in_millis)
            if t is None:
                return self._refuse_transfer("transfer_sync: timeout_in_millis %r must be in 1..2**31-1" % (timeout_in_millis,))
            f = self._flag(flag, o)
            if f is None:
                return self._refuse_transfer("transfer_sync: flag %r must be None or a u32, with op WRITE" % (flag,))
            if isinstance(descs, np.ndarray):
                return self._done(self._engine.transfer_sync_array(remote_engine, o, descs, t, f))
            return self._done(self._engine.transfer_sync(remote_engine, o, descs, t, f))
        except Exception as e:
            return self._failed("transfer_sync", e)

    def transfer_async(self, remote_engine: str, op: Any, op_descs: Sequence[Any],
                       args: Any = None, *, flag: Optional[int] = None,
                       timeout_in_millis: Optional[int] = None, optional_args: Any = None) -> Tuple[int, int]:
        """``(SUCCESS, req)``; req is 0 on failure. Poll it with :meth:`get_transfer_status` or
        block on it with :meth:`transfer_wait`. ``flag``: as for :meth:`transfer_sync`.

        ``timeout_in_millis`` (beyond CANN; default: the ``HixlAsyncTimeoutMs`` option, 60000, where
        0 means none): a request not complete by then ends TIMEOUT (or FAILED when the peer did
        not confirm it stopped, e.g. a hung peer) within a few seconds, and its link is aborted as
        for a :meth:`transfer_sync` TIMEOUT. A peer that stops answering the link's heartbeat
        (``HixlHeartbeatMs`` x ``HixlHeartbeatMisses``) ends its requests FAILED sooner."""
        try:
            if (args is None and optional_args is None and flag is None and timeout_in_millis is None
                    and not self._finalized and type(op) is TransferOp and type(remote_engine) is str
                    and remote_engine in self._good_remotes):
                # The common call, checked in fewer steps (the same checks): a known peer, a TransferOp,
                # no options. This is the per-request cost of a Python loop of small transfers.
                if type(op_descs) is list and len(op_descs) == 1:
                    d = op_descs[0]
                    la, ra, n = getattr(d, "local_addr", None), getattr(d, "remote_addr", None), getattr(d, "len", None)
                    if (type(la) is int and type(ra) is int and type(n) is int and 0 < n and 0 < la and 0 < ra
                            and la + n <= _U64_LIMIT and ra + n <= _U64_LIMIT):
                        rc, req = self._engine.transfer_async_one(remote_engine, op, la, ra, n)
                        self._set_error("" if rc == SUCCESS else self._engine.last_error())
                        return rc, req
                descs = self._descs(op_descs) if type(op_descs) is list else None
                if descs is not None:
                    if isinstance(descs, np.ndarray):
                        rc, req = self._engine.transfer_async_array(remote_engine, int(op), descs, 0, -1, -1)
                    else:
                        rc, req = self._engine.transfer_async(remote_engine, int(op), descs, 0, -1, -1)
                    self._set_error("" if rc == SUCCESS else self._engine.last_error())
                    return rc, req
            if self._finalized:
                return FAILED, 0
            if self._remote(remote_engine) is None:
                return self._refuse_transfer("transfer_async: bad remote_engine %r" % (remote_engine,)), 0
            o = _enum(op, TransferOp)
            if o is None:
                return self._refuse_transfer("transfer_async: op %r is not a TransferOp" % (op,)), 0
            arr = as_desc_array(op_descs) if isinstance(op_descs, np.ndarray) else None
            descs = arr if arr is not None else self._descs(op_descs)
            if descs is None:
                return self._refuse_transfer("transfer_async: op_descs must be a non-empty list of TransferOpDesc "
                                    "with non-zero u64 addresses and len > 0, or a descriptor array "
                                    "((N, 3) u64 or hixl.DESC_DTYPE)"), 0
            if args is None:
                args = TransferArgs() if optional_args is None else optional_args  # optional_args: our old name
            ud = _int(getattr(args, "user_data", None), 0, _U64_MAX)
            if ud is None:
                return self._refuse_transfer("transfer_async: user_data must be a u64"), 0
            f = self._flag(flag, o)
            if f is None:
                return self._refuse_transfer("transfer_async: flag %r must be None or a u32, with op WRITE" % (flag,)), 0
            t = -1
            if timeout_in_millis is not None:
                t = self._timeout(timeout_in_millis)
                if t is None:
                    return self._refuse_transfer("transfer_async: timeout_in_millis %r must be None or in 1..2**31-1"
                                        % (timeout_in_millis,)), 0
            if isinstance(descs, np.ndarray):
                rc, req = self._engine.transfer_async_array(remote_engine, o, descs, ud, f, t)
            else:
                rc, req = self._engine.transfer_async(remote_engine, o, descs, ud, f, t)
            return self._done(rc), req
        except Exception as e:
            return self._failed("transfer_async", e), 0

    # ------------------------------------------------------ prepared descriptor lists
    def prep_descs(self, addrs: Any, lens: Any, remote_engine: Optional[str] = None,
                   timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> Tuple[int, int]:
        """``(SUCCESS, handle)``: a prepared descriptor list of blocks ``[addrs[i], addrs[i]+lens[i])``
        (beyond CANN; see :mod:`hixl.descs`). ``remote_engine`` None: our registered memory; else a
        connected peer's (auto-connected with AutoConnect), each block inside a region it registered.
        ``addrs``: a sequence or 1-D array of ints; ``lens``: the same, or one int for all. Each
        block is validated and resolved to its region once, here; transfers then name blocks by
        index. A (de)registration on either side later makes the next transfer resolve the list
        again, and refuses a block that lost its region. PARAM_INVALID names the first bad block."""
        try:
            if self._finalized:
                return FAILED, 0
            a = as_u64_vector(addrs)
            n = as_u64_vector(lens, None if a is None else len(a))
            if a is None or n is None or len(a) != len(n):
                return self._refuse("prep_descs: addrs and lens must be equally long non-empty sequences of u64 "
                                    "(lens may be one int)"), 0
            remote = ""
            if remote_engine is not None:
                if self._remote(remote_engine) is None:
                    return self._refuse("prep_descs: bad remote_engine %r" % (remote_engine,)), 0
                remote = remote_engine
            t = self._timeout(timeout_in_millis)
            if t is None:
                return self._refuse("prep_descs: timeout_in_millis %r must be in 1..2**31-1" % (timeout_in_millis,)), 0
            rc, h = self._engine.prep_descs(remote, a, n, t)
            return self._done(rc), h
        except Exception as e:
            return self._failed("prep_descs", e), 0

    def release_descs(self, handle: Any) -> int:
        """Frees a prepared list; PARAM_INVALID for a handle not issued or already released."""
        try:
            if self._finalized:
                return FAILED
            h = _int(handle, 1, _U64_MAX)
            if h is None:
                return self._refuse("release_descs: handle %r is not a prepared list handle" % (handle,))
            return self._done(self._engine.release_descs(h))
        except Exception as e:
            return self._failed("release_descs", e)

    def _prepped(self, name: str, sync: bool, op: Any, local_descs: Any, local_idx: Any, remote_descs: Any,
                 remote_idx: Any, timeout: Any, flag: Any, user_data: Any) -> Tuple[int, int]:
        if self._finalized:
            return FAILED, 0
        o = _enum(op, TransferOp)
        if o is None:
            return self._refuse_transfer("%s: op %r is not a TransferOp" % (name, op)), 0
        lh, rh = _int(local_descs, 1, _U64_MAX), _int(remote_descs, 1, _U64_MAX)
        if lh is None or rh is None:
            return self._refuse_transfer("%s: local_descs and remote_descs must be prep_descs handles" % name), 0
        li, ri = as_u64_vector(local_idx), as_u64_vector(remote_idx)
        if li is None or ri is None or len(li) != len(ri):
            return self._refuse_transfer("%s: local_idx and remote_idx must be equally long non-empty sequences of "
                                "non-negative ints" % name), 0
        f = self._flag(flag, o)
        if f is None:
            return self._refuse_transfer("%s: flag %r must be None or a u32, with op WRITE" % (name, flag)), 0
        if sync:
            t = self._timeout(_DEFAULT_TIMEOUT_MS if timeout is None else timeout)
        else:
            t = -1 if timeout is None else self._timeout(timeout)
        if t is None:
            return self._refuse_transfer("%s: timeout_in_millis %r must be in 1..2**31-1" % (name, timeout)), 0
        ud = _int(user_data, 0, _U64_MAX)
        if ud is None:
            return self._refuse_transfer("%s: user_data must be a u64" % name), 0
        rc, req = self._engine.transfer_prepped(o, lh, li, rh, ri, sync, t, ud, f)
        return self._done(rc), req

    def transfer_prepped_async(self, op: Any, local_descs: int, local_idx: Any, remote_descs: int, remote_idx: Any,
                               *, flag: Optional[int] = None, timeout_in_millis: Optional[int] = None,
                               user_data: int = 0) -> Tuple[int, int]:
        """``(SUCCESS, req)`` like :meth:`transfer_async`, for the descriptors (block
        ``local_idx[i]`` of prepared list ``local_descs``, block ``remote_idx[i]`` of the peer's
        prepared list ``remote_descs``); the two blocks of each pair must have the same length.
        Indices: sequences or 1-D int arrays of equal length (numpy: no Python object per
        descriptor). Bad indices, lengths or access give PARAM_INVALID naming the pair."""
        try:
            return self._prepped("transfer_prepped_async", False, op, local_descs, local_idx, remote_descs,
                                 remote_idx, timeout_in_millis, flag, user_data)
        except Exception as e:
            return self._failed("transfer_prepped_async", e), 0

    def transfer_prepped_sync(self, op: Any, local_descs: int, local_idx: Any, remote_descs: int, remote_idx: Any,
                              timeout_in_millis: int = _DEFAULT_TIMEOUT_MS, *, flag: Optional[int] = None) -> int:
        """:meth:`transfer_sync` for prepared lists (see :meth:`transfer_prepped_async`)."""
        try:
            return self._prepped("transfer_prepped_sync", True, op, local_descs, local_idx, remote_descs, remote_idx,
                                 timeout_in_millis, flag, 0)[0]
        except Exception as e:
            return self._failed("transfer_prepped_sync", e)

    def get_transfer_status(self, req: Any) -> Tuple[int, TransferStatus]:
        """``(SUCCESS, status)``. After COMPLETED/FAILED the request is freed; an unknown
        request gives ``(PARAM_INVALID, TransferStatus.FAILED)``, request 0 (what a failed
        :meth:`transfer_async` hands out) ``(FAILED, TransferStatus.FAILED)``."""
        try:
            if self._finalized:
                return FAILED, TransferStatus.FAILED
            r = _int(req, 0, _U64_MAX)
            if r is None:
                return self._refuse("get_transfer_status: req %r is not an int" % (req,)), TransferStatus.FAILED
            if r == 0:
                self._set_error("FAILED: get_transfer_status: request 0 is no request (a failed transfer_async)")
                return FAILED, TransferStatus.FAILED
            rc, st = self._engine.transfer_status(r)
            return self._done(rc), _STATUS[st]
        except Exception as e:
            return self._failed("get_transfer_status", e), TransferStatus.FAILED

    def get_all_transfer_status(self, args: Any = None) -> Tuple[int, List[TransferResult]]:
        """Up to ``args.max_query_count`` requests (WAITING ones left out with ``skip_waiting``),
        oldest first; finished ones are freed."""
        try:
            if self._finalized:
                return FAILED, []
            a = GetTransferStatusArgs() if args is None else args
            mx = _int(getattr(a, "max_query_count", None), 0, _U64_MAX)
            skip = getattr(a, "skip_waiting", None)
            if mx is None or not isinstance(skip, bool):
                return self._refuse("get_all_transfer_status: need max_query_count (u64) and skip_waiting (bool)"), []
            rc, rows = self._engine.all_transfer_status(mx, skip)
            return self._done(rc), [TransferResult(req=r, user_data=u, status=TransferStatus(s)) for r, u, s in rows]
        except Exception as e:
            return self._failed("get_all_transfer_status", e), []

    def transfer_wait(self, req: Any, timeout_in_millis: Optional[int] = None) -> Tuple[int, TransferStatus]:
        """Blocks (GIL released) until request ``req`` ends or the timeout (None: no limit) passes,
        then answers like :meth:`get_transfer_status`: WAITING (request kept) on timeout."""
        try:
            if (type(req) is int and type(timeout_in_millis) is int and 0 < req <= _U64_MAX
                    and 0 <= timeout_in_millis <= _INT32_MAX and not self._finalized):  # the common call
                rc, st = self._engine.transfer_wait(req, timeout_in_millis)
                self._set_error("" if rc == SUCCESS else self._engine.last_error())
                return rc, _STATUS[st]
            if self._finalized:
                return FAILED, TransferStatus.FAILED
            r, t = _int(req, 0, _U64_MAX), self._wait_ms(timeout_in_millis)
            if r is None or t is None:
                return self._refuse("transfer_wait: req must be an int, timeout None or 0..2**31-1 ms"), \
                    TransferStatus.FAILED
            rc, st = self._engine.transfer_wait(r, t)
            return self._done(rc), _STATUS[st]
        except Exception as e:
            return self._failed("transfer_wait", e), TransferStatus.FAILED
