"""The one place failures become HTTP: llmrt errors, validation errors, unknown routes, oversized bodies."""
from __future__ import annotations

import json
import math
from typing import Any, Optional

from typing import TYPE_CHECKING

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

if TYPE_CHECKING:  # FastAPI costs ~1 s to import; the router uses these helpers without it
    from fastapi import FastAPI

from llmrt.errors import CapacityExceededError, InvalidRequestError, LLMRTError

# Union members pydantic puts into error locations ("content", "str"): not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "literal"})


def error_headers(e: LLMRTError) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1) for capacity errors."""
    if isinstance(e, CapacityExceededError):
        seconds = e.retry_after if e.retry_after is not None and math.isfinite(e.retry_after) else 1.0
        return {"Retry-After": str(max(1, math.ceil(seconds)))}
    return {}


class ErrorJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message quoting bad input (a lone surrogate, say) still encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(e: LLMRTError) -> JSONResponse:
    """The HTTP response of an llmrt error: its status, OpenAI's body plus `retryable`, Retry-After if any."""
    return ErrorJSONResponse(e.to_dict(), status_code=e.http_status, headers=error_headers(e))


def sse_error_event(e: LLMRTError) -> str:
    """A failure after a stream started, as one server-sent event (followed by `data: [DONE]`)."""
    return f"data: {json.dumps(e.to_dict())}\n\n"


def validation_error(errors: list[Any]) -> InvalidRequestError:
    """The first pydantic/FastAPI validation error as a 400 invalid_request naming its top-level field."""
    if not errors:
        return InvalidRequestError("the request is not valid")
    first = errors[0]
    loc = tuple(first.get("loc") or ())
    kind = first.get("type", "")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "JSON decode error")
        pos = loc[1] if len(loc) > 1 else "?"
        return InvalidRequestError(f"the body is not valid JSON: {detail} (at character {pos})")
    path = [p for p in loc[1:] if not _is_type_tag(p)] if loc and loc[0] == "body" else list(loc)
    if not path:
        if kind == "missing":
            return InvalidRequestError("the request needs a JSON object body")
        return InvalidRequestError(f"the body must be a JSON object: {first.get('msg', 'invalid')}")
    dotted = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return InvalidRequestError(f"{dotted}: {first.get('msg', 'invalid value')}{more}", param=str(path[0]))


def _is_type_tag(part: Any) -> bool:
    if isinstance(part, int):
        return False
    text = str(part)
    return text in _TYPE_TAGS or not text.isidentifier()


def http_error(status: int, detail: Optional[str], method: str, path: str) -> dict[str, Any]:
    """Starlette's own errors (unknown route, wrong method) in the same body shape."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
    message = {404: f"no such endpoint: {method} {path}",
               405: f"method {method} is not allowed on {path}"}.get(status, detail or "bad request")
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code,
                      "retryable": False}, "retryable": False}


def install_exception_handlers(app: FastAPI) -> None:
    """Map every error class the routes can raise; unexpected ones are handled by the server middleware."""
    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(LLMRTError)
    async def _llmrt(request: Request, e: LLMRTError) -> JSONResponse:
        _note_error(request, e.code)
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        err = validation_error(list(e.errors()))
        _note_error(request, err.code)
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return ErrorJSONResponse(http_error(e.status_code, str(e.detail), request.method, request.url.path),
                            status_code=e.status_code, headers=getattr(e, "headers", None))


def _note_error(request: Request, code: str) -> None:
    record = getattr(request.state, "access", None)
    if isinstance(record, dict):
        record["error"] = code
