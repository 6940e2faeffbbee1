"""What every request passes before a route sees it (plain ASGI, outermost first):

    AccessLog       one line per HTTP request when `server.access_log` is on (method, path, status, time, id)
    APIKeyCheck     an API route needs `Authorization: Bearer <server.api_key>` when a key is set (401)
    RequestGate     counts the API requests in flight; once the server drains, refuses new ones (503)
    BodySizeLimit   a body over `server.max_request_body` is refused (413) before it is parsed

The API routes are `/v1/*` and vLLM's `/tokenize`, `/detokenize` and `/reset_prefix_cache` (which
vLLM leaves open: here they cost tokenizer time or a tenant's cached prefixes, so they need the key
too). `/health` and `/metrics` stay open without a key, as vLLM keeps them, so that load balancers
and Prometheus need no secret.
"""
from __future__ import annotations

import hmac
import logging
import time
import uuid
from dataclasses import dataclass

from kvstrata.engine.sizes import format_size
from kvstrata.serving.errors import APIError, service_unavailable

API_PREFIX = "/v1"
API_PATHS_OUTSIDE_PREFIX = ("/tokenize", "/detokenize", "/reset_prefix_cache")  # vLLM's paths


def _is_api(scope) -> bool:
    path = scope.get("path", "")
    return scope["type"] == "http" and (path == API_PREFIX or path.startswith(API_PREFIX + "/")
                                        or path in API_PATHS_OUTSIDE_PREFIX)


async def _send_error(send, error: APIError) -> None:
    response = error.response()
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class APIKeyCheck:
    def __init__(self, app, api_key: str | None):
        self.app = app
        self._expected = None if api_key is None else api_key.encode("utf-8")

    async def __call__(self, scope, receive, send) -> None:
        if self._expected is not None and _is_api(scope) and not self._authorized(scope):
            # The message never echoes what was sent: a mistyped key is still close to a secret.
            await _send_error(send, APIError(401, "missing or wrong API key: send it as 'Authorization: Bearer <key>'",
                                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}))
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        presented = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    presented = token.strip()
        # Constant time: how long the comparison takes says nothing of how much of the key matched.
        return hmac.compare_digest(presented, self._expected)


access_logger = logging.getLogger("kvstrata.access")
REQUEST_ID_HEADER = b"x-request-id"


class AccessLog:
    """One INFO line on `kvstrata.access` per HTTP request, when it ends: `POST /v1/completions 200 12.3 ms
    id=...`. Never the body, the query string or a header but the id: prompts and the API key stay out of
    logs. The id is the client's `X-Request-Id` when it sends one (as vLLM echoes it), else a new one; it
    is sent back in the response's `X-Request-Id`, so a client can find its line."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _header(scope, REQUEST_ID_HEADER) or uuid.uuid4().hex
        status = 0  # no response started: the client went away first
        started = time.perf_counter()

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (REQUEST_ID_HEADER, request_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            access_logger.info("%s %s %d %.1f ms id=%s", scope["method"], scope["path"], status,
                               (time.perf_counter() - started) * 1e3, request_id)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            text = value.decode("latin-1").strip()
            # a client's id goes into a log line: printable, short, one token
            if text and len(text) <= 128 and text.isprintable() and " " not in text:
                return text
    return None


@dataclass
class DrainState:
    """Shared by the gate and the server: whether the server is draining, and how many API requests
    are still being answered (streams until their last event)."""

    draining: bool = False
    in_flight: int = 0


class RequestGate:
    def __init__(self, app, state: DrainState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if not _is_api(scope):
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            await _send_error(send, service_unavailable("the server is shutting down and takes no new requests"))
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """Refuses a body larger than `max_bytes`: at once when its Content-Length says so (nothing of
    it is read), else as soon as the bytes received pass the limit (a chunked body). A body within
    the limit is read whole here and handed on, so the route never waits on a slow sender."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _send_error(send, self._too_large(f" ({declared} bytes)"))
            return
        try:
            body, disconnected = await self._read_body(receive)
        except BodyTooLarge:
            await _send_error(send, self._too_large(""))
            return
        if disconnected:
            return  # the client went away before it finished sending: nobody to answer
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive) -> tuple[bytes, bool]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    def _too_large(self, detail: str) -> APIError:
        return APIError(413, f"the request body{detail} is larger than the server's limit of "
                             f"{format_size(self.max_bytes)} (server.max_request_body)", code="request_too_large")


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _replay(body: bytes, receive):
    """A `receive` that gives the whole body first, then whatever the client sends next (its
    disconnect, which the routes watch for)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
