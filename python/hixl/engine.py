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
* :meth:`Hixl.get_transport` and :meth:`Hixl.get_link_info` tell what each link runs on;
* :meth:`Hixl.metrics` returns the engine's counters (transfers, bytes, latency histogram, links,
  links closed by cause, notifies, refusals; :mod:`hixl.metrics`); option ``HixlMetricsPort`` /
  env ``HIXL_METRICS_PORT`` also serves them as Prometheus ``/metrics`` on the engine's host
  (port 0: a free one, see :attr:`Hixl.metrics_address`);
* regions registered after a peer connected become visible to it on its next transfer.
"""
from __future__ import annotations

import ctypes
import logging
import operator
import os
import threading
import weakref
from typing import Any, Dict, List, Optional, Tuple

from . import _core
from . import metrics as _metrics
from .connect_pool import ConnectPool
from .engine_signals import _DEFAULT_TIMEOUT_MS, _INT32_MAX, _U64_MAX, Signals, _enum, _int
from .engine_transfers import Transfers
from .types import (
    FAILED,
    PARAM_INVALID,
    RESOURCE_EXHAUSTED,
    SUCCESS,
    AsyncConnectStatus,
    MemType,
    NotifyDesc,
    parse_engine_address,
    parse_options,
    validate_mem_desc,
    validate_notify,
)

_log = logging.getLogger("hixl")

_ACCESS = {"rw": 3, "ro": 1, "wo": 2, "none": 0}  # wire::RegionAccess bits: remote read 1, remote write 2


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


class Hixl(Transfers, Signals):
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
        per-request calls (engine_transfers) clear it on SUCCESS only where marked."""
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

    def _timeout(self, v: Any) -> Optional[int]:
        return _int(v, 1, _INT32_MAX)

    def _wait_ms(self, v: Any) -> Optional[int]:
        """None -> -1 (no limit); else 0..2**31-1 ms."""
        return -1 if v is None else _int(v, 0, _INT32_MAX)

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

    def last_error(self) -> str:
        """Why the last call on this object from this thread did not return SUCCESS ("" if it did)."""
        return self._forked or getattr(self._tls, "last_error", "")

    # ---------------------------------------------------------------- lifecycle
    def initialize(self, local_engine: str, options: Optional[Dict[str, str]] = None) -> int:
        """``"ip:port"`` listens (port 0 picks a free port), ``"ip"`` is client only.

        Calling it again returns SUCCESS and keeps the first configuration; after :meth:`finalize`
        it builds a fresh engine (as CANN). ``options``: see :func:`hixl.types.parse_options` (an
        unknown key or a bad value gives PARAM_INVALID naming it).
        """
        try:
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
            rc = self._done(self._engine.initialize(
                local_engine, transport=p.transport, device=p.device or "",
                gid_index=-1 if p.gid_index is None else p.gid_index,
                traffic_class=-1 if p.rdma_traffic_class is None else p.rdma_traffic_class,
                service_level=-1 if p.rdma_service_level is None else p.rdma_service_level,
                auto_connect=p.auto_connect, auth_token=p.auth_token or "",
                async_timeout_ms=-1 if p.async_timeout_ms is None else p.async_timeout_ms,
                heartbeat_ms=-1 if p.heartbeat_ms is None else p.heartbeat_ms,
                heartbeat_misses=-1 if p.heartbeat_misses is None else p.heartbeat_misses,
                rdma_timeout=-1 if p.rdma_timeout is None else p.rdma_timeout,
                rdma_retry_count=-1 if p.rdma_retry_count is None else p.rdma_retry_count,
                rdma_qps_per_link=-1 if p.rdma_qps_per_link is None else p.rdma_qps_per_link,
                rdma_max_wr_bytes=-1 if p.rdma_max_wr_bytes is None else p.rdma_max_wr_bytes,
                rdma_send_window_bytes=-1 if p.rdma_send_window_bytes is None else p.rdma_send_window_bytes))
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
        except Exception as e:  # never raise to the caller
            return self._failed("initialize", e)

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
    def register_mem(self, mem_desc: Any, mem_type: Any = MemType.MEM_HOST, *, access: str = "rw") -> Tuple[int, int]:
        """``(SUCCESS, handle)``; the same addr/len again gives the same handle.

        ``access`` (beyond CANN): what peers may do with the region: ``"rw"`` (default), ``"ro"``
        (peers may READ it; a peer's WRITE is refused with PARAM_INVALID before anything is posted,
        and on RDMA the memory region itself has no remote-write right), ``"wo"``, or ``"none"``
        (only a source/destination of this engine's own transfers)."""
        try:
            if self._finalized:
                return FAILED, 0
            if validate_mem_desc(mem_desc) != SUCCESS or operator.index(mem_desc.addr) == 0:
                return self._refuse("register_mem: %r is not a non-empty u64 range" % (mem_desc,)), 0
            mt = _enum(mem_type, MemType)
            if mt is None:
                return self._refuse("register_mem: mem_type %r is not a MemType" % (mem_type,)), 0
            acc = _ACCESS.get(access) if isinstance(access, str) else None
            if acc is None:
                return self._refuse("register_mem: access %r is not one of %s" % (access, sorted(_ACCESS))), 0
            rc, handle = self._engine.register_mem(operator.index(mem_desc.addr), operator.index(mem_desc.len), mt,
                                                   acc)
            return self._done(rc), handle
        except Exception as e:
            return self._failed("register_mem", e), 0

    def deregister_mem(self, mem_handle: Any) -> int:
        """SUCCESS, also for a handle already deregistered or never issued (nothing to do, as in
        CANN); PARAM_INVALID for 0 or a non-int."""
        try:
            if self._finalized:
                return FAILED
            h = _int(mem_handle, 0, _U64_MAX)
            if h is None or h == 0:
                return self._refuse("deregister_mem: handle %r is not a registration handle (a non-zero int)"
                                    % (mem_handle,))
            rc = self._engine.deregister_mem(h)
            if rc == PARAM_INVALID and "never issued" in self._engine.last_error():
                rc = SUCCESS  # as CANN: an unknown handle is nothing to deregister
            return self._done(rc)
        except Exception as e:
            return self._failed("deregister_mem", e)

    # --------------------------------------------------------------- connections
    def _link_call(self, name: str, remote: Any, timeout: Any, fn: Any) -> int:
        try:
            if self._finalized:
                return FAILED
            if self._remote(remote) is None:
                return self._refuse("%s: remote_engine %r is not ip:port or [ipv6]:port" % (name, remote))
            t = self._timeout(timeout)
            if t is None:
                return self._refuse("%s: timeout_in_millis %r must be an int in 1..2**31-1" % (name, timeout))
            return self._done(fn(remote, t))
        except Exception as e:
            return self._failed(name, e)

    def connect(self, remote_engine: str, timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> int:
        """SUCCESS, ALREADY_CONNECTED, or TIMEOUT/FAILED when nobody answers."""
        return self._link_call("connect", remote_engine, timeout_in_millis, self._engine.connect)

    def disconnect(self, remote_engine: str, timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> int:
        """SUCCESS, also when the peer closed the link first (its disconnect or finalize, a failure) and
        this is the first disconnect since; NOT_CONNECTED when there never was a link (from either side)
        to that engine, or it was already disconnected here."""
        return self._link_call("disconnect", remote_engine, timeout_in_millis, self._engine.disconnect)

    def _queue_link_task(self, kind: str, remote: Any, timeout: Any) -> int:
        name = kind + "_async"
        try:
            if self._finalized or self._pool is None:
                return FAILED
            if self._remote(remote) is None or parse_engine_address(remote)[2] is None:
                return self._refuse("%s: remote_engine %r is not ip:port or [ipv6]:port" % (name, remote))
            t = self._timeout(timeout)
            if t is None:
                return self._refuse("%s: timeout_in_millis %r must be an int in 1..2**31-1" % (name, timeout))
            if not self._pool.submit(kind, remote, t):
                self._set_error("RESOURCE_EXHAUSTED: %s: the connect pool's queue is full "
                                "(GlobalResourceConfig connect_pool.task_queue_capacity)" % name)
                return RESOURCE_EXHAUSTED
            self._tls.last_error = ""
            return SUCCESS
        except Exception as e:
            return self._failed(name, e)

    def connect_async(self, remote_engine: str, timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> int:
        """Queues a connect on the connect pool: SUCCESS, or RESOURCE_EXHAUSTED when its queue is full
        (PARAM_INVALID for bad arguments). The outcome (CONNECTED, also over a live link, or
        CONNECT_FAILED) shows in :meth:`get_async_connect_status`."""
        return self._queue_link_task("connect", remote_engine, timeout_in_millis)

    def disconnect_async(self, remote_engine: str, timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> int:
        """Queues a disconnect on the connect pool (like :meth:`connect_async`); it ends NOT_CONNECT, also
        for a peer never connected."""
        return self._queue_link_task("disconnect", remote_engine, timeout_in_millis)

    def get_async_connect_status(self, remote_engine: str) -> Tuple[int, AsyncConnectStatus]:
        """The state of ``remote_engine``'s async task; without one (never seen, or its disconnect
        ended): CONNECTED when a link to it is up, else NOT_CONNECT."""
        try:
            if self._finalized or self._pool is None:
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
        except Exception as e:
            return self._failed("get_async_connect_status", e), AsyncConnectStatus.NOT_CONNECT

    def get_all_async_connect_status(self) -> Tuple[int, Dict[str, AsyncConnectStatus]]:
        """Every peer with an async task (one whose disconnect ended is no longer listed)."""
        try:
            if self._finalized or self._pool is None:
                return FAILED, {}
            self._tls.last_error = ""
            return SUCCESS, self._pool.all()
        except Exception as e:
            return self._failed("get_all_async_connect_status", e), {}

    # ------------------------------------------------------------------ notifies
    def send_notify(self, remote_engine: str, notify: Any, timeout_in_millis: int = _DEFAULT_TIMEOUT_MS) -> int:
        """Delivered after every transfer to that peer that completed before this call.
        RESOURCE_EXHAUSTED when the peer holds 4096 unread notifies from us."""
        try:
            if self._finalized:
                return FAILED
            if self._remote(remote_engine) is None:
                return self._refuse("send_notify: bad remote_engine %r" % (remote_engine,))
            if validate_notify(notify) != SUCCESS:
                return self._refuse("send_notify: name and notify_msg must be str of at most 1024 characters")
            t = self._timeout(timeout_in_millis)
            if t is None:
                return self._refuse("send_notify: timeout_in_millis %r must be in 1..2**31-1" % (timeout_in_millis,))
            return self._done(self._engine.send_notify(remote_engine, notify.name, notify.notify_msg, t))
        except Exception as e:
            return self._failed("send_notify", e)

    def get_notifies(self) -> Tuple[int, List[NotifyDesc]]:
        """Every notify received since the last call, in arrival order."""
        try:
            if self._finalized:
                return FAILED, []
            rc, rows = self._engine.get_notifies()
            return self._done(rc), [NotifyDesc(name=n, notify_msg=m) for n, m in rows]
        except Exception as e:
            return self._failed("get_notifies", e), []

    # ------------------------------------------------------------ beyond CANN
    def wait_notifies(self, timeout_in_millis: Optional[int] = None) -> Tuple[int, List[NotifyDesc]]:
        """Like :meth:`get_notifies`, but blocks (GIL released) until at least one notify is there
        or the timeout (None: no limit) passes (then an empty list)."""
        try:
            if self._finalized:
                return FAILED, []
            t = self._wait_ms(timeout_in_millis)
            if t is None:
                return self._refuse("wait_notifies: timeout must be None or 0..2**31-1 ms"), []
            rc, rows = self._engine.get_notifies(t if t != 0 else 1)
            return self._done(rc), [NotifyDesc(name=n, notify_msg=m) for n, m in rows]
        except Exception as e:
            return self._failed("wait_notifies", e), []

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

    def get_link_info(self, remote_engine: str) -> Tuple[int, Dict[str, Any]]:
        """Transport, device, GID index, path MTU, queue pair numbers of the link to a peer."""
        try:
            if self._finalized:
                return FAILED, {}
            if self._remote(remote_engine) is None:
                return self._refuse("get_link_info: bad remote_engine %r" % (remote_engine,)), {}
            rc, info = self._engine.link_info(remote_engine)
            return self._done(rc), dict(info)
        except Exception as e:
            return self._failed("get_link_info", e), {}


__all__ = ["Hixl"]
