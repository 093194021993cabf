"""What the routes share: the ServerState, and each request's access record."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from fastapi import Request

from llmrt.config import ServerConfig
from llmrt.errors import ModelNotFoundError
from llmrt.outputs import RequestOutput
from llmrt.server.engine_client import EngineClient
from llmrt.server.offload import Offloader
from llmrt.structured.tool_parsers import ToolParser
from llmrt.tokenizer import Tokenizer

if TYPE_CHECKING:
    from llmrt.server.generation import Generation


@dataclass
class ServerState:
    """What the routes share."""

    engine: EngineClient
    model_name: str  # the name /v1/models lists and responses carry
    aliases: frozenset[str]  # other names requests may use for it
    created: int = field(default_factory=lambda: int(time.time()))
    debug: bool = False
    default_timeout: Optional[float] = None  # --request-timeout
    # Called with the final engine outputs of every API request (metrics, dashboard).
    observers: list[Callable[[list[Optional[RequestOutput]]], None]] = field(default_factory=list)
    tool_parser: Optional[ToolParser] = None  # --tool-call-parser, or the chat template's format
    max_request_tokens: int = ServerConfig.max_request_tokens  # --max-request-tokens
    # Tokenizing, chat templates and grammar checks run here, off the event loop (--tokenizer-threads).
    offload: Offloader = field(default_factory=lambda: Offloader(ServerConfig.tokenizer_threads))

    @property
    def tokenizer(self) -> Tokenizer:
        """The engine's tokenizer."""
        return self.engine.tokenizer

    def check_model(self, name: Optional[str]) -> None:
        """404 model_not_found unless `name` is this server's model (or omitted)."""
        if name is None or name == self.model_name or name in self.aliases:
            return
        raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                                 param="model")


def access_record(request: Request) -> dict[str, Any]:
    """The access-log record of this request (filled in by the routes, written by the middleware)."""
    record = getattr(request.state, "access", None)
    return record if isinstance(record, dict) else {}


def finish_request(request: Request, gen: "Generation") -> None:
    """Write a finished (or failed) API request's counts and timings into its access record and the observers."""
    gen.log_into(access_record(request))
    state = getattr(request.app.state, "llmrt", None)
    for observe in state.observers if state is not None else ():
        observe(gen.latest)

