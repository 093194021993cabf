"""The outermost layer of every request: body size cap, last-resort 500s, request ids and the access log."""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any, Callable, Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmrt.errors import InternalError, InvalidRequestError

logger = logging.getLogger("llmrt.server")
access_logger = logging.getLogger("llmrt.access")

# Larger bodies are refused (400) before they are parsed; `llmrt serve --max-body-bytes` (ServerConfig) changes
# it. Not read from llmrt.config here: that imports torch, which the router does not need.
MAX_BODY_BYTES = 10 * 1024 * 1024
# An oversized body is read and dropped (so that the client, still sending, gets the answer rather than a
# reset connection) up to this many bytes; past it the connection is simply closed.
_MAX_DRAIN_BYTES = 64 * 1024 * 1024
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# Polled by scrapers and the dashboard (every second): answered without an access-log line unless they fail.
_QUIET_PATHS = ("/metrics", "/dashboard")


class ServerMiddleware:
    """Pure ASGI (streaming responses pass through untouched)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = MAX_BODY_BYTES, access_log: bool = True,
                 on_finish: Optional[Callable[[dict[str, Any]], None]] = None):
        """`on_finish` sees every request's finished access record (the metrics count errors by code there)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.access_log = access_log
        self.on_finish = on_finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        request_id = _header(scope, b"x-request-id") or uuid.uuid4().hex
        record: dict[str, Any] = {"request_id": request_id, "method": scope.get("method"),
                                  "endpoint": scope.get("path")}
        scope.setdefault("state", {})["access"] = record
        started = False

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                record["status"] = message["status"]
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", str(record.get("request_id", request_id)).encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            replay = await self._read_body(scope, receive, send_wrapper)
            if replay is None:
                record["error"] = "invalid_request"
            else:
                await self.app(scope, replay, send_wrapper)
        except Exception:  # a bug: log it under the request id, answer a generic 500 if still possible, go on
            logger.exception("unhandled error in %s %s (request id %s)", scope.get("method"), scope.get("path"),
                             request_id)
            record["error"] = "internal_error"
            if not started:
                err = InternalError(request_id)
                await _send_json(send_wrapper, err.http_status, err.to_dict())
        finally:
            record["duration_s"] = round(time.monotonic() - start, 6)
            record.setdefault("status", None)
            if self.on_finish is not None:
                self.on_finish(record)
            quiet = str(scope.get("path", "")).startswith(_QUIET_PATHS) and (record["status"] or 500) < 400
            if self.access_log and not quiet and access_logger.isEnabledFor(logging.INFO):
                access_logger.info(json.dumps(record, default=str))

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Optional[Receive]:
        """Read the whole body (at most max_body_bytes) and return a receive that replays it; None if refused."""
        if scope.get("method") not in _BODY_METHODS:
            return receive
        limit = self.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None:
            try:
                size = int(declared)
                if size < 0:
                    raise ValueError
            except ValueError:
                await _refuse(send, f"Content-Length {declared!r} is not a byte count")
                return None
            if size > limit:
                await _drain(receive)
                await _refuse(send, f"the request body is {size} bytes, over the limit of {limit} bytes")
                return None
        chunks: list[bytes] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _replay_disconnect(message)
            body = message.get("body", b"")
            total += len(body)
            if total > limit:
                if message.get("more_body", False):
                    await _drain(receive)
                await _refuse(send, f"the request body is over the limit of {limit} bytes")
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay


def _replay_disconnect(message: Message) -> Receive:
    async def replay() -> Message:
        return message
    return replay


async def _drain(receive: Receive) -> None:
    total = 0
    while total <= _MAX_DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        total += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _refuse(send: Send, message: str) -> None:
    err = InvalidRequestError(message)
    await _send_json(send, err.http_status, err.to_dict())


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()  # ASCII-escaped: any text can be sent
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def _header(scope: Scope, name: bytes) -> Optional[str]:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
