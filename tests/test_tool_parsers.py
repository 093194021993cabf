"""Tool-call parsers on hand-written model outputs, tool plans, and streamed tool-call deltas."""
from __future__ import annotations

import json

import pytest

from llmrt.errors import InvalidRequestError, UnsupportedError
from llmrt.structured.tool_parsers import (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                           detect_tool_parser, get_tool_parser)
from llmrt.structured.tools import ToolCallStream, plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_hermes():
    p = HermesToolParser()
    out = p.parse('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                  '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert out.content == "Let me check." and _calls(out) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    out = p.parse('<tool_call>{"name": "get_time", "arguments": {}}')  # EOS before the closing tag
    assert out.content is None and _calls(out) == [("get_time", {})]
    assert p.parse("just words").content == "just words"
    for bad in ['<tool_call>{"name": "get_time", "arguments": {</tool_call>',  # broken JSON
                '<tool_call>{"arguments": {}}</tool_call>',  # no name
                '<tool_call>{"name": "f", "arguments": 3}</tool_call>',  # arguments not an object
                '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then more text',
                "<tool_call>"]:
        out = p.parse(bad)
        assert out.calls == [] and out.content == bad


def test_llama3_json():
    p = Llama3JsonToolParser()
    out = p.parse('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                  '{"name": "get_time", "parameters": {}}')
    assert out.content is None and _calls(out) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    out = p.parse(' {"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}')  # arguments as a JSON string
    assert _calls(out) == [("get_time", {"tz": "UTC"})]
    for bad in ['The answer is {"name": "x"}', '{"name": "get_time", "parameters": {}', '{"city": "Oslo"}',
                '{"name": "get_time", "parameters": {}} trailing', ""]:
        out = p.parse(bad)
        assert out.calls == [] and out.content == bad


def test_mistral():
    p = MistralToolParser()
    out = p.parse('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                  '{"name": "get_time", "arguments": {}}]')
    assert out.content is None and _calls(out) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    out = p.parse('Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}')  # the newer format
    assert out.content == "Sure." and _calls(out) == [("get_weather", {"city": "Rome"})]
    out = p.parse('[{"name": "get_time", "arguments": {}}]')  # [TOOL_CALLS] dropped as a special token
    assert _calls(out) == [("get_time", {})]
    for bad in ['[TOOL_CALLS][{"name": "get_time", "arguments": {}}', "[TOOL_CALLS]nonsense",
                '[TOOL_CALLS][{"arguments": {}}]', '[{"name": 1}]', "no calls here"]:
        out = p.parse(bad)
        assert out.calls == [] and out.content == bad


def test_parser_choice():
    assert isinstance(detect_tool_parser("{% if tools %}<tool_call>{% endif %}"), HermesToolParser)
    assert isinstance(detect_tool_parser("[TOOL_CALLS]"), MistralToolParser)
    assert isinstance(detect_tool_parser("<|start_header_id|>ipython"), Llama3JsonToolParser)
    assert detect_tool_parser("{{ messages }}") is None and detect_tool_parser(None) is None
    assert isinstance(get_tool_parser("mistral"), MistralToolParser)
    with pytest.raises(InvalidRequestError):
        get_tool_parser("nope")


def test_plans():
    assert plan_tools(None, None, None).mode == "none"
    assert plan_tools([WEATHER], "none", None).structured(True) is None
    with pytest.raises(UnsupportedError):
        plan_tools([WEATHER], "auto", None)
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.mode == "named" and named.structured(True).json == WEATHER["function"]["parameters"]
    required = plan_tools([WEATHER, TIME], "required", None).structured(False)
    assert required.json["maxItems"] == 1 and len(required.json["items"]["anyOf"]) == 2
    with pytest.raises(InvalidRequestError):
        plan_tools([{"type": "function", "function": {"parameters": {}}}], "required", None)
    with pytest.raises(InvalidRequestError):
        plan_tools([WEATHER], "sometimes", None)


def _reassemble(deltas):
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = tc.get("id", call["id"])
            fn = tc.get("function", {})
            call["name"] = fn.get("name", call["name"])
            call["arguments"] += fn.get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("pieces", [["Hi <tool", "_call>", '{"name": "get_time", "arguments": {}}', "</tool_call>"],
                                    ["Hi ", "<", "tool_call>{\"name\": ", '"get_time", "arguments": {}}']])
def test_auto_stream_holds_back_a_call_and_emits_it_whole(pieces):
    stream = ToolCallStream(plan_tools([TIME], "auto", HermesToolParser()))
    deltas = []
    for k, piece in enumerate(pieces):
        out = stream.feed(piece, k == len(pieces) - 1)
        assert all("<" not in d.get("content", "") for d in out)  # no piece of a marker leaks as content
        deltas += out
    content, calls = _reassemble(deltas)
    assert content == "Hi " and [(c["name"], c["arguments"]) for c in calls] == [("get_time", "{}")]
    assert stream.calls and calls[0]["id"] == stream.calls[0].id


def test_auto_stream_malformed_call_comes_back_as_text():
    stream = ToolCallStream(plan_tools([TIME], "auto", HermesToolParser()))
    text = ["Hello <tool_call>", '{"name": oops']
    deltas = stream.feed(text[0], False) + stream.feed(text[1], True)
    assert _reassemble(deltas) == ("".join(text), []) and not stream.calls


def test_named_stream_streams_arguments():
    stream = ToolCallStream(plan_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None))
    deltas = stream.feed('{"city": ', False) + stream.feed('"Oslo"}', True)
    assert len(deltas) == 3  # the call's head, then two pieces of arguments
    _, calls = _reassemble(deltas)
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


def test_required_stream_streams_each_calls_arguments():
    plan = plan_tools([WEATHER, TIME], "required", None)
    text = ('[{"name": "get_time", "arguments": {"tz": "a\\"}]"}}, '
            '{"name": "get_weather", "arguments": {"city": "Oslo", "days": [2, {"x": "}"}]}}]')
    stream = ToolCallStream(plan)
    deltas = []
    for k in range(0, len(text), 3):
        deltas += stream.feed(text[k:k + 3], False)
    deltas += stream.feed("", True)
    content, calls = _reassemble(deltas)
    whole = plan.parse(text)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == \
        [(c.name, c.arguments) for c in whole.calls]
    assert json.loads(calls[0]["arguments"]) == {"tz": 'a"}]'}
    assert sum(1 for d in deltas for tc in d["tool_calls"] if "id" in tc) == 2
    assert len(deltas) > 10  # arguments arrived in many pieces, not at the end
