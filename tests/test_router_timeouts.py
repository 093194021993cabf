"""The router's read timeout: a slow instance is not a dead one. Two stand-in instances (aiohttp servers on
loopback that answer /health, /load and /v1/models as `llmrt serve` does, and stall on generation) sit behind a
real router app; the client must get 504 `upstream_timeout`, the other instance must never see the request,
and neither instance may be counted as failing."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from aiohttp import web

from llmrt.router.app import RouterConfig, build_router_app
from llmrt.router.backends import HealthConfig


def _json_handler(obj: dict):
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(obj)
    return handler


class StallingInstance:
    """An instance that is healthy but takes `stall_s` to answer completions (after `events` SSE events)."""

    def __init__(self, stall_s: float, events: int = 0):
        self.stall_s, self.events, self.hits = stall_s, events, 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", _json_handler({"status": "ok"}))
        app.router.add_get("/load", _json_handler({"model_version": "v1", "draining": False, "running": 0,
                                                   "queued_prompt_tokens": 0}))
        app.router.add_get("/v1/models", _json_handler({"data": [{"id": "m"}]}))
        app.router.add_post("/v1/completions", self.complete)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        body = await request.json()
        if not body.get("stream"):
            if not self.events:  # stall before the response headers
                await asyncio.sleep(self.stall_s)
                return web.json_response({"choices": [{"text": "late"}]})
            resp = web.StreamResponse(headers={"content-type": "application/json"})  # headers, part of the body
            await resp.prepare(request)
            await resp.write(b'{"choices": ')
            await asyncio.sleep(self.stall_s)
            await resp.write(b'[{"text": "late"}]}')
            return resp
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.events):
            await resp.write(b'data: {"choices": [{"text": "t%d"}]}\n\n' % i)
        await asyncio.sleep(self.stall_s)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def _run(stream: bool, events: int) -> tuple[httpx.Response, list[StallingInstance], dict]:
    instances = [StallingInstance(stall_s=1.5, events=events) for _ in range(2)]
    for inst in instances:
        await inst.start()
    cfg = RouterConfig(backends=[i.url for i in instances], upstream_timeout=0.5, access_log=False,
                       health=HealthConfig(interval_s=30.0, eject_after=1))
    app = build_router_app(cfg)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=30) as c:
                r = await c.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": stream})
                await r.aread()
            router = app.state.router
            state = {"failures": [b.consecutive_failures for b in router.pool.backends],
                     "ejected": [b.ejected for b in router.pool.backends],
                     "metrics": router.metrics.render().decode()}
    finally:
        for inst in instances:
            await inst.stop()
    return r, instances, state


@pytest.mark.parametrize("events", [0, 1], ids=["before-headers", "mid-body"])
def test_a_read_timeout_is_a_504_not_retried_and_not_an_ejection(events):
    r, instances, state = asyncio.run(_run(stream=False, events=events))
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == "upstream_timeout" and r.json()["retryable"] is False
    assert sorted(i.hits for i in instances) == [0, 1]  # the other instance never saw it
    assert state["failures"] == [0, 0] and state["ejected"] == [False, False]
    assert 'kind="timeout"' in state["metrics"]


@pytest.mark.parametrize("events", [0, 2], ids=["before-first-event", "mid-stream"])
def test_a_stream_that_stalls_ends_with_one_timeout_event(events):
    r, instances, state = asyncio.run(_run(stream=True, events=events))
    if events == 0:  # nothing sent yet: the same 504 as a plain request, not a retry
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    else:
        assert r.status_code == 200
        lines = [ln for ln in r.text.split("\n\n") if ln.startswith("data: ")]
        assert lines[:2] == ['data: {"choices": [{"text": "t0"}]}', 'data: {"choices": [{"text": "t1"}]}']
        err = json.loads(lines[2][6:])
        assert err["error"]["code"] == "upstream_timeout" and lines[3] == "data: [DONE]"
    assert sorted(i.hits for i in instances) == [0, 1]
    assert state["failures"] == [0, 0] and state["ejected"] == [False, False]
