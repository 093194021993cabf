"""Tool-call formats of model families: hermes (`<tool_call>{...}</tool_call>`), llama3_json (a bare JSON object,
optionally after `<|python_tag|>`, several joined by `;`) and mistral (`[TOOL_CALLS][{...}, ...]`). A parser
turns generated text into content plus tool calls; text it cannot parse stays content, whole."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from llmrt.errors import InvalidRequestError


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One function call: its name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)


@dataclass
class ParsedOutput:
    """Generated text split into what is said (content) and what is called."""

    content: Optional[str]
    calls: list[ToolCall]


def call_from_json(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> Optional[ToolCall]:
    """A ToolCall from {"name": str, "arguments": object}, or None if `obj` is not shaped like one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separator: str = "") -> Optional[list[Any]]:
    """Every JSON value in `text`, one after another (split by whitespace and `separator`); None if any fails."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (separator and text[i] == separator)):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


class ToolParser:
    """A model family's tool-call format."""

    name = ""
    markers: tuple[str, ...] = ()  # text that starts the tool-call part of an output

    def parse(self, text: str) -> ParsedOutput:
        """Content and calls of a finished output; all of it as content if the calls do not parse."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """While streaming: how much of `text` is content for sure (it stops before a marker, or before a
        suffix that may grow into one)."""
        ends = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if ends:
            return min(ends)
        for k in range(min(len(text), max(len(m) for m in self.markers) - 1), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return len(text) - k
        return len(text)


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, after optional content."""

    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find("<tool_call>")
        if start < 0:
            return ParsedOutput(text, [])
        calls = []
        for block in self._block.findall(text, start):
            values = _json_values(block)
            call = call_from_json(values[0]) if values and len(values) == 1 else None
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
        rest = self._block.sub("", text[start:]).strip()
        if rest:  # text between or after the calls: not this format
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start].strip() or None, calls)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
    several joined by `;`; the whole output is the calls."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")  # <|python_tag|> is a special token: with skip_special_tokens it is gone

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        values = _json_values(body, ";")
        calls = [call_from_json(v) for v in values] if values else []
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text, [])
        return ParsedOutput(None, calls)  # type: ignore[arg-type]

    def content_end(self, text: str) -> int:
        # Only an output that starts (after whitespace) with a call is one.
        body = text.lstrip()
        if not body or any(m.startswith(body[:len(m)]) for m in self.markers):
            return 0
        return len(text)


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def parse(self, text: str) -> ParsedOutput:
        original = text
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            if not text.lstrip().startswith("[{"):
                return ParsedOutput(text, [])
            # [TOOL_CALLS] is a special token: skip_special_tokens (the default) leaves the bare JSON list.
            text, start = "[TOOL_CALLS]" + text.lstrip(), 0
        content = text[:start].strip() or None
        calls: list[Optional[ToolCall]] = []
        for part in text[start:].split("[TOOL_CALLS]")[1:]:
            part = part.strip()
            if "[ARGS]" in part and not part.startswith("["):
                name, _, args = part.partition("[ARGS]")
                values = _json_values(args)
                calls.append(call_from_json({"name": name.strip(), "arguments": values[0]})
                             if values and len(values) == 1 else None)
                continue
            values = _json_values(part)
            if not values or len(values) != 1:
                return ParsedOutput(original, [])
            items = values[0] if isinstance(values[0], list) else [values[0]]
            calls += [call_from_json(v) for v in items]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(original, [])
        return ParsedOutput(content, calls)  # type: ignore[arg-type]

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("["):  # the marker itself, or the bare list it leaves when skipped
            return 0
        return super().content_end(text)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called `name`."""
    if name not in PARSERS:
        raise InvalidRequestError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSERS)}",
                                  param="tool_call_parser")
    return PARSERS[name]()


def detect_tool_parser(chat_template: Any) -> Optional[ToolParser]:
    """The format a chat template writes tool calls in, when it shows one; None otherwise."""
    text = json.dumps(chat_template) if isinstance(chat_template, dict) else str(chat_template or "")
    if "<tool_call>" in text:
        return HermesToolParser()
    if "[TOOL_CALLS]" in text:
        return MistralToolParser()
    if "<|python_tag|>" in text or "ipython" in text:
        return Llama3JsonToolParser()
    return None


def select_tool_parser(name: Optional[str], chat_template: Any) -> Optional[ToolParser]:
    """The parser named by --tool-call-parser, else the one the chat template shows, else None."""
    return get_tool_parser(name) if name else detect_tool_parser(chat_template)
