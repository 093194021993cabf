"""The observability routes: GET /metrics (Prometheus), GET /dashboard (a live page) and its data and assets."""
from __future__ import annotations

from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from llmrt.metrics.prometheus import CONTENT_TYPE, ServerMetrics
from llmrt.metrics.timeline import Timeline
from llmrt.server.state import ServerState

DASHBOARD_DIR = resources.files("llmrt") / "data" / "dashboard"


def install_observability(app: FastAPI, state: ServerState) -> tuple[ServerMetrics, Timeline]:
    """Create the server's metrics and dashboard timeline, feed them every finished request, add the routes."""
    engine = state.engine
    metrics = ServerMetrics(state.model_name, int(engine.max_model_len), lambda: dict(engine.stats()),
                            engine_pid=lambda: engine.stats().get("engine_pid"), device=engine.device)
    timeline = Timeline(lambda: dict(engine.stats()))
    state.observers += [metrics.observe_request, timeline.observe_request]
    app.state.metrics, app.state.timeline = metrics, timeline

    @app.get("/metrics", summary="Prometheus metrics (text format), names prefixed llmrt_",
             response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/dashboard", summary="A live dashboard of batch size, queues, KV cache, throughput and latency",
             response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        timeline.start()
        return HTMLResponse((DASHBOARD_DIR / "index.html").read_text(encoding="utf-8"))

    @app.get("/dashboard/data", summary="The dashboard's samples: one list per series, oldest first")
    async def dashboard_data() -> dict[str, Any]:
        timeline.start()
        return {"model": state.model_name, **timeline.columns()}

    app.mount("/dashboard/static", StaticFiles(directory=str(DASHBOARD_DIR)), name="dashboard-static")
    return metrics, timeline
