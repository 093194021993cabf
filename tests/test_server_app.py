"""The HTTP layer in-process over a scripted fake engine: protocol shapes, SSE deltas, the error mapping."""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace
from typing import Any, Optional

import pytest
from fastapi.testclient import TestClient

from llmrt.engine.output_processor import OutputProcessor
from llmrt.engine.messages import EngineCoreOutput
from llmrt.errors import (CapacityExceededError, ContextLengthExceededError, EngineDeadError, InvalidRequestError,
                          LLMRTError)
from llmrt.sampling_params import SamplingParams
from llmrt.server.app import build_app
from llmrt.tokenizer import load_tokenizer

from llmrt.config import DEFAULT_MODEL_DIR as EMBEDDED

SCRIPT = " One day, a little girl named Lily went to the park. She saw a big tree and she was happy."


class FakeEngine:
    """An EngineClient; every sample 'generates' the tokens of SCRIPT, through the real OutputProcessor."""

    device = "cpu"

    def __init__(self) -> None:
        self.tokenizer = load_tokenizer(str(EMBEDDED))
        self.model_name = "fake-model"
        self.max_model_len = 256
        self.script = self.tokenizer.encode(SCRIPT, add_special_tokens=False)
        self.admission_error: Optional[LLMRTError] = None
        self.fail_after: Optional[tuple[int, LLMRTError]] = None  # (outputs yielded, then raise this)
        self.healthy = (True, "ok")
        self.calls: list[dict[str, Any]] = []
        self.closed: list[str] = []
        self.faults: list[tuple[str, float]] = []
        self.hang = False  # never produce an output, like a stalled engine core

    async def generate(self, prompt, params: SamplingParams, request_id: str, *, priority: int = 0,
                       timeout: Optional[float] = None, user: Optional[str] = None, stream: bool = True):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if any(not 0 <= t < self.tokenizer.vocab_size for t in ids):
            raise InvalidRequestError("token id out of the vocabulary", param="prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ContextLengthExceededError("too long", param="max_tokens")
        if self.admission_error is not None:
            raise self.admission_error
        self.calls.append({"prompt": ids, "params": params, "id": request_id, "priority": priority,
                           "timeout": timeout, "user": user, "stream": stream})
        proc = OutputProcessor(self.tokenizer)
        state = proc.add_request(request_id, prompt if isinstance(prompt, str) else None, ids, params,
                                 time.monotonic())
        finished = False
        try:
            if self.hang:
                await asyncio.sleep(3600)
            for step in range(max_tokens):
                await asyncio.sleep(0)
                if self.fail_after is not None and step == self.fail_after[0]:
                    raise self.fail_after[1]
                tok = self.script[step % len(self.script)]
                alt = (tok + 1) % self.tokenizer.vocab_size
                outs = [EngineCoreOutput(request_id, s.index, [tok],
                                         new_logprobs=[{tok: -0.25, alt: -2.0}] if params.logprobs is not None else None,
                                         finish_reason="length" if step == max_tokens - 1 else None)
                        for s in state.samples if s.finish_reason is None]
                proc.process(outs)
                finished = state.finished
                if stream or finished:
                    yield state.to_output()
                if finished:
                    return
        finally:
            if not finished:
                self.closed.append(request_id)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    async def abort(self, request_id: str) -> None:
        self.closed.append(request_id)

    def health(self):
        return self.healthy

    def stats(self):
        return {"num_running": 0, "kv_blocks_total": 10, "kv_blocks_free": 10}

    async def inject_fault(self, kind: str, seconds: float = 0.0) -> None:
        self.faults.append((kind, seconds))


@pytest.fixture()
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture()
def client(engine) -> TestClient:
    args = SimpleNamespace(served_model_name=None, model=None, enable_debug_endpoints=True)
    with TestClient(build_app(engine, args), raise_server_exceptions=False) as c:
        yield c


def _events(resp) -> list[Any]:
    out = []
    for line in resp.text.split("\n\n"):
        if not line.strip():
            continue
        assert line.startswith("data: ")
        payload = line[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def _script_text(engine: FakeEngine, n_tokens: int, prompt: Any = "Hi") -> str:
    """What the engine's detokenizer makes of the first n script tokens after `prompt`."""
    tok = engine.tokenizer
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return tok.decode(ids + engine.script[:n_tokens])[len(tok.decode(ids)):]


def _assert_error(resp, status: int, code: str, param: Optional[str], retryable: bool = False) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error", "retryable"}
    assert body["error"]["code"] == code and body["error"]["param"] == param, body
    assert body["retryable"] is retryable and body["error"]["message"] and body["error"]["type"]
    return body


def test_the_fake_and_the_real_engine_are_engine_clients(engine):
    from llmrt.config import EngineConfig
    from llmrt.engine.async_llm import AsyncLLM
    from llmrt.server.engine_client import EngineClient

    assert isinstance(engine, EngineClient)
    real = AsyncLLM(EngineConfig.create(None, dtype="float32"))  # not started: no engine-core process
    assert isinstance(real, EngineClient)
    assert real.vocab_size == real.tokenizer.vocab_size and real.device == "cpu"
    assert not isinstance(object(), EngineClient)


# -- shapes ------------------------------------------------------------------------------------------------
def test_completion_shape_and_usage(client, engine):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "Hello there", "max_tokens": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "fake-model"
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["text"] == _script_text(engine, 7, "Hello there")
    n_prompt = len(engine.tokenizer.encode("Hello there"))
    assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 7, "total_tokens": n_prompt + 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert r.headers["x-request-id"]
    assert engine.calls[-1]["stream"] is False  # a plain response asks the engine for the finished output only


def test_several_prompts_and_n(client, engine):
    r = client.post("/v1/completions", json={"prompt": [[1, 40], [1, 50, 60], [7]], "n": 2, "max_tokens": 3})
    body = r.json()
    assert client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 3}).json()["usage"][
        "completion_tokens"] == 6
    assert client.post("/v1/completions", json={"prompt": ["a", [1, 2]]}).status_code == 400
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert body["usage"]["completion_tokens"] == 18
    assert body["usage"]["prompt_tokens"] == 6
    assert len({c["id"] for c in engine.calls[:3]}) == 3


