"""Small HTTP and port helpers of the launchers (``vllm_launch``, ``router_process``)."""
from __future__ import annotations

import socket
import urllib.request

__all__ = ["free_port", "http_get"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()
