"""The error taxonomy: every failure a caller can see, with its code, HTTP status and retryability."""
from __future__ import annotations

from typing import Any, Optional


class LLMRTError(Exception):
    """Base of every llmrt error a caller can see."""

    code: str = "internal_error"
    http_status: int = 500
    retryable: bool = False
    error_type: str = "server_error"

    def __init__(self, message: str, param: Optional[str] = None, retry_after: Optional[float] = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's error body plus `retryable`, inside `error` (what the openai SDK shows as `e.body`) and
        at the top level (where this server's clients read it before)."""
        return {
            "error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code,
                      "retryable": self.retryable},
            "retryable": self.retryable,
        }


class InternalError(LLMRTError):
    """A bug: the caller sees only this generic message and the request id; the log has the details."""

    def __init__(self, request_id: Optional[str]):
        where = f"request id {request_id}" if request_id else "no request id"
        super().__init__(f"internal server error ({where}); the server log holds the details under that id")
        self.request_id = request_id


class InvalidRequestError(LLMRTError):
    """A bad field or body; `param` names the field."""

    code, http_status, retryable, error_type = "invalid_request", 400, False, "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """Prompt plus max_tokens over max_model_len, or more KV than the cache can ever hold."""

    code = "context_length_exceeded"


class AuthenticationError(LLMRTError):
    """A missing or wrong API key (`--api-key`, `--admin-api-key`)."""

    code, http_status, retryable, error_type = "invalid_api_key", 401, False, "invalid_request_error"


class ModelNotFoundError(LLMRTError):
    """Unknown model name."""

    code, http_status, retryable, error_type = "model_not_found", 404, False, "invalid_request_error"


class UnsupportedError(LLMRTError):
    """A feature the model or device cannot do, said before any work starts."""

    code, http_status, retryable, error_type = "unsupported", 400, False, "invalid_request_error"


class ModelLoadError(LLMRTError):
    """A checkpoint that cannot be loaded: missing tensor, shape mismatch, unreadable file."""

    code, http_status, retryable, error_type = "model_load_error", 500, False, "server_error"


class CapacityExceededError(LLMRTError):
    """Waiting queue full or load shed; retry after `retry_after` seconds."""

    code, http_status, retryable, error_type = "capacity_exceeded", 429, True, "rate_limit_error"


class DeadlineExceededError(LLMRTError):
    """The request's own timeout passed before it finished."""

    code, http_status, retryable, error_type = "deadline_exceeded", 408, True, "timeout_error"


class OutOfMemoryError(LLMRTError):
    """Device memory ran out and the engine could not absorb it."""

    code, http_status, retryable, error_type = "out_of_memory", 503, True, "server_error"


class EngineDeadError(LLMRTError):
    """The engine core died; retry on another instance."""

    code, http_status, retryable, error_type = "engine_dead", 503, True, "server_error"


class DrainingError(LLMRTError):
    """The instance is draining (POST /admin/drain): it finishes its work but takes no new requests; retry on
    another instance. 503, not 429: the client is not sending too much, this instance is going away."""

    code, http_status, retryable, error_type = "draining", 503, True, "server_error"


class UnavailableError(LLMRTError):
    """A router found no instance that could take the request (all down, draining, or failing); retry later."""

    code, http_status, retryable, error_type = "unavailable", 503, True, "server_error"


class UpstreamTimeoutError(LLMRTError):
    """A router waited longer than its read timeout for an instance's answer. Not retried by the router: the
    slowness is most likely the request's own (a long generation without streaming), so another instance would
    time out too while the first may still be working on it."""

    code, http_status, retryable, error_type = "upstream_timeout", 504, False, "timeout_error"


class HardwareFaultError(LLMRTError):
    """The device failed; retry on another instance."""

    code, http_status, retryable, error_type = "hardware_fault", 503, True, "server_error"


class CancelledError(LLMRTError):
    """The client went away; its blocks are already free."""

    code, http_status, retryable, error_type = "cancelled", 499, False, "invalid_request_error"


ALL_ERRORS: tuple[type[LLMRTError], ...] = (
    InvalidRequestError, ContextLengthExceededError, AuthenticationError, ModelNotFoundError, UnsupportedError,
    ModelLoadError, CapacityExceededError, DeadlineExceededError, OutOfMemoryError, EngineDeadError, DrainingError,
    UnavailableError, UpstreamTimeoutError, HardwareFaultError, CancelledError,
)
