"""A backend's response copied to the client as it comes (status, Content-Type, Cache-Control, the body),
and what the client sees when the backend breaks off after the headers went out.

Once the status line is sent there is no second status to give. The relay therefore ends a broken
response the way vLLM's own API server ends a stream that fails (and openai-python raises ``APIError``
on): an SSE event ``data: {"error": {"message", "type", "param", "code"}}``, then ``data: [DONE]``, then
the end of the chunked body. For that the relay holds back an SSE event until its blank line has come
(an event is of no use to a client before that), so the error event never lands inside half an event;
the half that came before the break is dropped. A response that is not SSE (JSON, say), or one whose
events could not be held back (one event over :data:`HOLD_MAX` bytes), is cut off instead: the
connection is closed before the chunked body's last chunk, which HTTP clients report as an incomplete
response.
"""
from __future__ import annotations

import asyncio
import json
from typing import Optional

import aiohttp
from aiohttp import web

from .messages import error_doc

EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")  # the blank line ending an SSE event (as openai-python splits)
HOLD_MAX = 1 << 20  # bytes of one unfinished SSE event held back at most
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


def whole_events(buf: bytes) -> int:
    """How many leading bytes of buf are whole SSE events."""
    return max((i + len(e) for e in EVENT_ENDS if (i := buf.rfind(e)) >= 0), default=0)


def error_event(message: str, instance: str) -> bytes:
    doc = error_doc(502, message, "upstream_error", instance)
    return f"data: {json.dumps(doc)}\n\ndata: [DONE]\n\n".encode()


class Relay:
    """One backend response relayed to one client. After :meth:`run`, ``broken`` says why the backend
    broke off (None when it did not) and ``client_gone`` whether the client went away first."""

    def __init__(self, request: web.Request, resp: aiohttp.ClientResponse, name: str, url: str):
        self.request, self.resp, self.name, self.url = request, resp, name, url
        self.out = web.StreamResponse(status=resp.status)
        self.broken: Optional[str] = None
        self.client_gone = False
        self._sse = resp.content_type == "text/event-stream"
        self._pending = b""     # the start of an SSE event whose blank line has not come yet
        self._whole = self._sse  # what the client got so far ends where an SSE event ends

    async def run(self) -> web.StreamResponse:
        for h in ("Content-Type", "Cache-Control"):
            if h in self.resp.headers:
                self.out.headers[h] = self.resp.headers[h]
        try:
            await self.out.prepare(self.request)
        except (ConnectionError, RuntimeError):  # the client went away before the headers
            self.client_gone = True
            self.resp.close()
            return self.out
        chunks = self.resp.content.iter_any()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except UPSTREAM_ERRORS as e:
                self.broken = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                await self._end_broken()
                return self.out
            if not await self._forward(chunk):
                return self.out
        if self._pending and not await self._write(self._pending):
            return self.out
        try:
            await self.out.write_eof()
        except (ConnectionError, RuntimeError):
            self.client_gone = True
        return self.out

    async def _forward(self, chunk: bytes) -> bool:
        """Sends what of chunk the client can be given now; False when the client went away."""
        if not self._sse:
            self._whole = False
            return await self._write(chunk)
        self._pending += chunk
        n = whole_events(self._pending)
        if n == 0 and len(self._pending) < HOLD_MAX:
            return True
        self._whole = n > 0  # else one event over HOLD_MAX: its start goes out, the error event cannot follow
        n = n or len(self._pending)
        data, self._pending = self._pending[:n], self._pending[n:]
        return await self._write(data)

    async def _write(self, data: bytes) -> bool:
        try:
            await self.out.write(data)
            return True
        except (ConnectionError, RuntimeError):  # the client went away: stop (vLLM aborts the request)
            self.client_gone = True
            self.resp.close()
            return False

    async def _end_broken(self) -> None:
        """The backend broke off after the headers went out: an error event when the stream is at an
        event's end, else the connection cut before the body's end."""
        if self._whole:
            msg = f"{self.name} broke off its response ({self.broken})"
            if self._pending:
                msg += f"; {len(self._pending)} bytes of an unfinished event dropped"
            if await self._write(error_event(msg, self.url)):
                try:
                    await self.out.write_eof()
                    return
                except (ConnectionError, RuntimeError):
                    self.client_gone = True
            return
        self.out.force_close()
        transport = self.request.transport
        if transport is not None:
            transport.close()  # what was written goes out, the last chunk never: an incomplete body