def test_sampling_fields_reach_the_engine(client, engine):
    r = client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": ["zz"],
        "presence_penalty": 0.1, "frequency_penalty": 0.2, "logit_bias": {"42": 5}, "top_k": 3, "min_p": 0.1,
        "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True, "priority": 2, "timeout": 9.5, "user": "u"})
    assert r.status_code == 200, r.text
    call = engine.calls[0]
    p: SamplingParams = call["params"]
    assert (p.temperature, p.top_p, p.seed, p.stop, p.top_k, p.min_p) == (0.5, 0.9, 7, ["zz"], 3, 0.1)
    assert p.logit_bias == {42: 5.0} and p.ignore_eos and p.min_tokens == 1 and p.repetition_penalty == 1.1
    assert (call["priority"], call["timeout"], call["user"]) == (2, 9.5, "u")


def test_echo_and_legacy_logprobs(client, engine):
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "echo": True, "logprobs": 1})
    choice = r.json()["choices"][0]
    assert choice["text"] == "Hi" + _script_text(engine, 3)
    lp = choice["logprobs"]
    n_prompt = len(engine.tokenizer.encode("Hi"))
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n_prompt + 3
    assert lp["token_logprobs"][:n_prompt] == [None] * n_prompt and lp["token_logprobs"][n_prompt:] == [-0.25] * 3
    assert lp["text_offset"][n_prompt] == 2
    assert "".join(lp["tokens"][n_prompt:]) == _script_text(engine, 3)
    assert all(len(t) == 2 for t in lp["top_logprobs"][n_prompt:])


def test_chat_shape_and_logprobs(client, engine):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Tell"}, {"type": "text", "text": "a story"}]}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 5,
                                                  "logprobs": True, "top_logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": _script_text(engine, 5, engine.calls[0]["prompt"])}
    content = choice["logprobs"]["content"]
    assert len(content) == 5 and all(len(c["top_logprobs"]) == 1 and c["logprob"] == -0.25 for c in content)
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    expected = engine.tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "Tell\na story"}])
    assert engine.calls[0]["prompt"] == expected and body["usage"]["prompt_tokens"] == len(expected)


# -- streaming ---------------------------------------------------------------------------------------------
def test_completion_stream_deltas_add_up(client, engine):
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 12, "stream": True, "n": 2,
                                             "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(c["stream"] for c in engine.calls)
    events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 24
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == _script_text(engine, 12)
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])


