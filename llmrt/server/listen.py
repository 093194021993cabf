"""Serving an ASGI app with uvicorn on a socket we bind ourselves (TCP_NODELAY set), and the JSON access log:
shared by `llmrt serve` and `llmrt route`. Light on purpose: the router imports it, and must not import torch."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from typing import Any, Callable, Iterator


async def serve_on_socket(app: Any, sock: socket.socket, lifespan: str, on_started: Callable[[int], None]) -> None:
    """Serve `app` with uvicorn on a bound socket until SIGINT/SIGTERM; `on_started(port)` once it listens."""
    import uvicorn

    server = _uvicorn_server(uvicorn.Config(app, access_log=False, log_config=None, lifespan=lifespan,
                                            timeout_graceful_shutdown=5,
                                            log_level=logging.getLogger().getEffectiveLevel()))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        on_started(sock.getsockname()[1])
    await task


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit this: without it a response written as headers + body waits ~40 ms for
        # the client's delayed ACK on every keep-alive request (Nagle), a floor under /health and every hop.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _uvicorn_server(config: Any) -> Any:
    """A uvicorn.Server that stops on SIGINT/SIGTERM without re-raising the signal afterwards (so that the
    engine is shut down and the exit code is 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)


def setup_access_log(disabled: bool) -> None:
    """JSON access-log lines (logger `llmrt.access`) to stderr, or none; shared by `serve` and `route`."""
    access = logging.getLogger("llmrt.access")
    if disabled:
        access.disabled = True
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False
