"""What an instance tells a router: GET /load, POST /admin/drain and /admin/resume, and its model version."""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

import llmrt

_HEADER_LIMIT = 100 * 1024 * 1024  # a safetensors JSON header bigger than this is not one


class LoadResponse(BaseModel):
    """GET /load: the figures a router balances on (cheap: the latest engine snapshot, no engine round trip)."""

    running: int
    waiting: int
    queued_prompt_tokens: int
    in_flight: int  # API requests this server is answering (queued, running, or not yet acknowledged)
    kv_usage: float
    drain_tokens_per_s: float
    draining: bool
    model_version: str


class DrainResponse(BaseModel):
    """POST /admin/drain and /admin/resume."""

    draining: bool
    in_flight: int


def model_version(model_dir: str) -> str:
    """A short hash of the config, the weights' metadata (file names, sizes, safetensors headers) and llmrt's
    version: two instances agree on it exactly when they serve the same weights with the same code."""
    root = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        path = root / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        h.update(path.name.encode() + b"\0" + str(path.stat().st_size).encode())
        h.update(_safetensors_header(path))
    h.update(llmrt.__version__.encode())
    return f"{h.hexdigest()[:12]}-llmrt{llmrt.__version__}"


def _safetensors_header(path: Path) -> bytes:
    """The JSON header (tensor names, dtypes, shapes, offsets): the weights' metadata, read without the data."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return b""
        (size,) = struct.unpack("<Q", raw)
        return f.read(size) if size <= _HEADER_LIMIT else raw


def install_instance_routes(app: FastAPI, state: Any, args: Any = None) -> str:
    """Add /load, and the admin drain routes when an admin key is set (the API-key middleware guards them);
    store and return the model version (`--model-version`, default model_version() of the checkpoint)."""
    engine = state.engine
    version = getattr(args, "model_version", None) or model_version(_model_dir(engine))
    app.state.model_version = version

    @app.get("/load", response_model=LoadResponse, summary="Load figures for routers (cheap, no engine round trip)")
    async def load() -> LoadResponse:
        st = engine.stats()
        return LoadResponse(running=int(st["num_running"]), waiting=int(st["num_waiting"]),
                            queued_prompt_tokens=int(st["waiting_tokens"]), in_flight=int(st["num_streams"]),
                            kv_usage=round(float(st["kv_usage"]), 4),
                            drain_tokens_per_s=round(float(st["drain_tokens_per_s"]), 1),
                            draining=engine.admission.draining, model_version=version)

    if not getattr(args, "admin_api_key", None):
        return version  # no admin key: the admin routes do not exist (nor in the OpenAPI schema)

    @app.post("/admin/drain", response_model=DrainResponse,
              summary="Stop admitting requests (new ones get 503 draining); admitted ones finish (admin key)")
    async def drain() -> DrainResponse:
        engine.admission.draining = True
        return DrainResponse(draining=True, in_flight=int(engine.stats()["num_streams"]))

    @app.post("/admin/resume", response_model=DrainResponse, summary="Admit requests again after a drain (admin key)")
    async def resume() -> DrainResponse:
        engine.admission.draining = False
        return DrainResponse(draining=False, in_flight=int(engine.stats()["num_streams"]))

    return version


def _model_dir(engine: Any) -> str:
    config = getattr(engine, "config", None)
    return str(getattr(getattr(config, "model", None), "model", "") or "")
