"""The connector's options: ``kv_connector_extra_config`` keys, each with a default and an environment
variable that sets it when the key is absent. Bad values (or an unknown key) fail at start-up with a
message naming the key, the value and what is allowed."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

__all__ = ["ConnectorConfig", "OPTIONS"]

_TRANSPORTS = ("auto", "rdma", "shm", "tcp")
_MODES = ("push", "pull")
DEFAULT_BOOTSTRAP_PORT = 8998  # Mooncake's


def _choice(allowed: Tuple[str, ...]) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        s = str(v).strip().lower() if isinstance(v, str) else v
        if s not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return s
    return parse


def _number(kind: type, lo: float, hi: float) -> Callable[[Any], Any]:
    def parse(v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("must be a number, not a bool")
        try:
            x = kind(v.strip()) if isinstance(v, str) else kind(v)
        except (TypeError, ValueError):
            raise ValueError(f"must be {'an integer' if kind is int else 'a number'}") from None
        if kind is int and isinstance(v, float) and v != x:
            raise ValueError("must be an integer")
        if not lo <= x <= hi:
            raise ValueError(f"must be in [{lo:g}, {hi:g}]")
        return x
    return parse


def _host(v: Any) -> str:
    if not isinstance(v, str) or not v.strip() or any(c.isspace() for c in v.strip()):
        raise ValueError("must be a host name or IP address")
    return v.strip()


# key: (environment variable, parser, default, what it is)
OPTIONS: Dict[str, Tuple[str, Callable[[Any], Any], Any, str]] = {
    "mode": ("HIXL_VLLM_MODE", _choice(_MODES), "push",
             "push: the prefill writes each layer's blocks into the decoder's blocks as soon as the layer is "
             "computed; pull: the decoder reads the prefill's blocks after the prefill finished"),
    "transport": ("HIXL_VLLM_TRANSPORT", _choice(_TRANSPORTS), "auto",
                  "hixl transport: auto (rdma > shm > tcp), rdma, shm or tcp"),
    "host": ("HIXL_VLLM_HOST", _host, None,
             "address the connector's hixl engine listens on and announces (default: vLLM's host IP)"),
    "port": ("HIXL_VLLM_PORT", _number(int, 0, 65535), 0,
             "port of the hixl engine (0: any free port; with tensor parallelism rank r uses port + r)"),
    "timeout_s": ("HIXL_VLLM_TIMEOUT_S", _number(float, 0.1, 86400), 120.0,
                  "decoder: a request whose KV is not complete this long after its blocks were granted (push) "
                  "or its read started (pull) fails through vLLM's kv_load_failure_policy"),
    "lease_s": ("HIXL_VLLM_LEASE_S", _number(float, 0.1, 86400), 60.0,
                "prefill: blocks of a finished request whose decoder never granted (push) or never read (pull) "
                "them are freed after this long"),
    "cancel_grace_s": ("HIXL_VLLM_CANCEL_GRACE_S", _number(float, 0.1, 600), 5.0,
                       "decoder: how long a cancelled request waits for the prefill to confirm that none of its "
                       "writes can land any more before the link to that prefill is closed"),
    "max_inflight": ("HIXL_VLLM_MAX_INFLIGHT", _number(int, 1, 65536), 64,
                     "prefill: transfers in flight at once; a layer beyond waits for one to complete"),
    "connect_timeout_ms": ("HIXL_VLLM_CONNECT_TIMEOUT_MS", _number(int, 1, 600000), 5000,
                           "timeout of a hixl connect to a peer"),
    "idle_wait_ms": ("HIXL_VLLM_IDLE_WAIT_MS", _number(float, 0, 1000), 5.0,
                     "in a step with nothing to compute, wait up to this long (blocking, no spin) instead of letting "
                     "vLLM step again after 1 ms: a decoder for a completion flag, a prefill holding blocks for a "
                     "decoder's message"),
    "bootstrap_port": ("HIXL_VLLM_BOOTSTRAP_PORT", _number(int, 0, 65535), None,
                       "prefill (kv_producer, kv_both): port of the Mooncake-compatible bootstrap endpoint "
                       "(GET /query names the hixl engine of each rank; vllm-router's mooncake mode asks it); "
                       "0 turns it off. Unset: 8998 (Mooncake's default) when it is free, else none (a warning "
                       "says so: a second prefill on one host); set: that port, or start-up fails"),
}


@dataclass(frozen=True)
class ConnectorConfig:
    mode: str = "push"
    transport: str = "auto"
    host: Optional[str] = None
    port: int = 0
    timeout_s: float = 120.0
    lease_s: float = 60.0
    cancel_grace_s: float = 5.0
    max_inflight: int = 64
    connect_timeout_ms: int = 5000
    idle_wait_ms: float = 5.0
    bootstrap_port: Optional[int] = None  # None: DEFAULT_BOOTSTRAP_PORT when free

    @classmethod
    def parse(cls, extra: Optional[Mapping[str, Any]], env: Optional[Mapping[str, str]] = None) -> "ConnectorConfig":
        """From ``kv_connector_extra_config`` (its keys win) and the environment (``HIXL_VLLM_*``)."""
        env = os.environ if env is None else env
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(OPTIONS))
        if unknown:
            raise ValueError(f"HixlConnector: unknown kv_connector_extra_config key(s) {unknown}; "
                             f"known: {sorted(OPTIONS)}")
        values: Dict[str, Any] = {}
        for key, (var, parse, default, _) in OPTIONS.items():
            if key in extra:
                raw, where = extra[key], f"kv_connector_extra_config[{key!r}]"
            elif env.get(var, "") != "":
                raw, where = env[var], f"${var}"
            else:
                values[key] = default
                continue
            try:
                values[key] = parse(raw)
            except ValueError as e:
                raise ValueError(f"HixlConnector: {where} = {raw!r} {e}") from None
        assert set(values) == {f.name for f in fields(cls)}
        return cls(**values)
