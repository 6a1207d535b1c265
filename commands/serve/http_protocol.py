"""uvicorn's HTTP/1.1 connection (h11) with a deadline on the request line and headers, and OpenAI-shaped refusals.

uvicorn bounds the headers' size (`h11_max_incomplete_event_size`) but not their time: a client that sends a
few bytes of a request line, or binary garbage without a line end, held its connection open for ever with no
answer. Here a connection that is waiting for a request gets `header_timeout_s` from the moment it became
idle (opened, or its last response sent) to finish the request's headers, however it trickles them: then a
408 if it sent part of a request, and the connection is closed either way. The body's own bound is the
middleware's (http_guard.py), which sees it arrive.

What h11 cannot parse (garbage, headers over the size limit, a bad Content-Length) gets uvicorn's 400 and a
closed connection, its body in OpenAI's error shape rather than plain text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .openai_api import error_body

HEADER_LIMIT_BYTES = 16 * 1024  # the request line and headers together (h11's default, stated)


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class BoundedH11Protocol(H11Protocol):
    header_timeout_s: float = 10.0  # set per server by `bounded_protocol`

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._headers_due: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._await_request()

    def _await_request(self) -> None:
        """Start the clock for the next request's headers."""
        if self._headers_due is not None:
            self._headers_due.cancel()
        self._waiting_since = self.cycle  # a new cycle object means the headers came
        self._headers_due = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._waiting_since and self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._headers_due = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being answered (pipelined after the last one): its own bounds hold
        partial, _ = self.conn.trailing_data
        if self.conn.their_state is h11.IDLE and partial:
            message = f"the request's headers did not arrive within {self.header_timeout_s:g} s"
            self.transport.write(_raw_response(408, "Request Timeout", message, "request_timeout"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to what h11 cannot parse, in OpenAI's shape."""
        message = (
            "malformed HTTP request: not HTTP/1.1, a bad header or Content-Length, "
            f"or a request line and headers over {HEADER_LIMIT_BYTES // 1024} KiB"
        )
        body = json.dumps(error_body(message, "invalid_request_error", None, "malformed_request")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # mid-response (a broken pipelined request): nothing more can be said
            pass
        self.transport.close()


def bounded_protocol(header_timeout_s: float) -> type[BoundedH11Protocol]:
    """The protocol class of one server (uvicorn takes a class, so the setting travels as a class attribute)."""
    return type("ServerH11Protocol", (BoundedH11Protocol,), {"header_timeout_s": header_timeout_s})


def protocol_kwargs(header_timeout_s: float) -> dict[str, Any]:
    """The uvicorn.Config arguments of the bounded protocol."""
    return {"http": bounded_protocol(header_timeout_s), "h11_max_incomplete_event_size": HEADER_LIMIT_BYTES}
