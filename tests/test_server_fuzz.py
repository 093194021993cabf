"""A fuzz suite over the server's own OpenAPI schema (hypothesis strategies built from it, seeded, bounded):
no response is a 5xx, every error body is OpenAI's shape with `retryable`, and a real engine stays healthy
with every KV block free afterwards."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmrt.server.app import build_app
from server_utils import all_blocks_free, run_server, wait_until
from test_server_app import FakeEngine

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
SETTINGS = dict(derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

_STRINGS = st.one_of(st.text(max_size=12), st.sampled_from(
    ["Once upon a time", "Lily", "", "\ud800", "a\udfffb", "\U0001F642", "\x00", "x" * 300, "<s>", "{{ 7*7 }}"]))
_INTS = st.one_of(st.integers(-3, 40), st.sampled_from([-1, 0, 1, 511, 512, 2**31, 2**63, -(2**63), 10**30]))
_FLOATS = st.one_of(st.floats(-3, 3), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0]))
_ANY_JSON = st.recursive(st.one_of(st.none(), st.booleans(), _INTS, _FLOATS, _STRINGS),
                         lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                 st.dictionaries(_STRINGS, inner, max_size=3)), max_leaves=8)

_WORDS = st.lists(st.sampled_from(["Once", "upon", "a", "time", "Lily", "park", "\U0001F642", "\n"]), min_size=1,
                  max_size=12).map(" ".join)
_IDS = st.lists(st.integers(0, 511), min_size=1, max_size=20)
# Fields where a schema-derived value is almost always refused: mostly a typical value, so that requests get
# past them to the tokenizer, the template, the grammar and the engine.
_TYPICAL = {"model": st.none(), "prompt": st.one_of(_WORDS, _IDS, st.lists(_WORDS, min_size=1, max_size=3),
                                                      st.lists(_IDS, min_size=1, max_size=3)),
            "content": _WORDS, "text": _WORDS, "tokens": _IDS, "max_tokens": st.integers(1, 24),
            "max_completion_tokens": st.integers(1, 24)}


def _from_schema(schema: dict[str, Any], comps: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
    """Values of a JSON schema (OpenAPI's dialect), mostly valid, now and then hostile."""
    if depth > 6:
        return _ANY_JSON
    if "$ref" in schema:
        target = comps[schema["$ref"].rsplit("/", 1)[-1]]
        return st.deferred(lambda: _from_schema(target, comps, depth + 1))
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([_from_schema(s, comps, depth + 1) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        if not props:
            return st.dictionaries(_STRINGS, _ANY_JSON, max_size=3)
        fields = {k: _hostile(_from_schema(v, comps, depth + 1)) for k, v in props.items()}
        for k in set(fields) & set(_TYPICAL):
            fields[k] = _now_and_then(_TYPICAL[k], fields[k], 4)
        optional = sorted(k for k in props if k not in required)
        # A few optional fields at a time: a body with every field set fails on one of them and tests little.
        return _objects(fields, [k for k in props if k in required], optional)
    if kind == "array":
        low = schema.get("minItems", 0)
        return st.lists(_from_schema(schema.get("items", {}), comps, depth + 1), min_size=low, max_size=low + 3)
    return {"string": _STRINGS, "integer": _INTS, "number": _FLOATS, "boolean": st.booleans(),
            "null": st.none()}.get(kind, _ANY_JSON)


@st.composite
def _objects(draw: Any, fields: dict[str, st.SearchStrategy], required: list[str], optional: list[str]) -> dict:
    chosen = draw(st.lists(st.sampled_from(optional), max_size=3, unique=True)) if optional else []
    return {k: draw(fields[k]) for k in required + chosen}


def _now_and_then(values: st.SearchStrategy, other: st.SearchStrategy, one_in: int) -> st.SearchStrategy:
    """`values`, but about one time in `one_in` a value of `other`."""
    return st.tuples(st.sampled_from(range(one_in)), values, other).map(lambda t: t[2] if t[0] == one_in - 1
                                                                         else t[1])


def _hostile(values: st.SearchStrategy) -> st.SearchStrategy:
    return _now_and_then(values, _ANY_JSON, 10)  # about one field in ten: anything


def _bodies(app_schema: dict[str, Any], path: str) -> st.SearchStrategy:
    comps = app_schema["components"]["schemas"]
    ref = app_schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return _now_and_then(_from_schema(ref, comps), _ANY_JSON, 10)  # and now and then not an object at all


def check_response(status: int, content_type: str, text: str) -> None:
    """No 5xx; errors in OpenAI's shape with `retryable` in both places; streams well-formed."""
    assert status < 500, (status, text[:500])
    if status >= 400:
        body = json.loads(text)
        assert set(body) == {"error", "retryable"}, body
        err = body["error"]
        assert {"message", "type", "param", "code", "retryable"} <= set(err), body
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["code"], str)
        assert err["retryable"] is body["retryable"] and isinstance(body["retryable"], bool)
        assert err["param"] is None or isinstance(err["param"], str)
    elif content_type.startswith("text/event-stream"):
        events = [e[len("data: "):] for e in text.split("\n\n") if e.strip()]
        assert events and events[-1] == "[DONE]", text[-300:]
        for event in events[:-1]:
            data = json.loads(event)
            if "error" in data:
                assert data["error"]["code"] != "internal_error" and "retryable" in data["error"], data
    else:
        json.loads(text)


# -- in process, over the scripted engine: many examples, fast ---------------------------------------------------
@pytest.fixture(scope="module")
def fake_client():
    app = build_app(FakeEngine(), SimpleNamespace(enable_debug_endpoints=True))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c, app.openapi()


@pytest.mark.parametrize("path", ROUTES)
def test_fuzz_in_process(fake_client, path):
    client, schema = fake_client

    @settings(max_examples=100, **SETTINGS)
    @given(body=_bodies(schema, path))
    def run(body: Any) -> None:
        r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        check_response(r.status_code, r.headers.get("content-type", ""), r.text)

    run()


# -- against a real server and engine: fewer examples, then the engine must be healthy and leak nothing ---------
@pytest.fixture(scope="module")
def real_server():
    with run_server(None, "--enable-debug-endpoints", "--max-num-seqs", "4", "--max-model-len", "128",
                    "--disable-access-log") as url:
        with httpx.Client(base_url=str(url), timeout=60.0) as c:
            yield c


def _short(body: Any) -> Any:
    """At most 3 new tokens per sample where the body asks for more (or leaves it to the context): a 2-core
    machine under load generates a few tokens per second."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is None or (isinstance(value, int) and not isinstance(value, bool) and 3 < value < 2**31):
                body[key] = 3
    return body


@pytest.mark.slow
def test_fuzz_real_engine(real_server):
    client = real_server
    schema = client.get("/openapi.json").json()
    for path in ROUTES:
        @settings(max_examples=20, **SETTINGS)
        @given(body=_bodies(schema, path).map(_short))
        def run(body: Any) -> None:
            r = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            check_response(r.status_code, r.headers.get("content-type", ""), r.text)

        run()
    assert client.get("/health").status_code == 200
    assert wait_until(lambda: all_blocks_free(str(client.base_url)), timeout=30), client.get("/debug/stats").json()
    ok = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
