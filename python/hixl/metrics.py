"""An engine's counters as Prometheus metrics: :meth:`hixl.Hixl.metrics` and ``/metrics``.

The C++ engine counts (``csrc/engine/metrics.h``: relaxed atomics, a few adds per transfer, none
per descriptor); this module names what it counts. :func:`families` is the one description both
outputs come from, so the dict of :meth:`Hixl.metrics` and what ``/metrics`` serves are the same:

=====================================  =========  ==========================================================
metric                                 type       labels / meaning
=====================================  =========  ==========================================================
``hixl_transfers_total``               counter    op, transport, status (completed, failed, timeout): ended
``hixl_transfer_bytes_total``          counter    op, transport: bytes of COMPLETED transfers
``hixl_descriptors_total``             counter    op, transport: descriptors of ended transfers
``hixl_transfer_seconds``              histogram  op: submit to the end seen (sync: the call returned;
                                                  async: the status call that reported it)
``hixl_links``                         gauge      transport: links open now
``hixl_link_closed_total``             counter    cause: disconnect, peer_closed, heartbeat, abort,
                                                  transfer_error, stuck_frame, stalled (the peer
                                                  stopped reading), superseded, finalize, auth (a
                                                  peer refused for it), async_event
``hixl_notifies_total``                counter    direction: sent (acknowledged), received
``hixl_refused_total``                 counter    reason: range, access, limit, param: transfers refused
                                                  before anything was posted
=====================================  =========  ==========================================================

Serving is opt-in (option ``HixlMetricsPort`` or env ``HIXL_METRICS_PORT``; 0 picks a free port)
and needs ``prometheus-client`` (``pip install hixl[metrics]``); the dict needs nothing.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Tuple

from . import _extras

# (name as exposed, type, help)
_HELP = {
    "hixl_transfers_total": ("counter", "Transfers that ended, by op, transport and status."),
    "hixl_transfer_bytes_total": ("counter", "Bytes moved by transfers that completed."),
    "hixl_descriptors_total": ("counter", "Descriptors of transfers that ended."),
    "hixl_transfer_seconds": ("histogram", "Seconds from a transfer's submission to its end as seen by the engine."),
    "hixl_links": ("gauge", "Links open now, by transport."),
    "hixl_link_closed_total": ("counter", "Links closed (and peers refused for authentication), by cause."),
    "hixl_notifies_total": ("counter", "Notifies sent (acknowledged by the peer) and received."),
    "hixl_refused_total": ("counter", "Transfers refused before anything was posted, by reason."),
}
Sample = Tuple[str, Dict[str, str], float]  # (sample name, labels, value)


def families(raw: Dict[str, Any]) -> Iterator[Tuple[str, str, str, List[Sample]]]:
    """``(name, type, help, samples)`` for each metric, from ``_core.Engine.metrics()``."""
    ops, transports, statuses = raw["ops"], raw["transports"], raw["statuses"]

    def fam(name: str, samples: List[Sample]) -> Tuple[str, str, str, List[Sample]]:
        kind, text = _HELP[name]
        return name, kind, text, samples

    yield fam("hixl_transfers_total", [
        ("hixl_transfers_total", {"op": op, "transport": t, "status": st}, float(raw["transfers"][o][ti][si]))
        for o, op in enumerate(ops) for ti, t in enumerate(transports) for si, st in enumerate(statuses)])
    yield fam("hixl_transfer_bytes_total", [
        ("hixl_transfer_bytes_total", {"op": op, "transport": t}, float(raw["bytes"][o][ti]))
        for o, op in enumerate(ops) for ti, t in enumerate(transports)])
    yield fam("hixl_descriptors_total", [
        ("hixl_descriptors_total", {"op": op, "transport": t}, float(raw["descriptors"][o][ti]))
        for o, op in enumerate(ops) for ti, t in enumerate(transports)])
    hist: List[Sample] = []
    bounds = [repr(float(b)) for b in raw["bucket_bounds"]] + ["+Inf"]
    for o, op in enumerate(ops):
        total = 0
        for le, n in zip(bounds, raw["seconds_buckets"][o]):
            total += n
            hist.append(("hixl_transfer_seconds_bucket", {"op": op, "le": le}, float(total)))
        hist.append(("hixl_transfer_seconds_count", {"op": op}, float(total)))
        hist.append(("hixl_transfer_seconds_sum", {"op": op}, float(raw["seconds_sum"][o])))
    yield fam("hixl_transfer_seconds", hist)
    yield fam("hixl_links", [("hixl_links", {"transport": t}, float(raw["links"][ti]))
                             for ti, t in enumerate(transports)])
    yield fam("hixl_link_closed_total", [("hixl_link_closed_total", {"cause": c}, float(n))
                                         for c, n in raw["links_closed"].items()])
    yield fam("hixl_notifies_total", [
        ("hixl_notifies_total", {"direction": "sent"}, float(raw["notifies_sent"])),
        ("hixl_notifies_total", {"direction": "received"}, float(raw["notifies_received"]))])
    yield fam("hixl_refused_total", [("hixl_refused_total", {"reason": r}, float(n))
                                     for r, n in raw["refused"].items()])


def as_dict(raw: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    """``{metric name: [{"name": sample name, "labels": {...}, "value": float}, ...]}``."""
    return {name: [{"name": s, "labels": dict(labels), "value": v} for s, labels, v in samples]
            for name, _, _, samples in families(raw)}


class _Collector:
    """A prometheus_client collector reading one engine at each scrape."""

    def __init__(self, read: Any) -> None:
        self._read = read  # () -> raw dict, or None once the engine is gone

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import Metric
        raw = self._read()
        if raw is None:
            return
        for name, kind, text, samples in families(raw):
            # Metric takes the family name without the _total suffix of counters (the text format
            # adds it back to the samples, which keep the names above).
            m = Metric(name[:-len("_total")] if kind == "counter" else name, text, kind)
            for s, labels, v in samples:
                m.add_sample(s, labels, v)
            yield m


class Server:
    """``/metrics`` of one engine over HTTP (prometheus_client's server on its own thread)."""

    def __init__(self, read: Any, host: str, port: int) -> None:
        prom = _extras.require("prometheus_client", "HixlMetricsPort (/metrics)")
        CollectorRegistry, start_http_server = prom.CollectorRegistry, prom.start_http_server
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(read))
        try:
            started = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise RuntimeError("metrics: cannot serve on %s port %d: %s" % (host, port, e)) from None
        self._httpd, self._thread = started if isinstance(started, tuple) else (None, None)
        self.host = host
        self.port = self._httpd.server_port if self._httpd is not None else port

    @property
    def address(self) -> str:
        return ("[%s]:%d" if ":" in self.host else "%s:%d") % (self.host, self.port)

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


__all__ = ["families", "as_dict", "Server"]
