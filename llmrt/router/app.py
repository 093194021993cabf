"""The router's ASGI app: the OpenAI API relayed to instances, plus its own /health, /metrics, /version,
/v1/models (the union of the backends' models) and admin routes (backends, canary, policy)."""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import llmrt
from llmrt.errors import InvalidRequestError
from llmrt.router.backends import BackendPool, HealthConfig
from llmrt.router.metrics import RouterMetrics
from llmrt.router.policies import make_policy
from llmrt.router.prompts import PrefixConfig
from llmrt.router.proxy import Router, upstream_session
from llmrt.router.retry import RetryBudget
from llmrt.router.versions import VersionRules, parse_canary
from llmrt.server.auth import ApiKeyMiddleware
from llmrt.server.errors import error_response, http_error
from llmrt.server.middleware import ServerMiddleware

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


@dataclass
class RouterConfig:
    """Everything `llmrt route` configures."""

    backends: list[str] = field(default_factory=list)
    policy: str = "round-robin"
    canary: dict[str, float] = field(default_factory=dict)
    health: HealthConfig = field(default_factory=HealthConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    load_factor: float = 1.25
    max_retries: int = 2
    retry_ratio: float = 0.2
    retry_min: int = 10
    upstream_timeout: float = 600.0
    api_key: Optional[str] = None  # what clients must send
    admin_api_key: Optional[str] = None  # the router's admin routes
    backend_api_key: Optional[str] = None  # what the router sends to instances
    access_log: bool = True
    # background tasks that change the pool while it serves (e.g. Ray replicas swapping a restarted actor's URL)
    watchers: list[Callable[[BackendPool], Awaitable[None]]] = field(default_factory=list)


def build_router_app(cfg: RouterConfig) -> Starlette:
    """The router app; its backends are checked once before it serves and every interval after."""
    pool = BackendPool(cfg.backends, cfg.health, api_key=cfg.backend_api_key)
    metrics = RouterMetrics(snapshot=lambda: [b.snapshot() for b in pool.backends])
    pool.on_eject = lambda b, reason: metrics.ejections.labels(b.name).inc()
    versions = VersionRules()
    versions.set_canary(cfg.canary)
    router = Router(pool=pool, policy=make_policy(cfg.policy, cfg.load_factor), versions=versions,
                    budget=RetryBudget(cfg.retry_ratio, cfg.retry_min), metrics=metrics,
                    prefix=cfg.prefix, max_retries=cfg.max_retries, backend_api_key=cfg.backend_api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # one pooled client for the relay and the health checks (those set their own short timeouts)
        router.client = pool.client = upstream_session(cfg.upstream_timeout)
        await pool.check_all()
        pool.start()
        tasks = [asyncio.create_task(w(pool)) for w in cfg.watchers]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await pool.stop()
            await router.client.close()

    async def health(request: Request) -> Response:
        n = len(pool.available())
        body = {"status": "ok" if n else "unhealthy", "available_backends": n, "backends": len(pool.backends)}
        return JSONResponse(body, status_code=200 if n else 503)

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(request: Request) -> Response:
        cards: dict[str, dict[str, Any]] = {}
        for b in pool.backends:
            if not b.healthy:
                continue
            for card in b.models:
                merged = cards.setdefault(card.get("id"), {**card, "model_versions": [], "instances": 0})
                merged["instances"] += 1
                if b.version and b.version not in merged["model_versions"]:
                    merged["model_versions"].append(b.version)
        for card in cards.values():
            card["model_versions"].sort()
            card["model_version"] = card["model_versions"][0] if len(card["model_versions"]) == 1 else None
        return JSONResponse({"object": "list", "data": list(cards.values())})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": llmrt.__version__, "router": True,
                             "model_versions": sorted({b.version for b in pool.backends if b.version})})

    async def admin_backends(request: Request) -> Response:
        if request.method in ("POST", "DELETE"):
            url = (await _json_body(request)).get("url")
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                return error_response(InvalidRequestError("url: expected an http(s) URL", param="url"))
            if request.method == "POST":
                await pool.check(pool.add(url))
            elif not pool.remove(url):
                return error_response(InvalidRequestError(f"no backend {url}", param="url"))
        return JSONResponse({"policy": cfg.policy, "canary": versions.canary,
                             "backends": [b.snapshot() for b in pool.backends],
                             "retry_budget_exhausted": router.budget.exhausted})

    async def admin_canary(request: Request) -> Response:
        body = await _json_body(request)
        canary = body.get("canary")
        try:
            if not isinstance(canary, dict):
                raise ValueError('expected {"canary": {"VERSION": SHARE, ...}}')
            versions.set_canary(parse_canary([f"{k}={v}" for k, v in canary.items()]))
        except ValueError as e:
            return error_response(InvalidRequestError(f"canary: {e}", param="canary"))
        return JSONResponse({"canary": versions.canary})

    async def admin_policy(request: Request) -> Response:
        name = (await _json_body(request)).get("policy")
        try:
            router.policy = make_policy(str(name), cfg.load_factor)
        except ValueError as e:
            return error_response(InvalidRequestError(str(e), param="policy"))
        cfg.policy = router.policy.name
        return JSONResponse({"policy": cfg.policy})

    async def admin_not_found(request: Request) -> Response:  # instances' admin routes are not reachable here
        return JSONResponse(http_error(404, None, request.method, request.url.path), status_code=404)

    routes = [Route("/health", health, methods=["GET"]), Route("/metrics", metrics_route, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]), Route("/version", version, methods=["GET"]),
              Route("/admin/backends", admin_backends, methods=["GET", "POST", "DELETE"]),
              Route("/admin/canary", admin_canary, methods=["PUT"]),
              Route("/admin/policy", admin_policy, methods=["PUT"]),
              Route("/admin/{path:path}", admin_not_found, methods=_METHODS)]  # the rest: RelayFirst
    app = Starlette(routes=routes, lifespan=lifespan)
    app.add_middleware(RelayFirst, router=router)  # innermost: inside the API-key check and the access record
    app.add_middleware(ApiKeyMiddleware, api_key=cfg.api_key, admin_api_key=cfg.admin_api_key)
    app.add_middleware(ServerMiddleware, access_log=cfg.access_log)
    app.state.router = router
    return app


_OWN_PATHS = frozenset({"/health", "/metrics", "/v1/models", "/version"})


class RelayFirst:
    """Relayed requests go straight to the proxy, past Starlette's exception layer and route matching (about a
    fifth of the router's CPU per relayed request); the router's own routes, /admin/* and lifespan go on to the
    app. Errors in the relay still reach the server middleware's last-resort 500."""

    def __init__(self, app: ASGIApp, router: Router):
        self.app, self.router = app, router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in _OWN_PATHS or path.startswith("/admin/"):
            await self.app(scope, receive, send)
            return
        response = await self.router.forward(Request(scope, receive))
        await response(scope, receive, send)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}
