"""The pool behind ``Hixl.connect_async`` / ``disconnect_async``, as CANN has it: tasks queue on a bounded
queue (``GlobalResourceConfig`` ``connect_pool.task_queue_capacity``, default 128; a full queue refuses with
RESOURCE_EXHAUSTED) and ``connect_pool.thread_num`` threads (default 2) run them. The calls only queue:
they never answer ALREADY_CONNECTED or NOT_CONNECTED themselves; the task's end does (a connect over a
live link ends CONNECTED, a disconnect of a peer never connected ends NOT_CONNECT).

The threads block on a condition while there is nothing to do (no polling), and start on the first task.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

from .types import ALREADY_CONNECTED, NOT_CONNECTED, SUCCESS, AsyncConnectStatus

_log = logging.getLogger("hixl")
__all__ = ["ConnectPool"]


class ConnectPool:
    def __init__(self, engine: Any, threads: int, capacity: int):
        self._engine, self._n_threads, self._capacity = engine, int(threads), int(capacity)
        self._cv = threading.Condition()
        self._queue: Deque[Tuple[str, str, int]] = deque()  # (kind, remote, timeout_ms)
        self._status: Dict[str, AsyncConnectStatus] = {}    # async tasks only, by remote
        self._threads: List[threading.Thread] = []
        self._closed = False

    def submit(self, kind: str, remote: str, timeout_ms: int) -> bool:
        """Queues a connect/disconnect of ``remote``; False when the queue is full (or closed)."""
        with self._cv:
            if self._closed or len(self._queue) >= self._capacity:
                return False
            self._queue.append((kind, remote, timeout_ms))
            self._status[remote] = (AsyncConnectStatus.CONNECT_PENDING if kind == "connect"
                                    else AsyncConnectStatus.DISCONNECT_PENDING)
            if len(self._threads) < self._n_threads:
                th = threading.Thread(target=self._run, name="hixl-connect-%d" % len(self._threads), daemon=True)
                self._threads.append(th)
                th.start()
            self._cv.notify()
        return True

    def status(self, remote: str) -> Optional[AsyncConnectStatus]:
        """The async task state of ``remote``; None when it has none."""
        with self._cv:
            return self._status.get(remote)

    def all(self) -> Dict[str, AsyncConnectStatus]:
        with self._cv:
            return dict(self._status)

    def forget(self, remote: str) -> None:
        with self._cv:
            self._status.pop(remote, None)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                kind, remote, timeout_ms = self._queue.popleft()
                self._status[remote] = (AsyncConnectStatus.CONNECTING if kind == "connect"
                                        else AsyncConnectStatus.DISCONNECTING)
            try:
                rc = (self._engine.connect if kind == "connect" else self._engine.disconnect)(remote, timeout_ms)
            except Exception as e:  # the engine reports by status; this would be a bug
                _log.warning("hixl: async %s of %s: %s", kind, remote, e)
                rc = -1
            with self._cv:
                if kind == "connect":
                    self._status[remote] = (AsyncConnectStatus.CONNECTED if rc in (SUCCESS, ALREADY_CONNECTED)
                                            else AsyncConnectStatus.CONNECT_FAILED)
                elif rc in (SUCCESS, NOT_CONNECTED):
                    self._status.pop(remote, None)  # ended NOT_CONNECT: no longer listed
                else:
                    self._status[remote] = AsyncConnectStatus.CONNECTED  # the link is still there
                if rc not in (SUCCESS, ALREADY_CONNECTED, NOT_CONNECTED):
                    _log.info("hixl: async %s of %s ended %s: %s", kind, remote, rc, self._engine.last_error())

    def close(self) -> None:
        """No task starts any more (queued ones are dropped); :meth:`join` waits for the running ones
        (finalize the engine in between: their connects then end at once)."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify_all()

    def join(self) -> None:
        for th in self._threads:
            if th is not threading.current_thread():
                th.join(30)
