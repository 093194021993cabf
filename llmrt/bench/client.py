"""A streaming OpenAI client (completions and chat) that records when every token arrives, for benchmarks and
`llmrt regress`."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import httpx


@dataclass
class RequestResult:
    """One benchmark request: its outcome and the arrival time of each streamed token (time.perf_counter)."""

    start: float
    end: float = 0.0
    ok: bool = False
    status: Optional[int] = None
    error: Optional[str] = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: Optional[str] = None
    text: str = ""
    server_timing: Optional[dict[str, Any]] = None  # the response's `llmrt` extension object, when sent
    # Per output token when logprobs were asked: {"token": text, "logprob": float, "top": {text: logprob}}.
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from sending to the first streamed token."""
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2e(self) -> float:
        """Seconds from sending to the end of the stream."""
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive streamed chunks that carried tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> Optional[float]:
        """Mean seconds per output token after the first (uses the server's token count)."""
        n = self.output_tokens or len(self.token_times)
        if not self.token_times or n < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)


async def stream_completion(client: httpx.AsyncClient, base_url: str, model: str, prompt: Union[str, list[int]],
                            max_tokens: int, *, ignore_eos: bool = True, extra: Optional[dict[str, Any]] = None,
                            timeout: float = 600.0) -> RequestResult:
    """POST a streaming /v1/completions request and time each chunk; never raises for HTTP or stream errors."""
    body = completion_body(model, prompt, max_tokens, ignore_eos=ignore_eos, extra=extra)
    return await stream_request(client, base_url.rstrip("/") + "/completions", body, timeout=timeout)


def completion_body(model: str, prompt: Union[str, list[int]], max_tokens: int, *, stream: bool = True,
                    ignore_eos: bool = True, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """A greedy /v1/completions request body (streamed with a usage chunk at the end, unless stream is False)."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        # vLLM-style extras: fixed-length outputs make runs comparable across runtimes.
        body.update(ignore_eos=True, min_tokens=max_tokens)
    body.update(extra or {})
    return body


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                         timeout: float = 600.0) -> RequestResult:
    """POST a streaming completions or chat request body to `url` and time each chunk; never raises for HTTP or
    stream errors."""
    result = RequestResult(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                result.error = (await resp.aread()).decode(errors="replace")[:500]
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                apply_chunk(result, json.loads(data), time.perf_counter())
        result.ok = result.error is None
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.end = time.perf_counter()
    return result


def apply_chunk(result: RequestResult, chunk: dict[str, Any], now: float) -> None:
    """Fold one streamed chunk (a parsed SSE `data:` object) that arrived at `now` into `result`."""
    if "error" in chunk:
        result.error = json.dumps(chunk["error"])[:500]
        return
    for choice in chunk.get("choices") or []:
        text = choice.get("text") or (choice.get("delta") or {}).get("content")
        if text:
            result.token_times.append(now)
            result.text += text
        if choice.get("logprobs"):
            result.logprobs += _token_logprobs(choice["logprobs"])
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.output_tokens = usage.get("completion_tokens", 0)
        result.cached_tokens = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if chunk.get("llmrt"):
        result.server_timing = chunk["llmrt"]


def _token_logprobs(lp: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-token entries from a completions (`tokens`/`token_logprobs`/`top_logprobs`) or chat (`content`) object."""
    if "content" in lp:
        return [{"token": e.get("token"), "logprob": e.get("logprob"),
                 "top": {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []}} for e in lp["content"] or []]
    tops = lp.get("top_logprobs") or []
    return [{"token": tok, "logprob": val, "top": dict(tops[i] or {}) if i < len(tops) else {}}
            for i, (tok, val) in enumerate(zip(lp.get("tokens") or [], lp.get("token_logprobs") or []))]
