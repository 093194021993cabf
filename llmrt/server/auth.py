"""API keys: `--api-key` guards every route but /health; `--admin-api-key` guards /admin/* (off, 404, unless set).

Shared by `llmrt serve` and `llmrt route`. Pure ASGI, so that streamed responses pass through untouched.
"""
from __future__ import annotations

import hmac
import json
from typing import Optional

from starlette.types import ASGIApp, Receive, Scope, Send

from llmrt.errors import AuthenticationError, LLMRTError

ADMIN_PREFIX = "/admin/"
# Load balancers and orchestrators probe liveness without credentials.
PUBLIC_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    """Checks `Authorization: Bearer KEY` (OpenAI's scheme) before the app sees the request."""

    def __init__(self, app: ASGIApp, api_key: Optional[str] = None, admin_api_key: Optional[str] = None):
        self.app = app
        self.api_key = api_key or None
        self.admin_api_key = admin_api_key or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        token = bearer_token(scope)
        if path.startswith(ADMIN_PREFIX):
            if self.admin_api_key is None:  # admin endpoints do not exist unless a key is set
                await _send(send, 404, {"error": {"message": f"no such endpoint: {scope.get('method')} {path}",
                                                  "type": "invalid_request_error", "param": None,
                                                  "code": "not_found"}, "retryable": False})
                return
            if not _same(token, self.admin_api_key):
                await _refuse(send, "admin endpoints need the admin API key (Authorization: Bearer ...)")
                return
        elif self.api_key is not None and path not in PUBLIC_PATHS and not _same(token, self.api_key):
            await _refuse(send, "missing API key (Authorization: Bearer ...)" if token is None
                          else "incorrect API key provided")
            return
        await self.app(scope, receive, send)


def bearer_token(scope: Scope) -> Optional[str]:
    """The token of the request's `Authorization: Bearer` header, if any."""
    for key, value in scope.get("headers", []):
        if key.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _same(token: Optional[str], key: str) -> bool:
    return token is not None and hmac.compare_digest(token.encode(), key.encode())


async def _refuse(send: Send, message: str) -> None:
    err: LLMRTError = AuthenticationError(message)
    await _send(send, err.http_status, err.to_dict(), extra=[(b"www-authenticate", b"Bearer")])


async def _send(send: Send, status: int, body: dict, extra: Optional[list[tuple[bytes, bytes]]] = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(extra or [])]})
    await send({"type": "http.response.body", "body": data, "more_body": False})
