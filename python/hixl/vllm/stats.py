"""Per-request figures of the connector through vLLM's own channels: ``get_kv_connector_stats`` (logged
by vLLM as "KV Transfer metrics: ...") and Prometheus metrics on the instance's ``/metrics``
(``vllm:hixl_*``)."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .specs import KINDS

_LISTS = ("send_bytes", "send_descriptors", "send_transfers", "send_busy_s", "send_exposed_s",
          "recv_tokens", "recv_bytes", "recv_wait_s", "recv_pull", "recv_relay_bytes")
_COUNTS = ("send_failed", "recv_failed", "recv_timeouts", "send_expired")
# bytes by KV cache group kind (hixl.vllm.specs.KINDS), summed: {"send": {kind: bytes}, "recv": {...}}
_KINDS = ("send_kinds", "recv_kinds")


def _add_kinds(into: Dict[str, int], more: Dict[str, int]) -> None:
    for kind, n in more.items():
        into[kind] = into.get(kind, 0) + int(n)


@dataclass
class HixlStats(KVConnectorStats):
    """One entry per finished transfer in the lists; failure counters. Plain data (vLLM serializes it
    from the worker to the scheduler); :class:`Recorder` fills it."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: Dict[str, Any] = {k: [] for k in _LISTS}
        self.data.update({k: 0 for k in _COUNTS})
        self.data.update({k: {} for k in _KINDS})

    # -- vLLM's side ----------------------------------------------------------------------------
    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _LISTS + _COUNTS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in _LISTS:
            self.data[k].extend(other.data.get(k, []))
        for k in _COUNTS:
            self.data[k] += other.data.get(k, 0)
        for k in _KINDS:
            _add_kinds(self.data.setdefault(k, {}), other.data.get(k, {}))
        return self

    def reduce(self) -> Dict[str, int | float]:
        d = self.data
        out: Dict[str, int | float] = {"Num sent": len(d["send_bytes"]), "Num received": len(d["recv_tokens"])}
        if d["send_bytes"]:
            out.update({
                "Sent MiB": round(sum(d["send_bytes"]) / 2 ** 20, 3),
                "Avg descriptors per request": round(float(np.mean(d["send_descriptors"])), 1),
                "Avg transfer time (ms)": round(float(np.mean(d["send_busy_s"])) * 1e3, 3),
                "Avg exposed transfer time (ms)": round(float(np.mean(d["send_exposed_s"])) * 1e3, 3),
            })
        for side, what in (("send_kinds", "Sent"), ("recv_kinds", "Received")):
            kinds = d.get(side, {})
            if len(kinds) > 1:  # a hybrid model: where the bytes went
                out.update({f"{what} MiB ({kind})": round(n / 2 ** 20, 3) for kind, n in sorted(kinds.items())})
        if d["recv_tokens"]:
            out.update({
                "Received tokens": int(sum(d["recv_tokens"])),
                "Received MiB": round(sum(d["recv_bytes"]) / 2 ** 20, 3),
                **({"Relayed MiB": round(sum(d["recv_relay_bytes"]) / 2 ** 20, 3)} if any(d["recv_relay_bytes"])
                   else {}),
                "Avg KV wait (ms)": round(float(np.mean(d["recv_wait_s"])) * 1e3, 3),
                "P90 KV wait (ms)": round(float(np.percentile(d["recv_wait_s"], 90)) * 1e3, 3),
            })
        out.update({"Send failures": d["send_failed"], "Expired": d["send_expired"],
                    "Receive failures": d["recv_failed"], "Receive timeouts": d["recv_timeouts"]})
        return out


