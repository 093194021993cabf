"""Structured output and tool calling through the official OpenAI SDK against a real `llmrt serve`."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pytest

from conftest import build_checkpoint
from server_utils import run_server

pytestmark = pytest.mark.slow

# A Hermes-style template: tools in the prompt, calls as <tool_call>, tool results as <tool_response>.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{% elif m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments }}}</tool_call>{% endfor %}"
    "{% else %}{{ m.role }}: {{ m.content }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]}}, "required": ["city", "days"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"],
               "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("structured-server")
    template = root / "hermes.jinja"
    template.write_text(TEMPLATE)
    # A random tiny Llama 3 (the embedded tokenizer) with room for the tool list in the prompt.
    model = build_checkpoint("llama3", root / "llama3", max_position_embeddings=2048)
    with run_server(model, "--chat-template", str(template), "--enable-debug-endpoints") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=120, max_retries=0)
        yield SimpleNamespace(base=base, client=client, model=client.models.list().data[0].id)


def _check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_arguments_always_validate(server):
    r = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, tools=TOOLS, n=16, temperature=1.0, seed=1, max_completion_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert len(r.choices) == 16
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _check_call(call)


def test_required_tool_choice_arguments_always_validate(server):
    r = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, tools=TOOLS, n=16, temperature=1.0, seed=2, max_completion_tokens=200,
        tool_choice="required", parallel_tool_calls=False)
    names = set()
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        _check_call(call)
        names.add(call.function.name)
    assert names == {"get_weather", "get_time"}  # the model picks; both are reachable


def _reassemble(stream):
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function:
                    call["name"] = tc.function.name or call["name"]
                    call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_streamed_tool_call_deltas_reassemble_into_the_same_call(server, tool_choice):
    kw = dict(model=server.model, messages=MESSAGES, tools=TOOLS, temperature=1.0, max_completion_tokens=200,
              tool_choice=tool_choice, parallel_tool_calls=False)
    for seed in (3, 4, 5):
        whole = server.client.chat.completions.create(seed=seed, **kw).choices[0]
        content, calls, finish = _reassemble(server.client.chat.completions.create(seed=seed, stream=True, **kw))
        assert finish == whole.finish_reason == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert all(c["id"] and c["id"].startswith("call_") for c in calls)


def test_auto_and_tool_results_through_the_template(server):
    # The template shows <tool_call>, so auto reads calls with the hermes parser; a random model writes noise,
    # which comes back as content, never as a broken call.
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny and 21 C"}]
    r = server.client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, max_completion_tokens=8,
                                              temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
    assert isinstance(choice.message.content, str)
    prompt = httpx.post(f"{server.base}/tokenize", json={"messages": messages}).json()["tokens"]
    detok = httpx.post(f"{server.base}/detokenize", json={"tokens": prompt}).json()["prompt"]
    assert "<tool_response>sunny and 21 C</tool_response>" in detok and '"days": 1}}</tool_call>' in detok


def test_response_format_and_structured_outputs(server):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {
        "type": "integer", "minimum": 0, "maximum": 10}}, "required": ["answer", "score"]}
    r = server.client.chat.completions.create(
        model=server.model, messages=MESSAGES, n=8, temperature=1.0, seed=6, max_completion_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    r = server.client.completions.create(model=server.model, prompt="Date:", n=8, temperature=1.0, seed=7,
                                         max_tokens=30, extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    assert all(re.fullmatch(r"\d{4}-\d{2}-\d{2}", c.text) for c in r.choices)
    stream = server.client.completions.create(model=server.model, prompt="Pick:", temperature=1.0, seed=8, max_tokens=10,
                                              stream=True, extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert "".join(c.choices[0].text for c in stream) in ("red", "blue")
    r = server.client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=1.0, seed=9,
                                              max_completion_tokens=60, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_grammar_that_does_not_compile_is_a_400_with_the_compiler_message(server):
    for extra, words in [({"structured_outputs": {"regex": "(abc"}}, "parenthesis"),
                         ({"structured_outputs": {"grammar": "root ::= missing"}}, "missing"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
                          "nope")]:
        with pytest.raises(openai.BadRequestError) as e:
            server.client.completions.create(model=server.model, prompt="x", max_tokens=4, extra_body=extra)
        err = e.value.body
        assert err["code"] == "invalid_request" and words in err["message"]
        assert err["param"] == next(iter(extra))
    assert server.client.completions.create(model=server.model, prompt="x", max_tokens=2).choices[0].text is not None
    assert httpx.get(f"{server.base}/health").status_code == 200
