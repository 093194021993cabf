"""`llmrt serve`: start the engine, then serve the app with uvicorn until SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import sys
from typing import Any

from llmrt.config import ServerConfig
from llmrt.engine_args import default_of
from llmrt.server.listen import bind_socket, serve_on_socket, setup_access_log

logger = logging.getLogger("llmrt.server")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The server's own flags (the engine's come from llmrt.engine_args.add_engine_arguments)."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000,
                   help="port to listen on; 0 picks a free one, which the start-up line names (default: 8000)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients pass and /v1/models lists (default: the checkpoint directory's "
                        "name; stories260K for the embedded model)")
    g.add_argument("--tokenizer", default=None, help="a tokenizer directory other than the model's")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) instead of the model's")
    d = ServerConfig
    g.add_argument("--max-waiting-requests", type=int, default=default_of(d, "max_waiting_requests"),
                   help="refuse new requests with 429 + Retry-After while this many wait (default: unbounded)")
    g.add_argument("--max-queue-delay-ms", type=float, default=default_of(d, "max_queue_delay_ms"),
                   help="refuse new requests with 429 + Retry-After when the queue would delay them longer than "
                        "this, judged from the engine's recent drain rate (default: no limit)")
    g.add_argument("--health-step-timeout", type=float, default=default_of(d, "health_step_timeout"),
                   help="/health turns 503 when no engine step completes for this many seconds while requests "
                        "are pending (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=default_of(d, "request_timeout"),
                   help="seconds a request may take unless it sets its own `timeout`; past it: 408 "
                        "deadline_exceeded (default: none)")
    g.add_argument("--max-request-tokens", type=int, default=default_of(d, "max_request_tokens"),
                   help="refuse (400) a request whose prompts hold more tokens than this, all prompts together; "
                        "the body is also capped at 10 MiB (default: %(default)s)")
    g.add_argument("--tokenizer-threads", type=int, default=default_of(d, "tokenizer_threads"),
                   help="threads that tokenize prompts, render chat templates and check grammars, off the event "
                        "loop, so /health, /metrics and streams never wait for them (default: CPU cores - 1, at most 4; here "
                        "%(default)s)")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="how to read tool calls in a model's own output for tool_choice auto (default: the format "
                        "the chat template shows, if any; without one, auto is refused and required/named work)")
    g.add_argument("--enable-debug-endpoints", action="store_true",
                   help="serve GET /debug/stats and POST /debug/fault (fault injection: stall, slow, crash, oom); "
                        "for tests, never in production")
    g.add_argument("--model-version", default=None,
                   help="the version /version, /v1/models and /load report, which routers pin and canary by "
                        "(default: a short hash of the config, the weights' metadata and the llmrt version)")
    g.add_argument("--api-key", default=os.environ.get("LLMRT_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health (default: $LLMRT_API_KEY; "
                        "unset: no key)")
    g.add_argument("--admin-api-key", default=os.environ.get("LLMRT_ADMIN_API_KEY"),
                   help="the key of POST /admin/drain and /admin/resume; unset, the admin routes do not exist "
                        "(default: $LLMRT_ADMIN_API_KEY)")
    g.add_argument("--disable-access-log", action="store_true",
                   help="do not write the JSON access-log line per request (logger llmrt.access, to stderr; "
                        "successful polls of /metrics and /dashboard are never logged)")


def run_server(args: argparse.Namespace) -> int:
    """Start the engine and serve until interrupted; 0 on a clean stop."""
    setup_access_log(bool(getattr(args, "disable_access_log", False)))
    try:
        return asyncio.run(_serve(args))
    except KeyboardInterrupt:
        return 0


async def _serve(args: argparse.Namespace) -> int:
    from llmrt.engine_args import engine_kwargs
    from llmrt.config import EngineConfig
    from llmrt.engine.async_llm import AsyncLLM
    from llmrt.server.app import build_app

    # Bind first: a port in use is said at once, before seconds of model loading.
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    engine = None
    try:
        config = EngineConfig.create(args.model, served_model_name=args.served_model_name, **engine_kwargs(args))
        engine = AsyncLLM(config, tokenizer=args.tokenizer, chat_template=args.chat_template,
                          max_waiting_requests=args.max_waiting_requests, max_queue_delay_ms=args.max_queue_delay_ms,
                          health_step_timeout=args.health_step_timeout, default_timeout=args.request_timeout,
                          enable_fault_injection=args.enable_debug_endpoints)
        await engine.start()
        app = build_app(engine, args)
        app.state.timeline.start()  # the dashboard's history starts now, not when the page is first opened
        # What start-up made (torch, the tokenizer, the app) stays out of the collector's later full passes, which
        # run on the event loop: one stopped it 180-190 ms during a large request (longest probe now ~20 ms); its
        # garbage is collected first so that none of it is kept for good
        gc.collect()
        gc.freeze()
        await serve_on_socket(app, sock, "off", lambda port: _print_banner(args, engine, port))
        return 0
    finally:
        sock.close()
        if engine is not None:
            await engine.shutdown()


def _print_banner(args: argparse.Namespace, engine: Any, port: int) -> None:
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    name = args.served_model_name or engine.model_name
    body = json.dumps({"model": name, "prompt": "Once upon a time", "max_tokens": 32})
    print(f"llmrt serve: {name} (max_model_len {engine.max_model_len}) on {base}\n"
          f"  OpenAI API at {base}/v1 ({'Bearer --api-key' if getattr(args, 'api_key', None) else 'any api key'}), docs at {base}/docs\n"
          f"  try: curl {base}/v1/completions -H 'Content-Type: application/json' -d '{body}'", flush=True)
