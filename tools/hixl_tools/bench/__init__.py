"""``hixl bench``: sweep operation, message size, descriptors per call, outstanding requests, threads
and transport; compare with perftest, Mooncake and NIXL measured in the same run.

Two processes, as in production: this one (the initiator) and a bench server holding the targets
(a hixl engine, an RDMA endpoint, perftest's and Mooncake's server halves). Locally the server is a
child process (``python -m hixl_tools.bench --serve``); across two hosts start it on the other host
(``hixl bench --serve --listen 0.0.0.0:18600``) and pass ``--server-ip``. With ``--pin`` (default on
>= 2 CPUs) the initiator runs on the first half of the CPUs and the server on the second half, and
every peer's halves inherit the same split.

Paths (``--path``):
  endpoint  C++ loops over one RC queue pair (``hixl.Endpoint``), rdma only: the floor of our stack.
  engine    C++ loops over the engine behind ``hixl.Hixl`` (transfer_async / transfer_sync), any transport.
  python    the same engine driven by a Python loop over ``hixl.Hixl`` (shows per-call Python cost).

Per configuration (transport, path, op, size, descs, window, threads):
  lat_med/p99[us]       one call alone (1 outstanding, 1 thread): submit -> completion seen by the caller
  half_rtt_med/p99[us]  rdma endpoint WRITE only: half the round trip of a write ping-pong, as ib_write_lat
  bw_med/min[MiB/s]     median / lowest trial of `window` requests kept in flight by each of `threads`
                        threads, `descs` descriptors of `size` bytes per request (MiB = 2^20 B)
  rate[Mdesc/s]         descriptors moved per second (median trial)
  req_p99[us]           a request's submit -> completion under that load (99th percentile)

With --vs perftest, perftest measures each size right after our endpoint path (one more trial of ours
follows, so ours brackets it), and WRITE latencies <= 4 KiB alternate ours / perftest for
--lat-rounds rounds, each tool's best round reported (see bench/README.md, "Under QEMU TCG").
--from-json writes the report of an earlier run again (plots where the measuring host had none).

The goals are evaluated when the data is there and reported (never an exit-code failure).
Exit codes: 0 done (even with goals missed or a peer skipped), 1 a measurement failed, 2 bad
arguments or an unusable environment (e.g. --transport rdma without an active device).
"""
# The package: options.py (what can be swept, the settings of a run), sides.py (our paths: endpoint,
# engine, python), driver.py (a run: server, rows, peers, report; main), server.py (the target side and
# its control protocol), peers.py (perftest, Mooncake, NIXL), report.py (tables, JSON, plots, goals).
# Imported lazily (PEP 562), so that ``python -m hixl_tools.bench.peers`` (the reference peers' child
# processes) does not import itself through the package first.
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"main": "driver", "run": "driver", "UsageError": "options", "active_rdma": "options",
            "build_parser": "options", "parse_sizes": "options", "resolve": "options"}
_SUBMODULES = ("driver", "options", "peers", "report", "server", "sides")
__all__ = sorted(_EXPORTS) + list(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module("." + _EXPORTS[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module("." + name, __name__)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
