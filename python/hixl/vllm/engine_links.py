"""The worker's :class:`~hixl.vllm.links.Links`: links to peer connectors over its hixl engine, and the
queue of the *jobs* thread (the worker starts it on :meth:`EngineLinks.run_jobs`), which does what may
wait on a peer (connect, send a notify, start a pull) so that the forward pass never waits on the network."""
from __future__ import annotations

import logging
import queue
from typing import Callable, Optional

from ..engine import Hixl
from ..types import ALREADY_CONNECTED, SUCCESS, NotifyDesc
from . import messages

_log = logging.getLogger("hixl.vllm")


class EngineLinks:
    def __init__(self, engine: Hixl, connect_timeout_ms: int):
        self.engine, self.connect_timeout_ms = engine, connect_timeout_ms
        self._jobs: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()

    def linked(self, peer: str) -> bool:
        return self.engine.get_transport(peer)[0] == SUCCESS

    def ensure_link(self, peer: str) -> None:
        """Connects to ``peer`` unless linked (jobs thread only: it may wait ``connect_timeout_ms``)."""
        if self.linked(peer):
            return
        rc = self.engine.connect(peer, self.connect_timeout_ms)
        if rc not in (SUCCESS, ALREADY_CONNECTED):
            raise ConnectionError(f"hixl connect to {peer} failed: {self.engine.last_error()}")

    def send(self, peer: str, kind: str, tid: str, payload: str = "", connect: bool = True) -> None:
        """Sends a message of :mod:`hixl.vllm.messages` (jobs thread only). Raises ConnectionError."""
        if connect:
            self.ensure_link(peer)
        for name, msg in messages.encode(kind, tid, payload):
            rc = self.engine.send_notify(peer, NotifyDesc(name=name, notify_msg=msg), self.connect_timeout_ms)
            if rc != SUCCESS:
                raise ConnectionError(f"hixl send_notify({peer}, {name}) failed: {self.engine.last_error()}")

    def post(self, peer: str, kind: str, tid: str, payload: str = "") -> None:
        """:meth:`send` on the jobs thread, best effort (a failure is logged)."""
        def job() -> None:
            try:
                self.send(peer, kind, tid, payload, connect=False)
            except (ConnectionError, ValueError) as e:
                _log.info("hixl.vllm: %s of %s to %s not delivered: %s", kind, tid, peer, e)
        self.submit(job)

    def submit(self, job: Callable[[], None]) -> None:
        """Runs ``job`` on the jobs thread (in order)."""
        self._jobs.put(job)

    def disconnect(self, peer: str) -> None:
        self.engine.disconnect(peer, self.connect_timeout_ms)

    # -- the jobs thread -----------------------------------------------------------------------------
    def run_jobs(self) -> None:
        """The jobs thread's body: runs the submitted jobs in order (blocking between them) until
        :meth:`stop_jobs`."""
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:  # a job reports its own failures; this is a bug
                _log.exception("hixl.vllm: job failed")

    def stop_jobs(self) -> None:
        """Ends :meth:`run_jobs` after the jobs queued before."""
        self._jobs.put(None)
