"""``hixl proxy``: the prefill/decode router in front of ``vllm serve`` instances running
:class:`hixl.vllm.HixlConnector` (see :mod:`hixl.proxy.server`).

    hixl proxy --prefill http://10.0.0.1:8100,http://10.0.0.2:8100 --decode http://10.0.0.3:8200 --port 8000

Needs aiohttp (``pip install 'hixl[proxy]'``; vLLM's environment has it).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional
from urllib.parse import urlparse

from .._extras import hint

__all__ = ["main"]

_ROUTERS = """which router for what:
  hixl proxy        sends each request to the prefill and the decoder at once (the decoder's grant
                    reaches the prefill while it computes): push mode overlaps the transfer with the
                    prefill layer by layer. The router to choose for the lowest TTFT with HixlConnector.
  vllm-router       (--vllm-pd-disaggregation --kv-connector nixl|mooncake) the production router:
                    prefill first, then decode. HixlConnector speaks both contracts (pull, or push of
                    the whole request after the prefill finished); mooncake mode asks each prefill's
                    bootstrap endpoint (bootstrap_port, 8998 by default).
  vLLM's toy proxies (toy_proxy_server.py, toy_push_proxy_server.py) work the same way, sequentially.
"""


def _urls(s: str) -> List[str]:
    out = []
    for u in (x.strip() for x in s.split(",")):
        p = urlparse(u)
        if p.scheme not in ("http", "https") or not p.netloc:
            raise argparse.ArgumentTypeError(f"{u!r} is not an http(s)://host:port URL")
        out.append(u.rstrip("/"))
    if not out:
        raise argparse.ArgumentTypeError("no URL given")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="hixl proxy", description=__doc__.split("\n\n")[0], epilog=_ROUTERS,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", type=_urls, required=True, help="prefill instances: URL[,URL...]")
    ap.add_argument("--decode", type=_urls, required=True, help="decode instances: URL[,URL...]")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    ap.add_argument("--on-prefill-failure", choices=("error", "decode"), default="error",
                    help="error: a failed prefill gives the client an HTTP 502 naming it (default); decode: the "
                         "decoder finishes the request by its kv_load_failure_policy")
    ap.add_argument("--mode", choices=("auto", "push", "pull"), default="auto",
                    help="how the KV moves: auto (each prefill instance's own mode, default), push or pull")
    ap.add_argument("--bootstrap-port", type=int, default=0,
                    help="prefill instances that run MooncakeConnector: the port of their bootstrap endpoint "
                         "(they are then served one request after the other); default 0: none")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    args = ap.parse_args(argv)
    try:
        from aiohttp import web

        from .server import Proxy
    except ImportError as e:
        print(f"hixl proxy needs aiohttp ({e}): {hint('aiohttp')}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proxy = Proxy(args.prefill, args.decode, timeout_s=args.timeout, on_prefill_failure=args.on_prefill_failure,
                  mode=args.mode, bootstrap_port=args.bootstrap_port)
    print(f"hixl proxy on http://{args.host}:{args.port}: prefill {args.prefill}, decode {args.decode}", flush=True)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
