"""``vllm-router`` (PyPI ``vllm-router``, installed by ``ci/install-vllm.sh``) in front of ``vllm serve``
instances on this host, in its prefill/decode mode: ``--vllm-pd-disaggregation --kv-connector nixl|mooncake``.

In ``nixl`` mode the router sends the prefill ``kv_transfer_params`` ``{do_remote_decode: true, ...}`` with
``max_tokens: 1`` and forwards the answer's params to the decoder; in ``mooncake`` mode it asks each prefill's
bootstrap endpoint (``--prefill URL BOOTSTRAP_PORT``) ``GET /query`` first. Both dispatch the two hops one
after the other.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
from typing import List, Optional, Sequence, Tuple

from ._net import free_port, http_get

__all__ = ["RouterProcess", "router_command"]

KV_CONNECTORS = ("nixl", "mooncake")


def router_command() -> List[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "vllm_router.launch_router"]


class RouterProcess:
    """``prefill``: ``(url, bootstrap_port or None)`` pairs; ``decode``: urls. Logs to ``log_dir/name.log``;
    :meth:`start` returns once the router answers ``/health`` and has every worker (it checks their
    ``/health`` itself before it serves)."""

    def __init__(self, prefill: Sequence[Tuple[str, Optional[int]]], decode: Sequence[str], *,
                 kv_connector: str = "nixl", log_dir: str = ".", name: str = "router", policy: str = "round_robin",
                 args: Optional[List[str]] = None):
        if kv_connector not in KV_CONNECTORS:
            raise ValueError(f"RouterProcess {name}: kv_connector {kv_connector!r} is not one of {KV_CONNECTORS}")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name, self.kv_connector = name, kv_connector
        cmd = router_command() + ["--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(self.port),
                                  "--kv-connector", kv_connector, "--policy", policy,
                                  # its metrics exporter's default port would clash with any other router here
                                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                  "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "120"]
        for url, bootstrap in prefill:
            cmd += ["--prefill", url] + ([str(bootstrap)] if bootstrap else [])
        for url in decode:
            cmd += ["--decode", url]
        self.cmd = cmd + list(args or [])
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.proc: Optional[subprocess.Popen] = None

    def start(self, timeout: float = 150.0) -> "RouterProcess":
        self._log = open(self.log_path, "ab")
        self._log.write(f"$ {' '.join(self.cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router {self.name} exited with {self.proc.returncode}; its log:\n{self.tail()}")
            try:
                http_get(self.url + "/health", timeout=2)
                return self
            except (OSError, urllib.error.URLError):
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"vllm-router {self.name} not ready within {timeout:g} s; its log:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