@pytest.mark.parametrize("stop", ["girl named", "park. She", "y"])
def test_stream_holds_back_text_a_stop_string_cuts(client, stop):
    req = {"prompt": "Hi", "max_tokens": 40, "stop": [stop]}
    full = client.post("/v1/completions", json=req).json()["choices"][0]
    assert full["finish_reason"] == "stop" and stop not in full["text"]
    events = _events(client.post("/v1/completions", json={**req, "stream": True}))
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text == full["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_chat_stream_role_first_then_content(client, engine):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 6, "stream": True})
    events = _events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:]) == \
        _script_text(engine, 6, engine.calls[0]["prompt"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]


def test_mid_stream_error_is_one_event_then_done(client, engine):
    engine.fail_after = (3, EngineDeadError("the engine core process died"))
    events = _events(client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "stream": True}))
    assert events[-1] == "[DONE]"
    err = events[-2]
    assert err["error"]["code"] == "engine_dead" and err["retryable"] is True


def test_error_before_the_first_output_is_an_http_status(client, engine):
    engine.admission_error = CapacityExceededError("queue full", retry_after=1.2)
    for stream in (False, True):
        r = client.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
        _assert_error(r, 429, "capacity_exceeded", None, retryable=True)
        assert r.headers["retry-after"] == "2"


def test_server_enforces_the_timeout_when_the_engine_hangs(client, engine):
    engine.hang = True
    for stream in (False, True):
        start = time.monotonic()
        r = client.post("/v1/completions", json={"prompt": "Hi", "timeout": 0.2, "stream": stream})
        _assert_error(r, 408, "deadline_exceeded", None, retryable=True)
        assert time.monotonic() - start < 2
    assert len(engine.closed) == 2  # both engine requests were closed (which aborts them)


# -- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param,code", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_request"),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens", "context_length_exceeded"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "invalid_request"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "invalid_request"),
    ({"prompt": "x", "temperature": 2.5}, "temperature", "invalid_request"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "invalid_request"),
    ({"prompt": "x", "n": 0}, "n", "invalid_request"),
    ({"prompt": "x", "top_p": 0}, "top_p", "invalid_request"),
    ({"prompt": "x", "logprobs": 21}, "logprobs", "invalid_request"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "invalid_request"),
    ({"prompt": "x", "stop": [""]}, "stop", "invalid_request"),
    ({"prompt": "x", "timeout": 0}, "timeout", "invalid_request"),
    ({"prompt": ""}, "prompt", "invalid_request"),
    ({"prompt": []}, "prompt", "invalid_request"),
    ({"prompt": [1, 2, 99999]}, "prompt", "invalid_request"),
    ({"prompt": [1, 2, "x"]}, "prompt", "invalid_request"),
    ({"prompt": {"a": 1}}, "prompt", "invalid_request"),
    ({"max_tokens": 5}, "prompt", "invalid_request"),
    ({"prompt": "x", "suffix": "end"}, "suffix", "unsupported"),
    ({"prompt": "x", "best_of": 3}, "best_of", "unsupported"),
    ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options", "invalid_request"),
])
def test_bad_completion_requests(client, body, param, code):
    _assert_error(client.post("/v1/completions", json=body), 400, code, param)


@pytest.mark.parametrize("body,param,code", [
    ({"messages": []}, "messages", "invalid_request"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "invalid_request"),
    ({"messages": [{"content": "x"}]}, "messages", "invalid_request"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "invalid_request"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "unsupported"),
    ({"messages": "hello"}, "messages", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens",
     "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema",
                                                                          "json_schema": {"name": "x"}}},
     "response_format", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice", "invalid_request"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": [{"type": "function", "function": {"name": "g"}}]}, "tool_choice", "invalid_request"),
    # auto needs a parser: the embedded chat template shows no tool-call format and no --tool-call-parser is set
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "g"}}]},
     "tool_choice", "unsupported"),
])
def test_bad_chat_requests(client, body, param, code):
    _assert_error(client.post("/v1/chat/completions", json=body), 400, code, param)


