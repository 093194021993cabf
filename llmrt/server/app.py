"""The FastAPI app: OpenAI routes, tokenizer routes, health, version, metrics, dashboard and (opt-in) debug routes."""
from __future__ import annotations

from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse

import llmrt
from llmrt.config import ServerConfig
from llmrt.errors import InvalidRequestError
from llmrt.server import protocol as P
from llmrt.server import tokenizing
from llmrt.server.auth import ApiKeyMiddleware
from llmrt.server.chat import create_chat_completion
from llmrt.server.completions import create_completion
from llmrt.server.engine_client import EngineClient
from llmrt.server.errors import install_exception_handlers
from llmrt.server.instance import install_instance_routes
from llmrt.server.middleware import MAX_BODY_BYTES, ServerMiddleware
from llmrt.server.observability import install_observability
from llmrt.server.offload import Offloader
from llmrt.server.state import ServerState
from llmrt.structured.tool_parsers import select_tool_parser

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": P.ErrorResponse, "description": "invalid_request, context_length_exceeded or unsupported"},
    404: {"model": P.ErrorResponse, "description": "model_not_found"},
    408: {"model": P.ErrorResponse, "description": "deadline_exceeded: the request's timeout passed"},
    429: {"model": P.ErrorResponse, "description": "capacity_exceeded, with a Retry-After header (seconds)"},
    500: {"model": P.ErrorResponse, "description": "internal_error"},
    503: {"model": P.ErrorResponse, "description": "engine_dead or out_of_memory: retry on another instance"},
}


def _streamed(chunk: type) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": f"JSON; with `stream: true`, server-sent events `data: <{chunk.__name__}>` "
                                 "ending with `data: [DONE]` (a failure mid-stream is one `data: <StreamErrorEvent>`)",
                  "content": {"text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}}},
            **_ERRORS}


def build_app(engine: EngineClient, args: Any = None) -> FastAPI:
    """The server's app around a started engine (AsyncLLM or another EngineClient). `args`: the serve flags
    (any may be missing)."""
    d = ServerConfig
    served = getattr(args, "served_model_name", None) or engine.model_name
    aliases = {engine.model_name, str(getattr(args, "model", None) or engine.model_name)} - {served}
    state = ServerState(engine=engine, model_name=served, aliases=frozenset(aliases),
                        debug=bool(getattr(args, "enable_debug_endpoints", False)),
                        default_timeout=getattr(args, "request_timeout", None),
                        tool_parser=select_tool_parser(getattr(args, "tool_call_parser", None),
                                                       engine.tokenizer.chat_template),
                        max_request_tokens=getattr(args, "max_request_tokens", None) or d.max_request_tokens,
                        offload=Offloader(getattr(args, "tokenizer_threads", None) or d.tokenizer_threads))
    app = FastAPI(title="llmrt", version=llmrt.__version__,
                  description="OpenAI-compatible API of llmrt. Every error body is "
                              "`{\"error\": {message, type, param, code, retryable}, \"retryable\": bool}`.")
    app.state.llmrt = state
    install_exception_handlers(app)
    metrics, _ = install_observability(app, state)
    model_version = install_instance_routes(app, state, args)
    app.add_middleware(ApiKeyMiddleware, api_key=getattr(args, "api_key", None),
                       admin_api_key=getattr(args, "admin_api_key", None))
    app.add_middleware(ServerMiddleware, max_body_bytes=getattr(args, "max_body_bytes", None) or MAX_BODY_BYTES,
                       access_log=not getattr(args, "disable_access_log", False),
                       on_finish=metrics.observe_access_record)

    @app.post("/v1/completions", response_model=P.CompletionResponse, responses=_streamed(P.CompletionStreamResponse),
              summary="Text completion (OpenAI legacy completions)")
    async def completions(req: P.CompletionRequest, request: Request) -> Any:
        return await create_completion(state, req, request)

    @app.post("/v1/chat/completions", response_model=P.ChatCompletionResponse,
              responses=_streamed(P.ChatCompletionStreamResponse), summary="Chat completion")
    async def chat_completions(req: P.ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(state, req, request)

    @app.get("/v1/models", response_model=P.ModelList, summary="The served model")
    async def models() -> P.ModelList:
        return P.ModelList(data=[P.ModelCard(id=state.model_name, created=state.created,
                                             root=str(getattr(args, "model", None) or engine.model_name),
                                             max_model_len=engine.max_model_len, model_version=model_version)])

    @app.post("/tokenize", response_model=P.TokenizeResponse, responses=_ERRORS,
              summary="Token ids of a prompt, or of messages rendered with the chat template")
    async def tokenize(req: P.TokenizeRequest) -> P.TokenizeResponse:
        return await tokenizing.tokenize(state, req)

    @app.post("/detokenize", response_model=P.DetokenizeResponse, responses=_ERRORS, summary="Text of token ids")
    async def detokenize(req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        return await tokenizing.detokenize(state, req)

    @app.get("/health", response_model=P.HealthResponse, response_model_exclude_none=True,
             responses={503: {"model": P.HealthResponse, "description": "the engine is dead or not stepping"}},
             summary="200 while the engine can serve")
    async def health() -> Any:
        healthy, reason = engine.health()
        if healthy:
            return P.HealthResponse(status="ok")
        return JSONResponse(P.HealthResponse(status="unhealthy", reason=reason).model_dump(), status_code=503,
                            headers={"Cache-Control": "no-store"})

    @app.get("/version", response_model=P.VersionResponse, summary="The llmrt version and the model version")
    async def version() -> P.VersionResponse:
        config = getattr(engine, "config", None)
        return P.VersionResponse(version=llmrt.__version__, model_version=model_version,
                                 formats=config.formats_report() if hasattr(config, "formats_report") else None)

    if state.debug:
        @app.get("/debug/stats", summary="Engine figures (debug endpoints only)")
        async def debug_stats() -> dict[str, Any]:
            return dict(engine.stats())

        @app.post("/debug/fault", response_model=P.FaultResponse, responses=_ERRORS,
                  summary="Inject a fault into the engine (debug endpoints only)")
        async def debug_fault(req: P.FaultRequest) -> P.FaultResponse:
            seconds = float(req.seconds or 0.0)
            if not 0.0 <= seconds <= 3600.0:
                raise InvalidRequestError(f"seconds: must be in [0, 3600], got {seconds}", param="seconds")
            await engine.inject_fault(req.kind, seconds)
            return P.FaultResponse(kind=req.kind, seconds=seconds)

    _document_stream_chunks(app)
    return app


def _document_stream_chunks(app: FastAPI) -> None:
    """Put the stream chunk models into the schema's components (the routes' event-stream responses use them)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        # FastAPI documents a 422 for every body; this server answers validation errors with 400 instead.
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for model in P.STREAM_MODELS:
            model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
            for name, sub in model_schema.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components.setdefault(model.__name__, model_schema)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def server_state(app: FastAPI) -> Optional[ServerState]:
    """The ServerState of an app made by build_app."""
    return getattr(app.state, "llmrt", None)
