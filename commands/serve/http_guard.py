"""The door of the HTTP API: every request passes here before routing (a plain ASGI middleware).

- The request line and headers together are at most 16 KiB (431), and HTTP/1.x only.
- The API key, when one is set, guards every path but `/health` (the docs, the OpenAPI schema and `/metrics`
  too, and unknown paths, so that nothing can be probed without it), compared in constant time: both sides
  are hashed first, so not even the key's length shows in the timing.
- A request with a body must say `Content-Type: application/json` (a `charset` other than UTF-8 is refused):
  415 otherwise. Beyond matching what the server parses, this closes a hole: a web page may POST `text/plain`
  or a form to a loopback address without a CORS preflight, so a server that took those as JSON would run the
  model for any page its user opens. One exception, as llama-server makes it: `curl -d` sends JSON as
  `application/x-www-form-urlencoded`, so such a body is taken when it parses as a JSON object and the request
  carries no `Origin` (a browser always sends one with a POST; curl and the SDKs do not). A `Content-Encoding`
  other than identity is refused too (415): nothing is inflated, so a compressed bomb stays the size it was sent.
- The body is read here, bounded in size (a declared `Content-Length` over the limit is refused before a
  byte is read; a chunked body at the first chunk past it, so memory stays at the limit) and in time (a body
  shorter than its `Content-Length`, or one trickling in, gets a 408 when the time is up). The route then
  gets the whole body at once.
- Refusals take OpenAI's error shape and close the connection (the rest of the body is never read), and
  each is counted under a fixed set of endpoint labels: a random path is `other`, never a new series.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .http_protocol import HEADER_LIMIT_BYTES
from .openai_api import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics")
OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_TYPE, FORM_TYPE = "application/json", "application/x-www-form-urlencoded"


def endpoint_label(path: str) -> str:
    """The metrics label of a path: one of a fixed few, whatever the client sent."""
    return path if path in ENDPOINTS else "other"


def key_digest(text: str | bytes) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text).digest()


class Refusal(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


async def send_error(send: Send, status: int, message: str, kind: str, code: str | None, close: bool) -> None:
    body = json.dumps(error_body(message, kind, None, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequestGate:
    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        *,
        api_key: str | None,
        max_body_bytes: int,
        body_timeout_s: float,
        count: Callable[[str, str], None],
        open_paths: frozenset[str] = OPEN_PATHS,
    ) -> None:
        self.app, self.open_paths = app, open_paths
        self.key = None if api_key is None else key_digest(f"Bearer {api_key}")
        self.max_body_bytes, self.body_timeout_s, self.count = max_body_bytes, body_timeout_s, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        try:
            _check_request(scope)
            self._check_key(scope)
            if scope["method"] in BODY_METHODS:
                form = self._check_headers(scope)
                body = await self._read_body(receive)
                if body is None:
                    return  # the client went away while sending: nobody to answer
                if form is not None and not _json_object(body):
                    raise Refusal(
                        415,
                        f"Content-Type {form[:60]!r} with a body that is not a JSON object; send JSON with "
                        "Content-Type: application/json",
                        code="unsupported_media_type",
                    )
                receive = _replay(body, receive)
        except Refusal as no:
            self.count(endpoint_label(path), str(no.status))
            await send_error(send, no.status, str(no), no.kind, no.code, close=True)
            return
        await self.app(scope, receive, send)

    def _check_key(self, scope: Scope) -> None:
        if self.key is None or scope["path"] in self.open_paths:
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
        if not secrets.compare_digest(key_digest(given), self.key):
            raise Refusal(
                401, "invalid or missing API key; send it as 'Authorization: Bearer KEY'", "authentication_error"
            )

    def _check_headers(self, scope: Scope) -> str | None:
        """Refusals of the headers alone; the content type when it is curl's form type (the body decides)."""
        kind, length, chunked, origin = None, None, False, False
        for name, value in scope["headers"]:
            if name == b"content-type":
                kind = value.decode("latin-1")
            elif name == b"origin":
                origin = True
            elif name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"content-encoding" and value.strip().lower() != b"identity":
                shown = value.decode("latin-1")[:40]
                raise Refusal(  # never inflated here: a gzip bomb stays 1 MiB
                    415,
                    f"Content-Encoding {shown!r} is not supported; send the body uncompressed",
                    code="unsupported_media_type",
                )
        if length is not None and chunked:  # h11 would go by the chunks; a proxy in front may go by the length
            raise Refusal(400, "Content-Length and Transfer-Encoding together are ambiguous; send one of them")
        form = not origin and _is_media(kind, FORM_TYPE)  # `curl -d`'s default: taken if the body is JSON
        if not form and not _is_media(kind, JSON_TYPE):
            shown = "none" if kind is None else repr(kind[:60])
            raise Refusal(
                415,
                f"Content-Type must be application/json (got {shown}); send the body as JSON",
                code="unsupported_media_type",
            )
        if length is not None and int(length) > self.max_body_bytes:  # h11 has checked that it is digits
            raise Refusal(413, self._too_large(), code="request_too_large")
        return kind if form else None

    def _too_large(self) -> str:
        return f"the request body is over {self.max_body_bytes} bytes; send a smaller one"

    async def _read_body(self, receive: Receive) -> bytes | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        chunks: list[bytes] = []
        total = 0
        while True:
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except TimeoutError:
                raise Refusal(
                    408,
                    f"the request body did not arrive within {self.body_timeout_s:g} s "
                    f"(shorter than its Content-Length?)",
                    code="request_timeout",
                ) from None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body_bytes:
                raise Refusal(413, self._too_large(), code="request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _check_request(scope: Scope) -> None:
    """What h11 lets through but this server does not speak: another HTTP version, headers over the limit
    (h11 bounds only headers still arriving; ones that came in a single read are parsed whatever their size)."""
    if scope["http_version"] not in ("1.0", "1.1"):
        version = scope["http_version"][:8]
        raise Refusal(400, f"HTTP/{version} is not supported; send HTTP/1.1", code="malformed_request")
    size = len(scope["raw_path"]) + len(scope["query_string"]) + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
    if size > HEADER_LIMIT_BYTES:
        raise Refusal(
            431,
            f"the request line and headers are over {HEADER_LIMIT_BYTES // 1024} KiB; send fewer or shorter ones",
            code="request_header_fields_too_large",
        )


def _is_media(content_type: str | None, wanted: str) -> bool:
    """`wanted` (a media type), with at most a UTF-8 charset parameter (case and spaces as RFC 9110 allows)."""
    if content_type is None:
        return False
    media, *params = content_type.split(";")
    if media.strip().lower() != wanted:
        return False
    for param in params:
        name, _, value = param.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return False
    return True


def _json_object(body: bytes) -> bool:
    """Whether a form-typed body is in fact a JSON object (the route then parses it strictly)."""
    try:
        return isinstance(json.loads(body), dict)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return False


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read above, as one message; later calls wait on the connection (a disconnect)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
