"""The prefill's Mooncake-compatible bootstrap endpoint: ``GET /query`` answers what vLLM's
``MooncakeBootstrapServer`` answers (``{dp_rank: {"engine_id", "worker_addr": {tp_rank: {pp_rank:
addr}}}}``), where ``addr`` is the hixl engine of that rank and ``engine_id`` the one the prefill's
answers carry (:func:`hixl.vllm.contracts.encode_engine_id`). ``vllm-router --kv-connector mooncake``
asks it before dispatching; a decoder given ``remote_bootstrap_addr`` may too.

It runs in the scheduler's process on a daemon thread of the standard library's HTTP server (blocking
on its socket, no spin) and holds no lock the scheduler takes: it calls ``answer()`` per query.
"""
from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Optional

_log = logging.getLogger("hixl.vllm")


class BootstrapServer:
    """``GET /query`` on ``host:port`` (``port`` 0: any free port, see :attr:`port`), answering
    ``answer()`` as JSON. :meth:`start` raises RuntimeError naming the port when it cannot listen."""

    def __init__(self, host: str, port: int, answer: Callable[[], Dict[Any, Any]], option: str = "bootstrap_port"):
        self.host, self.port, self.answer, self.option = host, port, answer, option
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        answer = self.answer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 -- the standard library's name
                if self.path.split("?", 1)[0].rstrip("/") != "/query":
                    self._send(404, {"detail": f"no route {self.path}; GET /query"})
                    return
                try:
                    doc = answer()
                except Exception as e:  # noqa: BLE001 -- the client hears it; the server stays up
                    _log.exception("hixl.vllm: bootstrap /query")
                    self._send(500, {"detail": f"{type(e).__name__}: {e}"})
                    return
                self._send(200, doc)

            def _send(self, status: int, doc: Any) -> None:
                body = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt: str, *args: Any) -> None:
                _log.debug("hixl.vllm: bootstrap %s", fmt % args)

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in self.host else socket.AF_INET

        try:
            self._server = Server((self.host, self.port), Handler)
        except OSError as e:
            why = "it is in use" if e.errno == errno.EADDRINUSE else f"errno {e.errno}: {e.strerror}"
            raise RuntimeError(f"HixlConnector: the bootstrap endpoint cannot listen on {self.host}:{self.port} "
                               f"({why}); choose another port with kv_connector_extra_config[{self.option!r}] "
                               f"(or $HIXL_VLLM_BOOTSTRAP_PORT), or 0 to turn it off") from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="hixl-vllm-bootstrap", daemon=True)
        self._thread.start()
        _log.info("hixl.vllm: bootstrap endpoint on http://%s:%d/query", self.host, self.port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
