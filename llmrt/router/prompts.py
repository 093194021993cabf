"""What the router reads of a request body: the prompt prefix that prefix-affinity hashes, the user, the model,
the version pin and a token estimate for least-load. It never re-serializes the body: the bytes go on as sent."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from llmrt.router.policies import RouteInfo
from llmrt.router.versions import VERSION_FIELD

_CHARS_PER_TOKEN = 4  # text prompts are cut at blocks * block_size * this many characters (no tokenizer here)


@dataclass
class PrefixConfig:
    """How much of a prompt identifies its prefix: the first `blocks` KV blocks of `block_size` tokens."""

    blocks: int = 4
    block_size: int = 16


@dataclass
class ParsedRequest:
    """A request body as the router sees it."""

    info: RouteInfo
    model: Optional[str] = None
    pin: Optional[str] = None
    stream: bool = False


def parse_body(raw: bytes, prefix: PrefixConfig) -> ParsedRequest:
    """Read the routing fields of a JSON body (anything else: no fields, the backend judges the body)."""
    try:
        body = json.loads(raw) if raw else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return ParsedRequest(RouteInfo())
    key = prefix_key(body, prefix)
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    est = _prompt_len(body) + (max_tokens if isinstance(max_tokens, int) else 16)
    user = body.get("user")
    pin = body.get(VERSION_FIELD)
    model = body.get("model")
    return ParsedRequest(RouteInfo(prefix_key=key, user=user if isinstance(user, str) else None, est_tokens=est),
                         model=model if isinstance(model, str) else None, pin=pin if isinstance(pin, str) else None,
                         stream=body.get("stream") is True)


def prefix_key(body: dict[str, Any], prefix: PrefixConfig) -> Optional[bytes]:
    """The first blocks of the rendered prompt: token ids as they are, text cut at a character budget, chat
    messages rendered role by role (the chat template is the backend's; any rendering that keeps a shared
    system prompt a shared prefix works for hashing)."""
    tokens = prefix.blocks * prefix.block_size
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: the first prompt decides
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt[:tokens]):
        return b"ids:" + ",".join(map(str, prompt[:tokens])).encode()
    if isinstance(prompt, str) and prompt:
        return b"text:" + prompt[: tokens * _CHARS_PER_TOKEN].encode()
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        parts: list[str] = []
        budget = tokens * _CHARS_PER_TOKEN
        for m in messages:
            if not isinstance(m, dict):
                break
            parts.append(f"<{m.get('role')}>{_content_text(m.get('content'))}")
            if sum(map(len, parts)) >= budget:
                break
        return b"chat:" + "".join(parts)[:budget].encode()
    return None


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _prompt_len(body: dict[str, Any]) -> int:
    """Prompt tokens when known (token ids), else an estimate from characters."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt) // _CHARS_PER_TOKEN + 1
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(_content_text(m.get("content"))) for m in messages if isinstance(m, dict)) // _CHARS_PER_TOKEN + 1
    return 0