class Recorder:
    """The worker's side: records from any of its threads; :meth:`take` hands vLLM what came since the
    last take."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._s = HixlStats()

    def sent(self, nbytes: int, descs: int, transfers: int, busy_s: float, exposed_s: float, ok: bool,
             by_kind: Optional[Dict[str, int]] = None) -> None:
        with self._lock:
            if ok:
                for k, v in zip(_LISTS[:5], (nbytes, descs, transfers, busy_s, exposed_s)):
                    self._s.data[k].append(v)
                _add_kinds(self._s.data["send_kinds"], by_kind or {})

    def received(self, tokens: int, by_kind: Dict[str, int], wait_s: float, mode: str) -> None:
        """A load ended well: ``by_kind`` its bytes per group kind; ``mode`` push, pull or relay (copied
        from another rank of this instance: not counted as bytes received over the network)."""
        nbytes, relay = sum(by_kind.values()), mode == "relay"
        with self._lock:
            for k, v in zip(_LISTS[5:], (tokens, 0 if relay else nbytes, wait_s, int(mode == "pull"),
                                         nbytes if relay else 0)):
                self._s.data[k].append(v)
            if not relay:
                _add_kinds(self._s.data["recv_kinds"], by_kind)

    def failed(self, side: str, timeout: bool = False) -> None:
        with self._lock:
            self._s.data[f"{side}_failed"] += 1
            if timeout:
                self._s.data["recv_timeouts"] += 1

    def expired(self) -> None:
        with self._lock:
            self._s.data["send_expired"] += 1

    def take(self) -> "HixlStats | None":
        """What was recorded since the last take (None when nothing was)."""
        with self._lock:
            if self._s.is_empty():
                return None
            out, self._s = self._s, HixlStats()
            return out


class HixlPromMetrics(KVConnectorPromMetrics):
    """``vllm:hixl_*`` counters and histograms, per engine."""

    def __init__(self, vllm_config: Any, metric_types: Dict[type, type], labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        def counter(name: str, doc: str):
            return create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                            per_engine_labelvalues)

        def by_kind(name: str, doc: str):  # one child per engine and group kind
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames + ["kind"])
            return {idx: {kind: metric.labels(*values, kind) for kind in KINDS}
                    for idx, values in per_engine_labelvalues.items()}

        def histogram(name: str, doc: str, buckets: List[float]):
            return create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames),
                per_engine_labelvalues)

        times = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
        self.counters = {
            "send_bytes": counter("vllm:hixl_kv_sent_bytes", "KV bytes pushed from this prefill instance (a decoder's reads, pull "
                                  "mode, count on the decoder)."),
            "send_descriptors": counter("vllm:hixl_kv_sent_descriptors", "Transfer descriptors posted for KV pushes."),
            "send_ok": counter("vllm:hixl_kv_sent_requests", "Requests whose KV reached their decoder."),
            "send_busy_s": counter("vllm:hixl_kv_transfer_seconds",
                                   "Prefill side: union of the submit..completion intervals of each request's pushes."),
            "send_exposed_s": counter("vllm:hixl_kv_exposed_transfer_seconds",
                                      "Prefill side: the part of the transfer time after the prompt's last layer was "
                                      "computed (not hidden behind prefill compute)."),
            "recv_ok": counter("vllm:hixl_kv_received_requests", "Requests whose KV arrived by transfer."),
            "recv_pull": counter("vllm:hixl_kv_received_requests_pull", "Of them, received by a read (pull mode)."),
            "recv_tokens": counter("vllm:hixl_kv_received_tokens", "Prompt tokens whose KV arrived by transfer."),
            "recv_bytes": counter("vllm:hixl_kv_received_bytes", "KV bytes received (over the network)."),
            "recv_relay_bytes": counter("vllm:hixl_kv_relayed_bytes",
                                        "KV bytes a decoder rank copied from another rank of its instance (the MLA "
                                        "latent, which crossed the network once)."),
            "send_failed": counter("vllm:hixl_kv_send_failures", "Pushes that failed or were aborted."),
            "send_expired": counter("vllm:hixl_kv_expired", "Finished prefills whose decoder never came (lease)."),
            "recv_failed": counter("vllm:hixl_kv_receive_failures", "Requests whose KV did not arrive (failed "
                                   "through kv_load_failure_policy)."),
            "recv_timeouts": counter("vllm:hixl_kv_receive_timeouts", "Of them, timed out."),
        }
        self.kinds = {
            "send_kinds": by_kind("vllm:hixl_kv_sent_bytes_by_kind", "KV bytes sent, by KV cache group kind (full, "
                                  "sliding, mla, mamba)."),
            "recv_kinds": by_kind("vllm:hixl_kv_received_bytes_by_kind", "KV bytes received over the network, by KV "
                                  "cache group kind (full, sliding, mla, mamba)."),
        }
        self.wait = histogram("vllm:hixl_kv_wait_seconds", "Decoder: grant (or read start) until the KV is complete.",
                              times)

    def observe(self, data: Dict[str, Any], engine_idx: int = 0) -> None:
        c = self.counters
        for key in ("send_bytes", "send_descriptors", "send_busy_s", "send_exposed_s", "recv_tokens", "recv_bytes",
                    "recv_relay_bytes"):
            total = sum(data.get(key, []))
            if total:
                c[key][engine_idx].inc(total)
        if data.get("send_bytes"):
            c["send_ok"][engine_idx].inc(len(data["send_bytes"]))
        if data.get("recv_tokens"):
            c["recv_ok"][engine_idx].inc(len(data["recv_tokens"]))
            c["recv_pull"][engine_idx].inc(sum(data.get("recv_pull", [])))
        for key in ("send_failed", "send_expired", "recv_failed", "recv_timeouts"):
            if data.get(key):
                c[key][engine_idx].inc(data[key])
        for side, children in self.kinds.items():
            for kind, n in data.get(side, {}).items():
                if n and kind in children[engine_idx]:
                    children[engine_idx][kind].inc(n)
        for v in data.get("recv_wait_s", []):
            self.wait[engine_idx].observe(v)
