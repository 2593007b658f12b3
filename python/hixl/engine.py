"""``hixl.Hixl``: a drop-in for the ``Hixl`` engine class of CANN's hixl Python module.

Every method returns an ``int`` status code, or a tuple whose first element is one, and
never raises: bad input gives ``PARAM_INVALID`` (and the reason in :meth:`Hixl.last_error`
and the ``hixl`` logger at INFO level).  After :meth:`Hixl.finalize` every call returns
``FAILED`` with an empty result.  The work happens in the C++ engine (``hixl._core.Engine``),
which releases the GIL for every call.

Beyond CANN:

* the transport comes from option ``HixlTransport`` or env ``HIXL_TRANSPORT``
  (``auto``: RDMA when both ends have an active device, else ``shm`` when both are on this
  host and cross-memory attach works, else ``tcp`` with a warning); ``HixlDevice`` /
  ``HIXL_DEVICE`` and ``HixlGidIndex`` / ``HIXL_GID_INDEX`` pick the RDMA device and GID;
* option ``HixlAuthToken`` / env ``HIXL_AUTH_TOKEN`` (the option wins): a shared secret. A
  listener with one refuses every peer that does not prove it knows the token (HMAC-SHA-256
  challenge/response, both ways) before sending anything of its own; an engine with one connects
  only to peers that prove it too. A refused ``connect`` returns ``FAILED`` and ``last_error()``
  says "authentication ..."; the refusing side logs a warning with the peer's address;
* descriptor arrays and prepared descriptor lists (:mod:`hixl.descs`), completion flags
  (:meth:`Hixl.wait_flags`, :meth:`Hixl.fail_flag`);
* :meth:`Hixl.get_transport` and :meth:`Hixl.get_link_info` tell what each link runs on;
* :meth:`Hixl.metrics` returns the engine's counters (transfers, bytes, latency histogram, links,
  links closed by cause, notifies, refusals; :mod:`hixl.metrics`); option ``HixlMetricsPort`` /
  env ``HIXL_METRICS_PORT`` also serves them as Prometheus ``/metrics`` on the engine's host
  (port 0: a free one, see :attr:`Hixl.metrics_address`);
* regions registered after a peer connected become visible to it on its next transfer.

The methods' guard (``FAILED`` after finalize, an unexpected exception turned into ``FAILED`` and
:meth:`Hixl.last_error`) is :func:`hixl.args.status_call`; ``transfer_async`` and ``transfer_wait``
write theirs out, as a wrapper would cost a Python call per request.

The per-request calls of a Python loop (``transfer_async`` with one descriptor, ``transfer_wait``,
``get_transfer_status``) also exist in C (``_core.fast_call``, csrc/bindings/fast_calls.cc): an
initialized engine holds them in its instance dict, where ``h.transfer_async(...)`` finds them first.
They take the same common call as the Python methods' own fast paths, with the same checks, and hand
every other call to the Python method, which stays the definition of the API.
"""
from __future__ import annotations

import ctypes
import logging
import operator
import os
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _core
from . import metrics as _metrics
from .args import (
    ACCESS,
    DEFAULT_TIMEOUT_MS,
    INT32_MAX,
    U32_MAX,
    U64_LIMIT,
    U64_MAX,
    as_desc_list,
    as_enum,
    as_flag,
    as_int,
    as_timeout,
    as_wait_ms,
    status_call,
)
from .connect_pool import ConnectPool
from .descs import as_desc_array, as_u64_vector
from .options import parse_engine_address, parse_options
from .status import FAILED, PARAM_INVALID, RESOURCE_EXHAUSTED, SUCCESS
from .types import (
    AsyncConnectStatus,
    GetTransferStatusArgs,
    MemType,
    NotifyDesc,
    TransferArgs,
    TransferOp,
    TransferResult,
    TransferStatus,
    validate_mem_desc,
    validate_notify,
)

_log = logging.getLogger("hixl")

_STATUS = {int(m): m for m in TransferStatus}  # TransferStatus(v) costs a microsecond per call
_STATUSES = tuple(TransferStatus(v) for v in range(len(TransferStatus)))

# (method, _core.fast_call kind)
_FAST_CALLS = (("transfer_async", 0), ("transfer_wait", 1), ("get_transfer_status", 2))