def test_malformed_and_missing_bodies(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x", ', headers={"content-type": "application/json"})
    body = _assert_error(r, 400, "invalid_request", None)
    assert "JSON" in body["error"]["message"]
    _assert_error(client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                  400, "invalid_request", None)
    _assert_error(client.post("/v1/completions"), 400, "invalid_request", None)


def test_unknown_model_and_route(client):
    _assert_error(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model_not_found",
                  "model")
    _assert_error(client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": [
        {"role": "user", "content": "x"}]}), 404, "model_not_found", "model")
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert client.get("/v1/completions").status_code == 405


def test_body_over_10_mb_is_refused(client, engine):
    big = json.dumps({"prompt": "a" * (10 * 1024 * 1024 + 10)})
    body = _assert_error(client.post("/v1/completions", content=big, headers={"content-type": "application/json"}),
                         400, "invalid_request", None)
    assert "limit" in body["error"]["message"]

    def chunks():  # no Content-Length: the cap applies while reading
        for _ in range(11):
            yield b"x" * (1024 * 1024)
    _assert_error(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
                  400, "invalid_request", None)
    assert not engine.calls


def test_unexpected_exception_is_a_500_and_the_server_goes_on(client, engine, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("kaput")
    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", boom)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    _assert_error(r, 500, "internal_error", None)
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


# -- the other routes ---------------------------------------------------------------------------------------
def test_models_tokenize_detokenize_version(client, engine):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    r = client.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == engine.tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    msgs = [{"role": "user", "content": "Hello"}]
    assert client.post("/tokenize", json={"messages": msgs}).json()["tokens"] == \
        engine.tokenizer.apply_chat_template(msgs)
    _assert_error(client.post("/tokenize", json={}), 400, "invalid_request", "prompt")
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    _assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400, "invalid_request", "tokens")
    assert client.get("/version").json()["version"]


def test_health_and_debug_routes(client, engine):
    assert client.get("/health").json() == {"status": "ok"}
    engine.healthy = (False, "no engine step for 3 s")
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["reason"] == "no engine step for 3 s"
    assert client.get("/debug/stats").json()["kv_blocks_free"] == 10
    assert client.post("/debug/fault", json={"kind": "stall", "seconds": 2}).status_code == 200
    assert engine.faults == [("stall", 2.0)]
    _assert_error(client.post("/debug/fault", json={"kind": "meteor"}), 400, "invalid_request", "kind")


def test_debug_routes_are_off_by_default(engine):
    with TestClient(build_app(engine, SimpleNamespace())) as c:
        assert c.get("/debug/stats").status_code == 404
        assert c.post("/debug/fault", json={"kind": "crash"}).status_code == 404


def test_served_model_name_and_aliases(engine):
    args = SimpleNamespace(served_model_name="my-model", model="/some/dir")
    with TestClient(build_app(engine, args)) as c:
        assert c.get("/v1/models").json()["data"][0]["id"] == "my-model"
        for name in ("my-model", "fake-model", "/some/dir"):
            r = c.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "my-model"


def test_openapi_schema_is_accurate(client):
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health",
                 "/version"):
        assert path in paths
    op = paths["/v1/chat/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert "422" not in op["responses"] and "429" in op["responses"]
    assert "text/event-stream" in op["responses"]["200"]["content"]
    comps = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionResponse", "ChatCompletionStreamResponse",
                 "CompletionStreamResponse", "ErrorResponse", "StreamErrorEvent"):
        assert name in comps
    assert "HTTPValidationError" not in comps
    refs = set()

    def walk(x):
        if isinstance(x, dict):
            if "$ref" in x:
                refs.add(x["$ref"].rsplit("/", 1)[-1])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(schema)
    assert refs <= set(comps), refs - set(comps)


def test_access_log_line(client, caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="llmrt.access"):
        client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        client.post("/v1/completions", json={"prompt": "Hi", "n": 0})
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "llmrt.access"]
    ok, bad = lines[-2], lines[-1]
    assert ok["status"] == 200 and ok["endpoint"] == "/v1/completions" and ok["completion_tokens"] == 3
    assert ok["response_id"].startswith("cmpl-") and ok["prompt_tokens"] > 0
    assert {"queue_time", "ttft", "tpot", "e2e"} <= set(ok["metrics"])
    assert bad["status"] == 400 and bad["error"] == "invalid_request"
