"""What the worker's parts (:class:`~hixl.vllm.producer.Producer`, :class:`~hixl.vllm.consumer.Consumer`)
need of the links to peer connectors: whether a peer is linked, a way to reach it, and the jobs thread
for whatever may wait on it. The worker's :class:`~hixl.vllm.engine_links.EngineLinks` is one over its
hixl engine; a test passes one of its own."""
from __future__ import annotations

from typing import Callable, Protocol


class Links(Protocol):
    def linked(self, peer: str) -> bool:
        """Whether the engine has a link to ``peer`` now (any thread; never waits)."""

    def ensure_link(self, peer: str) -> None:
        """Connects to ``peer`` unless linked (jobs thread only). Raises ConnectionError."""

    def send(self, peer: str, kind: str, tid: str, payload: str = "", connect: bool = True) -> None:
        """Sends a message of :mod:`hixl.vllm.messages` (jobs thread only). Raises ConnectionError."""

    def post(self, peer: str, kind: str, tid: str, payload: str = "") -> None:
        """:meth:`send` on the jobs thread without connecting, best effort (a failure is logged)."""

    def submit(self, job: Callable[[], None]) -> None:
        """Runs ``job`` on the jobs thread (in order)."""

    def disconnect(self, peer: str) -> None:
        """Closes the link to ``peer``: none of its writes can land here any more."""