_LIVE: "weakref.WeakSet[Hixl]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's threads, and locks they held stay held: the C++
    engine must never run (nor be destroyed: that would join threads that do not exist) here."""
    for h in list(_LIVE):
        if h._pid == 0:  # never initialized: no threads yet, the child may initialize it itself
            continue
        h._drop_fast_calls()  # the C per-request calls would use the parent's engine
        if not h._finalized:
            h._finalized = True
            h._forked = ("engine %s was initialized in process %d; after fork() the child (%d) cannot use it "
                         "(its threads, locks and connections belong to the parent): create a new Hixl in the child"
                         % (h._name, h._pid, os.getpid()))
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(h._engine))  # never destroyed in this process


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Hixl:
    """A hixl engine: register memory, connect to peers, READ/WRITE their memory, notify them.

    After ``fork()``, an engine of the parent is finalized in the child: every call there returns
    ``FAILED`` and :meth:`last_error` says why; the parent's engine keeps working (its registered
    memory is fork-safe: the child gets copies, the parent keeps the pages the device uses)."""

    def __init__(self) -> None:
        self._engine = _core.Engine()
        self._finalized = False
        self._forked = ""  # set in a forked child: why every call fails there
        self._pid, self._name = 0, ""  # set by initialize()
        _LIVE.add(self)
        self._logged_keys: set = set()
        self._good_remotes: set = set()
        self._tls = threading.local()  # last_error() is per thread, like the C++ engine's
        self._marks = _core.ErrorMarks()  # the threads whose last_error may be non-empty (_set_error)
        self._pool: Optional[ConnectPool] = None  # connect_async / disconnect_async
        self._metrics_server: Optional[_metrics.Server] = None  # HixlMetricsPort

    # ------------------------------------------------------------------ helpers
    def _set_error(self, why: str) -> None:
        """This thread's :meth:`last_error`. A non-empty one marks the thread in ``_marks``: the C
        per-request calls clear it on SUCCESS only where marked."""
        self._tls.last_error = why
        if why:
            self._marks.note()

    def _refuse(self, why: str) -> int:
        self._set_error("PARAM_INVALID: " + why)
        _log.info("hixl: %s", self._tls.last_error)
        return PARAM_INVALID

    def _refuse_transfer(self, why: str) -> int:
        """A transfer refused here, before the engine saw it: counted as the engine's own refusals
        (``hixl_refused_total{reason="param"}``)."""
        try:
            self._engine.count_refused("param")
        except Exception:  # noqa: BLE001 (finalized: nothing to count in)
            pass
        return self._refuse(why)

    def _done(self, rc: int) -> int:
        self._set_error("" if rc == SUCCESS else self._engine.last_error())
        return rc

    def _failed(self, where: str, e: BaseException) -> int:
        self._set_error("FAILED: %s: %s" % (where, e))
        _log.warning("hixl: %s", self._tls.last_error)
        return FAILED

    def _remote(self, remote: Any) -> Optional[str]:
        # Parsing an address costs microseconds; a transfer loop names the same few peers again and again.
        if isinstance(remote, str) and remote in self._good_remotes:
            return remote
        rc, _, _ = parse_engine_address(remote)
        if rc != SUCCESS:
            return None
        if len(self._good_remotes) < 4096:
            self._good_remotes.add(remote)
        return remote

    def _install_fast_calls(self) -> None:
        """Put the C versions of the per-request calls in this engine's instance dict (after a
        successful initialize). A subclass that overrides one of these methods keeps its own."""
        d = self.__dict__
        for name, kind in _FAST_CALLS:
            method = getattr(type(self), name)
            if method is getattr(Hixl, name):
                d[name] = _core.fast_call(kind, self._engine, self._good_remotes, self._tls, self._marks, TransferOp,
                                          _STATUSES, method, self)

    def _drop_fast_calls(self) -> None:
        """Back to the Python methods (finalize, fork); a C call someone still holds hands every later
        call to the Python method too."""
        d = self.__dict__
        for name, _ in _FAST_CALLS:
            if type(d.get(name)) is _core.FastCall:  # (not what a user put there)
                d.pop(name).close()

    def last_error(self) -> str:
        """Why the last call on this object from this thread did not return SUCCESS ("" if it did)."""
        return self._forked or getattr(self._tls, "last_error", "")

    # ---------------------------------------------------------------- lifecycle
    @status_call(after_finalize=True)
    def initialize(self, local_engine: str, options: Optional[Dict[str, str]] = None) -> int:
        """``"ip:port"`` listens (port 0 picks a free port), ``"ip"`` is client only.

        Calling it again returns SUCCESS and keeps the first configuration; after :meth:`finalize`
        it builds a fresh engine (as CANN). ``options``: see :func:`hixl.types.parse_options` (an
        unknown key or a bad value gives PARAM_INVALID naming it).
        """
        if self._forked:
            return FAILED
        if self._finalized:  # as CANN: initialize after finalize builds a fresh engine
            self._engine, self._finalized, self._pid, self._name = _core.Engine(), False, 0, ""
            self._good_remotes = set()
        elif self._pid:
            return SUCCESS  # already initialized: the first configuration stays
        rc, host, port = parse_engine_address(local_engine)
        if rc != SUCCESS:
            return self._refuse("initialize: local_engine %r is not ip, ip:port or [ipv6]:port" % (local_engine,))
        rc, p = parse_options(options)
        if rc != SUCCESS:
            return self._refuse("initialize: " + p.error)
        for key in p.not_applicable:
            if key not in self._logged_keys:
                self._logged_keys.add(key)
                _log.info("hixl: option %s=%r has no effect on this implementation", key,
                          p.raw.get(key, p.raw.get("adxl." + key)))
        for note in p.notes:
            if note not in self._logged_keys:
                self._logged_keys.add(note)
                _log.info("hixl: %s", note)
        tuning = {name: -1 if getattr(p, name) is None else getattr(p, name) for name in (  # -1: the engine's default
            "gid_index", "async_timeout_ms", "heartbeat_ms", "heartbeat_misses", "rdma_timeout", "rdma_retry_count",
            "rdma_qps_per_link", "rdma_max_wr_bytes", "rdma_send_window_bytes")}
        rc = self._done(self._engine.initialize(
            local_engine, transport=p.transport, device=p.device or "",
            traffic_class=-1 if p.rdma_traffic_class is None else p.rdma_traffic_class,
            service_level=-1 if p.rdma_service_level is None else p.rdma_service_level,
            auto_connect=p.auto_connect, auth_token=p.auth_token or "",
            trust_claimed_address=p.trust_claimed_address, **tuning))
        if rc == SUCCESS and p.metrics_port is not None:
            try:
                self._metrics_server = _metrics.Server(self._read_metrics, host, p.metrics_port)
            except Exception as e:  # asked for, so not silently without: the engine does not start
                self._engine.finalize()
                self._engine = _core.Engine()
                return self._failed("initialize", e)
            _log.info("hixl: engine %s serves its metrics on http://%s/metrics", self._engine.local_engine,
                      self._metrics_server.address)
        if rc == SUCCESS:
            self._pid, self._name = os.getpid(), self._engine.local_engine
            self._pool = ConnectPool(self._engine, p.connect_pool_threads, p.connect_pool_capacity)
            self._install_fast_calls()
        return rc

    def finalize(self) -> None:
        """Tears everything down (links, then registrations). Idempotent."""
        try:
            self._finalized = True
            self._drop_fast_calls()
            if not self._forked:  # in a forked child the parent's threads are not here to join
                server, self._metrics_server = self._metrics_server, None
                if server is not None:
                    server.close()
                pool, self._pool = self._pool, None
                if pool is not None:
                    pool.close()
                self._engine.finalize()
                if pool is not None:
                    pool.join()
        except Exception as e:
            self._failed("finalize", e)

    def __enter__(self) -> "Hixl":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finalize()

    # -------------------------------------------------------------- registration
    @status_call(0)
    def register_mem(self, mem_desc: Any, mem_type: Any = MemType.MEM_HOST, *, access: str = "rw") -> Tuple[int, int]:
        """``(SUCCESS, handle)``; the same addr/len again gives the same handle.

        ``access`` (beyond CANN): what peers may do with the region: ``"rw"`` (default), ``"ro"``
        (peers may READ it; a peer's WRITE is refused with PARAM_INVALID before anything is posted,
        and on RDMA the memory region itself has no remote-write right), ``"wo"``, or ``"none"``
        (only a source/destination of this engine's own transfers)."""
        if validate_mem_desc(mem_desc) != SUCCESS or operator.index(mem_desc.addr) == 0:
            return self._refuse("register_mem: %r is not a non-empty u64 range" % (mem_desc,)), 0
        mt = as_enum(mem_type, MemType)
        if mt is None:
            return self._refuse("register_mem: mem_type %r is not a MemType" % (mem_type,)), 0
        acc = ACCESS.get(access) if isinstance(access, str) else None
        if acc is None:
            return self._refuse("register_mem: access %r is not one of %s" % (access, sorted(ACCESS))), 0
        rc, handle = self._engine.register_mem(operator.index(mem_desc.addr), operator.index(mem_desc.len), mt, acc)
        return self._done(rc), handle

    @status_call()
    def deregister_mem(self, mem_handle: Any) -> int:
        """SUCCESS, also for a handle already deregistered or never issued (nothing to do, as in
        CANN); PARAM_INVALID for 0 or a non-int."""
        h = as_int(mem_handle, 0, U64_MAX)
        if h is None or h == 0:
            return self._refuse("deregister_mem: handle %r is not a registration handle (a non-zero int)"
                                % (mem_handle,))
        rc = self._engine.deregister_mem(h)
        if rc == PARAM_INVALID and "never issued" in self._engine.last_error():
            rc = SUCCESS  # as CANN: an unknown handle is nothing to deregister
        return self._done(rc)

    # --------------------------------------------------------------- connections
    def _link_args(self, name: str, remote: Any, timeout: Any, listening: bool = False) -> Tuple[int, int]:
        """``(SUCCESS, timeout)`` for a good remote (with a port when ``listening``) and timeout, else
        ``(PARAM_INVALID, 0)`` (refused)."""
        if self._remote(remote) is None or (listening and parse_engine_address(remote)[2] is None):
            return self._refuse("%s: remote_engine %r is not ip:port or [ipv6]:port" % (name, remote)), 0
        t = as_timeout(timeout)
        if t is None:
            return self._refuse("%s: timeout_in_millis %r must be an int in 1..2**31-1" % (name, timeout)), 0
        return SUCCESS, t

    @status_call()
    def connect(self, remote_engine: str, timeout_in_millis: int = DEFAULT_TIMEOUT_MS) -> int:
        """SUCCESS, ALREADY_CONNECTED, or TIMEOUT/FAILED when nobody answers."""
        rc, t = self._link_args("connect", remote_engine, timeout_in_millis)
        return self._done(self._engine.connect(remote_engine, t)) if rc == SUCCESS else rc

    @status_call()
    def disconnect(self, remote_engine: str, timeout_in_millis: int = DEFAULT_TIMEOUT_MS) -> int:
        """SUCCESS, also when the peer closed the link first (its disconnect or finalize, a failure) and
        this is the first disconnect since; NOT_CONNECTED when there never was a link (from either side)
        to that engine, or it was already disconnected here."""
        rc, t = self._link_args("disconnect", remote_engine, timeout_in_millis)
        return self._done(self._engine.disconnect(remote_engine, t)) if rc == SUCCESS else rc

    def _queue_link_task(self, kind: str, remote: Any, timeout: Any) -> int:
        name = kind + "_async"
        if self._pool is None:
            return FAILED
        rc, t = self._link_args(name, remote, timeout, listening=True)
        if rc != SUCCESS:
            return rc
        if not self._pool.submit(kind, remote, t):
            self._set_error("RESOURCE_EXHAUSTED: %s: the connect pool's queue is full "
                            "(GlobalResourceConfig connect_pool.task_queue_capacity)" % name)
            return RESOURCE_EXHAUSTED
        self._tls.last_error = ""
        return SUCCESS

    @status_call()
    def connect_async(self, remote_engine: str, timeout_in_millis: int = DEFAULT_TIMEOUT_MS) -> int:
        """Queues a connect on the connect pool: SUCCESS, or RESOURCE_EXHAUSTED when its queue is full
        (PARAM_INVALID for bad arguments). The outcome (CONNECTED, also over a live link, or
        CONNECT_FAILED) shows in :meth:`get_async_connect_status`."""
        return self._queue_link_task("connect", remote_engine, timeout_in_millis)

    @status_call()
    def disconnect_async(self, remote_engine: str, timeout_in_millis: int = DEFAULT_TIMEOUT_MS) -> int:
        """Queues a disconnect on the connect pool (like :meth:`connect_async`); it ends NOT_CONNECT, also
        for a peer never connected."""
        return self._queue_link_task("disconnect", remote_engine, timeout_in_millis)

    @status_call(AsyncConnectStatus.NOT_CONNECT)
    def get_async_connect_status(self, remote_engine: str) -> Tuple[int, AsyncConnectStatus]:
        """The state of ``remote_engine``'s async task; without one (never seen, or its disconnect
        ended): CONNECTED when a link to it is up, else NOT_CONNECT."""
        if self._pool is None:
            return FAILED, AsyncConnectStatus.NOT_CONNECT
        if self._remote(remote_engine) is None:
            return self._refuse("get_async_connect_status: bad remote_engine %r" % (remote_engine,)), \
                AsyncConnectStatus.NOT_CONNECT
        st = self._pool.status(remote_engine)
        linked = self._engine.link_info(remote_engine)[0] == SUCCESS
        if st is None or (st == AsyncConnectStatus.CONNECTED and not linked):
            if st is not None:
                self._pool.forget(remote_engine)  # the link went away since
            st = AsyncConnectStatus.CONNECTED if linked else AsyncConnectStatus.NOT_CONNECT
        self._tls.last_error = ""
        return SUCCESS, st

    @status_call({})
    def get_all_async_connect_status(self) -> Tuple[int, Dict[str, AsyncConnectStatus]]:
        """Every peer with an async task (one whose disconnect ended is no longer listed)."""
        if self._pool is None:
            return FAILED, {}
        self._tls.last_error = ""
        return SUCCESS, self._pool.all()

    @property
    def local_engine(self) -> str:
        """This engine's canonical address (with the bound port when it listens)."""
        try:
            return "" if self._finalized else self._engine.local_engine
        except Exception:
            return ""

    def get_transport(self, remote_engine: str) -> Tuple[int, str]:
        """``(SUCCESS, "rdma")`` for a connected peer; NOT_CONNECTED otherwise."""
        rc, info = self.get_link_info(remote_engine)
        return rc, info.get("transport", "")

    @status_call({})
    def get_link_info(self, remote_engine: str) -> Tuple[int, Dict[str, Any]]:
        """Transport, device, GID index, path MTU, queue pair numbers of the link to a peer."""
        if self._remote(remote_engine) is None:
            return self._refuse("get_link_info: bad remote_engine %r" % (remote_engine,)), {}
        rc, info = self._engine.link_info(remote_engine)
        return self._done(rc), dict(info)

    # ------------------------------------------------------------------ notifies
    @status_call()
    def send_notify(self, remote_engine: str, notify: Any, timeout_in_millis: int = DEFAULT_TIMEOUT_MS) -> int:
        """Delivered after every transfer to that peer that completed before this call.
        RESOURCE_EXHAUSTED when the peer holds 4096 unread notifies from us, or 16384 from all its peers."""
        if self._remote(remote_engine) is None:
            return self._refuse("send_notify: bad remote_engine %r" % (remote_engine,))
        if validate_notify(notify) != SUCCESS:
            return self._refuse("send_notify: name and notify_msg must be str of at most 1024 characters")
        t = as_timeout(timeout_in_millis)
        if t is None:
            return self._refuse("send_notify: timeout_in_millis %r must be in 1..2**31-1" % (timeout_in_millis,))
        return self._done(self._engine.send_notify(remote_engine, notify.name, notify.notify_msg, t))

    @status_call([])
    def get_notifies(self) -> Tuple[int, List[NotifyDesc]]:
        """Every notify received since the last call, in arrival order."""
        rc, rows = self._engine.get_notifies()
        return self._done(rc), [NotifyDesc(name=n, notify_msg=m) for n, m in rows]

    @status_call([])
    def wait_notifies(self, timeout_in_millis: Optional[int] = None) -> Tuple[int, List[NotifyDesc]]:
        """Like :meth:`get_notifies`, but blocks (GIL released) until at least one notify is there
        or the timeout (None: no limit) passes (then an empty list)."""
        t = as_wait_ms(timeout_in_millis)
        if t is None:
            return self._refuse("wait_notifies: timeout must be None or 0..2**31-1 ms"), []
        rc, rows = self._engine.get_notifies(t if t != 0 else 1)
        return self._done(rc), [NotifyDesc(name=n, notify_msg=m) for n, m in rows]

    # ----------------------------------------------------------------- transfers
    @status_call()
    def transfer_sync(self, remote_engine: str, op: Any, op_descs: Sequence[Any],
                      timeout_in_millis: int = DEFAULT_TIMEOUT_MS, *, flag: Optional[int] = None) -> int:
        """One-sided READ/WRITE of the peer's registered memory; TIMEOUT tears the link down
        so that no write of this call can land afterwards.

        ``flag`` (beyond CANN, WRITE only, u32): the peer receives it from :meth:`wait_flags` /
        :meth:`poll_flags` once every byte of this write, and of every earlier request to it, is in
        its memory (RDMA: WRITE_WITH_IMM; shm/tcp: a flag frame sent after the bytes landed)."""
        if self._remote(remote_engine) is None:
            return self._refuse_transfer("transfer_sync: bad remote_engine %r" % (remote_engine,))
        o = as_enum(op, TransferOp)
        if o is None:
            return self._refuse_transfer("transfer_sync: op %r is not a TransferOp" % (op,))
        arr = as_desc_array(op_descs) if isinstance(op_descs, np.ndarray) else None
        descs = arr if arr is not None else as_desc_list(op_descs)
        if descs is None:
            return self._refuse_transfer("transfer_sync: op_descs must be a non-empty list of TransferOpDesc "
                                         "with non-zero u64 addresses and len > 0, or a descriptor array "
                                         "((N, 3) u64 or hixl.DESC_DTYPE)")
        t = as_timeout(timeout_in_millis)
        if t is None:
            return self._refuse_transfer("transfer_sync: timeout_in_millis %r must be in 1..2**31-1"
                                         % (timeout_in_millis,))
        f = as_flag(flag, o)
        if f is None:
            return self._refuse_transfer("transfer_sync: flag %r must be None or a u32, with op WRITE" % (flag,))
        if isinstance(descs, np.ndarray):
            return self._done(self._engine.transfer_sync_array(remote_engine, o, descs, t, f))
        return self._done(self._engine.transfer_sync(remote_engine, o, descs, t, f))

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
        # A per-request call: its guard is written out (a status_call wrapper would cost a Python
        # call per request); the finalize check is part of the common call's condition.
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
                            and la + n <= U64_LIMIT and ra + n <= U64_LIMIT):
                        rc, req = self._engine.transfer_async_one(remote_engine, op, la, ra, n)
                        self._set_error("" if rc == SUCCESS else self._engine.last_error())
                        return rc, req
                descs = as_desc_list(op_descs) if type(op_descs) is list else None
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
            o = as_enum(op, TransferOp)
            if o is None:
                return self._refuse_transfer("transfer_async: op %r is not a TransferOp" % (op,)), 0
            arr = as_desc_array(op_descs) if isinstance(op_descs, np.ndarray) else None
            descs = arr if arr is not None else as_desc_list(op_descs)
            if descs is None:
                return self._refuse_transfer("transfer_async: op_descs must be a non-empty list of TransferOpDesc "
                                             "with non-zero u64 addresses and len > 0, or a descriptor array "
                                             "((N, 3) u64 or hixl.DESC_DTYPE)"), 0
            if args is None:
                args = TransferArgs() if optional_args is None else optional_args  # optional_args: our old name
            ud = as_int(getattr(args, "user_data", None), 0, U64_MAX)
            if ud is None:
                return self._refuse_transfer("transfer_async: user_data must be a u64"), 0
            f = as_flag(flag, o)
            if f is None:
                return self._refuse_transfer("transfer_async: flag %r must be None or a u32, with op WRITE"
                                             % (flag,)), 0
            t = -1
            if timeout_in_millis is not None:
                t = as_timeout(timeout_in_millis)
                if t is None:
                    return self._refuse_transfer("transfer_async: timeout_in_millis %r must be None or in "
                                                 "1..2**31-1" % (timeout_in_millis,)), 0
            if isinstance(descs, np.ndarray):
                rc, req = self._engine.transfer_async_array(remote_engine, o, descs, ud, f, t)
            else:
                rc, req = self._engine.transfer_async(remote_engine, o, descs, ud, f, t)
            return self._done(rc), req
        except Exception as e:
            return self._failed("transfer_async", e), 0

    # ------------------------------------------------------ prepared descriptor lists
    @status_call(0)
    def prep_descs(self, addrs: Any, lens: Any, remote_engine: Optional[str] = None,
                   timeout_in_millis: int = DEFAULT_TIMEOUT_MS) -> Tuple[int, int]:
        """``(SUCCESS, handle)``: a prepared descriptor list of blocks ``[addrs[i], addrs[i]+lens[i])``
        (beyond CANN; see :mod:`hixl.descs`). ``remote_engine`` None: our registered memory; else a
        connected peer's (auto-connected with AutoConnect), each block inside a region it registered.
        ``addrs``: a sequence or 1-D array of ints; ``lens``: the same, or one int for all. Each
        block is validated and resolved to its region once, here; transfers then name blocks by
        index. A (de)registration on either side later makes the next transfer resolve the list
        again, and refuses a block that lost its region. PARAM_INVALID names the first bad block."""
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
        t = as_timeout(timeout_in_millis)
        if t is None:
            return self._refuse("prep_descs: timeout_in_millis %r must be in 1..2**31-1" % (timeout_in_millis,)), 0
        rc, h = self._engine.prep_descs(remote, a, n, t)
        return self._done(rc), h

    @status_call()
    def release_descs(self, handle: Any) -> int:
        """Frees a prepared list; PARAM_INVALID for a handle not issued or already released."""
        h = as_int(handle, 1, U64_MAX)
        if h is None:
            return self._refuse("release_descs: handle %r is not a prepared list handle" % (handle,))
        return self._done(self._engine.release_descs(h))

    def _prepped(self, name: str, sync: bool, op: Any, local_descs: Any, local_idx: Any, remote_descs: Any,
                 remote_idx: Any, timeout: Any, flag: Any, user_data: Any) -> Tuple[int, int]:
        o = as_enum(op, TransferOp)
        if o is None:
            return self._refuse_transfer("%s: op %r is not a TransferOp" % (name, op)), 0
        lh, rh = as_int(local_descs, 1, U64_MAX), as_int(remote_descs, 1, U64_MAX)
        if lh is None or rh is None:
            return self._refuse_transfer("%s: local_descs and remote_descs must be prep_descs handles" % name), 0
        li, ri = as_u64_vector(local_idx), as_u64_vector(remote_idx)
        if li is None or ri is None or len(li) != len(ri):
            return self._refuse_transfer("%s: local_idx and remote_idx must be equally long non-empty sequences of "
                                         "non-negative ints" % name), 0
        f = as_flag(flag, o)
        if f is None:
            return self._refuse_transfer("%s: flag %r must be None or a u32, with op WRITE" % (name, flag)), 0
        if sync:
            t = as_timeout(DEFAULT_TIMEOUT_MS if timeout is None else timeout)
        else:
            t = -1 if timeout is None else as_timeout(timeout)
        if t is None:
            return self._refuse_transfer("%s: timeout_in_millis %r must be in 1..2**31-1" % (name, timeout)), 0
        ud = as_int(user_data, 0, U64_MAX)
        if ud is None:
            return self._refuse_transfer("%s: user_data must be a u64" % name), 0
        rc, req = self._engine.transfer_prepped(o, lh, li, rh, ri, sync, t, ud, f)
        return self._done(rc), req

    @status_call(0)
    def transfer_prepped_async(self, op: Any, local_descs: int, local_idx: Any, remote_descs: int, remote_idx: Any,
                               *, flag: Optional[int] = None, timeout_in_millis: Optional[int] = None,
                               user_data: int = 0) -> Tuple[int, int]:
        """``(SUCCESS, req)`` like :meth:`transfer_async`, for the descriptors (block
        ``local_idx[i]`` of prepared list ``local_descs``, block ``remote_idx[i]`` of the peer's
        prepared list ``remote_descs``); the two blocks of each pair must have the same length.
        Indices: sequences or 1-D int arrays of equal length (numpy: no Python object per
        descriptor). Bad indices, lengths or access give PARAM_INVALID naming the pair."""
        return self._prepped("transfer_prepped_async", False, op, local_descs, local_idx, remote_descs,
                             remote_idx, timeout_in_millis, flag, user_data)

    @status_call()
    def transfer_prepped_sync(self, op: Any, local_descs: int, local_idx: Any, remote_descs: int, remote_idx: Any,
                              timeout_in_millis: int = DEFAULT_TIMEOUT_MS, *, flag: Optional[int] = None) -> int:
        """:meth:`transfer_sync` for prepared lists (see :meth:`transfer_prepped_async`)."""
        return self._prepped("transfer_prepped_sync", True, op, local_descs, local_idx, remote_descs, remote_idx,
                             timeout_in_millis, flag, 0)[0]

    # ------------------------------------------------------------ request status
    @status_call(TransferStatus.FAILED)
    def get_transfer_status(self, req: Any) -> Tuple[int, TransferStatus]:
        """``(SUCCESS, status)``. After COMPLETED/FAILED the request is freed; an unknown
        request gives ``(PARAM_INVALID, TransferStatus.FAILED)``, request 0 (what a failed
        :meth:`transfer_async` hands out) ``(FAILED, TransferStatus.FAILED)``."""
        r = as_int(req, 0, U64_MAX)
        if r is None:
            return self._refuse("get_transfer_status: req %r is not an int" % (req,)), TransferStatus.FAILED
        if r == 0:
            self._set_error("FAILED: get_transfer_status: request 0 is no request (a failed transfer_async)")
            return FAILED, TransferStatus.FAILED
        rc, st = self._engine.transfer_status(r)
        return self._done(rc), _STATUS[st]

    @status_call([])
    def get_all_transfer_status(self, args: Any = None) -> Tuple[int, List[TransferResult]]:
        """Up to ``args.max_query_count`` requests (WAITING ones left out with ``skip_waiting``),
        oldest first; finished ones are freed."""
        a = GetTransferStatusArgs() if args is None else args
        mx = as_int(getattr(a, "max_query_count", None), 0, U64_MAX)
        skip = getattr(a, "skip_waiting", None)
        if mx is None or not isinstance(skip, bool):
            return self._refuse("get_all_transfer_status: need max_query_count (u64) and skip_waiting (bool)"), []
        rc, rows = self._engine.all_transfer_status(mx, skip)
        return self._done(rc), [TransferResult(req=r, user_data=u, status=TransferStatus(s)) for r, u, s in rows]

    def transfer_wait(self, req: Any, timeout_in_millis: Optional[int] = None) -> Tuple[int, TransferStatus]:
        """Blocks (GIL released) until request ``req`` ends or the timeout (None: no limit) passes,
        then answers like :meth:`get_transfer_status`: WAITING (request kept) on timeout."""
        # A per-request call: its guard is written out, as in transfer_async.
        try:
            if (type(req) is int and type(timeout_in_millis) is int and 0 < req <= U64_MAX
                    and 0 <= timeout_in_millis <= INT32_MAX and not self._finalized):  # the common call
                rc, st = self._engine.transfer_wait(req, timeout_in_millis)
                self._set_error("" if rc == SUCCESS else self._engine.last_error())
                return rc, _STATUS[st]
            if self._finalized:
                return FAILED, TransferStatus.FAILED
            r, t = as_int(req, 0, U64_MAX), as_wait_ms(timeout_in_millis)
            if r is None or t is None:
                return self._refuse("transfer_wait: req must be an int, timeout None or 0..2**31-1 ms"), \
                    TransferStatus.FAILED
            rc, st = self._engine.transfer_wait(r, t)
            return self._done(rc), _STATUS[st]
        except Exception as e:
            return self._failed("transfer_wait", e), TransferStatus.FAILED

    # --------------------------------------------------------- completion flags
    @status_call([])
    def poll_flags(self, max_count: int = 4096) -> Tuple[int, List[Tuple[str, int]]]:
        """Completion flags received so far (``(peer, value)``, oldest first); never blocks."""
        m = as_int(max_count, 1, U64_MAX)
        if m is None:
            return self._refuse("poll_flags: max_count must be a positive int"), []
        rc, rows = self._engine.poll_flags(m)
        return self._done(rc), list(rows)

    @status_call([])
    def wait_flags(self, timeout_in_millis: Optional[int] = None,
                   max_count: int = 4096) -> Tuple[int, List[Tuple[str, int]]]:
        """Blocks (GIL released) until at least one completion flag is there or the timeout
        (None: no limit) passes (then ``(SUCCESS, [])``). Once :meth:`poll_flag_failures` was called,
        a flag failure pending also ends the wait, with the flags there are (possibly none)."""
        t, m = as_wait_ms(timeout_in_millis), as_int(max_count, 1, U64_MAX)
        if t is None or m is None:
            return self._refuse("wait_flags: timeout None or 0..2**31-1 ms, max_count a positive int"), []
        rc, rows = self._engine.wait_flags(m, t)
        return self._done(rc), list(rows)

    @status_call()
    def fail_flag(self, remote_engine: str, flag: int, reason: str,
                  timeout_in_millis: int = DEFAULT_TIMEOUT_MS) -> int:
        """Tells a connected peer that completion flag ``flag`` (u32) will not come, and why: its
        :meth:`poll_flag_failures` returns ``(our name, flag, reason)`` at once (and its flag waiters
        wake), so it need not wait for its own timeout. ``reason``: at most 4096 bytes of UTF-8 are
        sent. NOT_CONNECTED without a link (the peer then learns from the link's end instead)."""
        if self._remote(remote_engine) is None:
            return self._refuse("fail_flag: bad remote_engine %r" % (remote_engine,))
        f, t = as_int(flag, 0, U32_MAX), as_timeout(timeout_in_millis)
        if f is None or t is None or not isinstance(reason, str):
            return self._refuse("fail_flag: flag a u32, reason a str, timeout_in_millis in 1..2**31-1")
        return self._done(self._engine.fail_flag(remote_engine, f, reason, t))

    @status_call([])
    def poll_flag_failures(self, max_count: int = 4096) -> Tuple[int, List[Tuple[str, int, str]]]:
        """Flags that will not come, oldest first; never blocks: ``(peer, flag, reason)`` for a
        peer's :meth:`fail_flag`, and ``(peer, -1, reason)`` when the link to ``peer`` closed (none of
        its flags not yet seen will come over it; reason names why: heartbeat, peer closed, abort,
        transfer error, ...). Opt-in: the first call subscribes; failures are kept from then on, and
        :meth:`wait_flags` and :meth:`flag_fd` then wake for them too (a user who never calls this
        sees flags exactly as before)."""
        m = as_int(max_count, 1, U64_MAX)
        if m is None:
            return self._refuse("poll_flag_failures: max_count must be a positive int"), []
        rc, rows = self._engine.poll_flag_failures(m)
        return self._done(rc), list(rows)

    def flag_fd(self) -> int:
        """An eventfd that is readable while completion flags (and, once :meth:`poll_flag_failures`
        was called, flag failures) are pending, for select/poll/asyncio: wait on it, then poll them;
        -1 when not initialized."""
        try:
            return -1 if self._finalized else int(self._engine.flag_fd)
        except Exception:
            return -1

    # ------------------------------------------------------------------ metrics
    def _read_metrics(self) -> Optional[Dict[str, Any]]:
        return None if self._finalized or self._forked else self._engine.metrics()

    def metrics(self) -> Dict[str, List[Dict[str, Any]]]:
        """The engine's counters, as ``/metrics`` serves them (:mod:`hixl.metrics` lists each):
        ``{metric name: [{"name": sample name, "labels": {...}, "value": float}, ...]}``; ``{}``
        when not initialized. Reading them takes no lock of the data path."""
        try:
            raw = self._read_metrics() if self._pid else None
            return {} if raw is None else _metrics.as_dict(raw)
        except Exception as e:
            self._failed("metrics", e)
            return {}

    @property
    def metrics_address(self) -> str:
        """``"host:port"`` where ``/metrics`` is served (``HixlMetricsPort``), else ``""``."""
        server = self._metrics_server
        return server.address if server is not None else ""


__all__ = ["Hixl"]
