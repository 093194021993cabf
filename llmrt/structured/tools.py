"""Chat tools: what `tools` + `tool_choice` mean for one request (a constraint, a parser, or neither), and how
a choice's generated text becomes content and tool calls, whole or as OpenAI-style stream deltas."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from llmrt.errors import InvalidRequestError, UnsupportedError
from llmrt.structured.spec import StructuredOutputs
from llmrt.structured.tool_parsers import ParsedOutput, ToolCall, ToolParser, call_from_json, new_call_id

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class Function:
    """One tool: a function's name and the JSON schema of its arguments."""

    name: str
    parameters: dict[str, Any]


def parse_tools(tools: Optional[list[dict[str, Any]]]) -> list[Function]:
    """The functions of a request's `tools`; InvalidRequestError naming the bad entry."""
    out: list[Function] = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"tools[{i}]: must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                      param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name: must be a non-empty string", param="tools")
        params = fn.get("parameters") or _EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters: must be a JSON schema object", param="tools")
        out.append(Function(name, params))
    return out


@dataclass
class ToolPlan:
    """How one chat request uses its tools."""

    mode: str  # none | auto | required | named
    functions: list[Function] = field(default_factory=list)
    named: Optional[str] = None
    parser: Optional[ToolParser] = None  # auto: the model's own format

    @property
    def active(self) -> bool:
        """Whether outputs may hold tool calls."""
        return self.mode != "none"

    @property
    def render_tools(self) -> bool:
        """Whether the chat template is shown the tools."""
        return self.mode != "none"

    def structured(self, parallel_tool_calls: bool) -> Optional[StructuredOutputs]:
        """The constraint `required` and named choices generate under; None for none/auto."""
        if self.mode == "named":
            fn = next(f for f in self.functions if f.name == self.named)
            return StructuredOutputs(json=fn.parameters, param="tool_choice")
        if self.mode != "required":
            return None
        cases = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in self.functions]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": cases[0] if len(cases) == 1 else {"anyOf": cases}}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutputs(json=schema, param="tool_choice")

    def parse(self, text: str) -> ParsedOutput:
        """A finished choice's text as content and calls (text that does not parse stays content)."""
        if self.mode == "named":
            return ParsedOutput(None, [ToolCall(self.named or "", text)])
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return ParsedOutput(text, [])
            calls = [call_from_json(item, ("arguments",)) for item in items] if isinstance(items, list) else []
            if not calls or any(c is None for c in calls):
                return ParsedOutput(text, [])
            # The arguments exactly as generated (what a stream sends), not re-serialized.
            scanned = scan_required_calls(text)
            if [name for name, _, _ in scanned] == [c.name for c in calls if c is not None]:
                for call, (_, args, _) in zip(calls, scanned):
                    call.arguments = args  # type: ignore[union-attr]
            return ParsedOutput(None, calls)  # type: ignore[arg-type]
        if self.mode == "auto" and self.parser is not None:
            return self.parser.parse(text)
        return ParsedOutput(text, [])


def plan_tools(tools: Optional[list[dict[str, Any]]], tool_choice: Any, parser: Optional[ToolParser]) -> ToolPlan:
    """Check `tools` and `tool_choice` together; auto needs a parser (the server's, or one the template shows)."""
    functions = parse_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
                                      param="tool_choice")
        if name not in {f.name for f in functions}:
            raise InvalidRequestError(f"tool_choice: {name!r} is not one of the request's tools", param="tool_choice")
        return ToolPlan("named", functions, named=name)
    if tool_choice not in ("none", "auto", "required"):
        raise InvalidRequestError(f"tool_choice: must be none, auto, required or a named function, not {tool_choice!r}",
                                  param="tool_choice")
    if tool_choice == "none" or not functions:
        if tool_choice == "required":
            raise InvalidRequestError("tool_choice: required needs at least one tool", param="tool_choice")
        return ToolPlan("none", functions)
    if tool_choice == "auto" and parser is None:
        raise UnsupportedError("tool_choice: auto needs a tool-call parser to read the model's calls; start the "
                               "server with --tool-call-parser (hermes, llama3_json, mistral), or use required or "
                               "a named function", param="tool_choice")
    return ToolPlan(tool_choice, functions, parser=parser if tool_choice == "auto" else None)


