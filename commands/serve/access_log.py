"""One structured line per HTTP request on stderr (JSON, through structlog): who asked what, the answer's status,
its size and how long it took, written when the answer's last byte is sent (a stream's too).

The path is logged without its query string and cut to a bounded length, the headers not at all: an API key
never reaches the log, nor can a client grow a line without bound.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

import structlog
from starlette.types import Message, Receive, Scope, Send

PATH_CHARS = 200


def access_logger(stream: TextIO) -> Any:
    return structlog.wrap_logger(
        structlog.PrintLogger(stream),
        processors=[
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(ensure_ascii=False),
        ],
    )


class AccessLog:
    """ASGI middleware: one `http_request` event per request, at its end (or when the client went away)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, stream: TextIO) -> None:
        self.app, self.log = app, access_logger(stream)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        answer = {"status": 0, "bytes": 0}

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
            elif message["type"] == "http.response.body":
                answer["bytes"] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            client = scope.get("client")
            self.log.info(
                "http_request",
                method=scope["method"],
                path=scope["path"][:PATH_CHARS],
                status=answer["status"] or 499,  # no answer started: the client went away first
                bytes=answer["bytes"],
                ms=round((time.perf_counter() - started) * 1000, 1),
                client=client[0] if client else None,
            )