# The head of one call in the array `required` generates: the grammar fixes this layout (compact separators,
# properties in schema order), so a call's name is known before its arguments begin.
_CALL_HEAD = re.compile(r'[\s\[\],}]*\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


def _value_end(text: str, i: int) -> Optional[int]:
    """The index just past the JSON value starting at text[i], or None if it has not ended yet."""
    if i >= len(text):
        return None
    depth, in_string, escaped = 0, False, False
    scalar = text[i] not in '{["'
    for j in range(i, len(text)):
        ch = text[j]
        if scalar:
            if ch in ",}]":
                return j
            continue
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def scan_required_calls(text: str) -> list[tuple[str, str, bool]]:
    """(name, arguments so far, arguments complete) of each call begun in a `required` output."""
    calls, pos = [], 0
    while True:
        m = _CALL_HEAD.match(text, pos)
        if m is None:
            return calls
        end = _value_end(text, m.end())
        calls.append((json.loads(f'"{m.group(1)}"'), text[m.end():end if end is not None else len(text)],
                      end is not None))
        if end is None:
            return calls
        pos = end


class ToolCallStream:
    """One choice's stream: text deltas in, OpenAI delta objects out (content and/or tool_calls)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content (auto) or arguments (named)
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, final: bool) -> list[dict[str, Any]]:
        """Deltas for what `delta` adds; on the final one, whatever was held back."""
        self.text += delta
        plan = self.plan
        if plan.mode == "named":  # the arguments stream as they are generated
            out = []
            if not self.calls:
                self.calls.append(ToolCall(plan.named or "", ""))
                out.append({"tool_calls": [{"index": 0, "id": self.calls[0].id, "type": "function",
                                            "function": {"name": plan.named, "arguments": ""}}]})
            if len(self.text) > self.sent:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": self.text[self.sent:]}}]})
                self.sent = len(self.text)
            return out
        if plan.mode == "required" and not final:  # each call's arguments stream as they are generated
            return self._required_deltas()
        if not final:
            if plan.mode == "auto" and plan.parser is not None:  # content before a call streams as it comes
                end = plan.parser.content_end(self.text)
                if end > self.sent:
                    piece, self.sent = self.text[self.sent:end], end
                    return [{"content": piece}]
            return []
        if plan.mode == "required" and self.calls:
            # What was streamed stands; a truncated call (finish_reason length) stays as far as it got.
            return self._required_deltas()
        parsed = plan.parse(self.text)
        if not parsed.calls:
            rest = self.text[self.sent:]
            return [{"content": rest}] if rest else []
        out = []
        content = parsed.content or ""
        if len(content) > self.sent and content.startswith(self.text[:self.sent]):
            out.append({"content": content[self.sent:]})
        self.calls = parsed.calls
        for i, call in enumerate(parsed.calls):
            out.append({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": i, "function": {"arguments": call.arguments}}]})
        return out


    def _required_deltas(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, (name, args, _) in enumerate(scan_required_calls(self.text)):
            if i == len(self.calls):
                self.calls.append(ToolCall(name, ""))
                out.append({"tool_calls": [{"index": i, "id": self.calls[i].id, "type": "function",
                                            "function": {"name": name, "arguments": ""}}]})
            call = self.calls[i]
            if len(args) > len(call.arguments):
                out.append({"tool_calls": [{"index": i, "function": {"arguments": args[len(call.arguments):]}}]})
                call.arguments = args
        return out


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """Calls as OpenAI's message.tool_calls."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


__all__ = ["Function", "ToolPlan", "ToolCallStream", "plan_tools", "parse_tools", "tool_calls_json", "new_call_id"]
