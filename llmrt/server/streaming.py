"""What completions and chat share: the response head, deltas from cumulative outputs, SSE, and the one
path from a started Generation to a JSON response or an event stream.

Outputs from the engine are cumulative; deltas are computed from them here. Text is held back in streams while
a stop string could still cut it (the engine finds a stop string only once all of it has arrived).
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from llmrt.errors import InternalError, LLMRTError
from llmrt.metrics.timing import request_timing
from llmrt.outputs import CompletionOutput, RequestOutput
from llmrt.sampling_params import SamplingParams
from llmrt.server import protocol as P
from llmrt.server.errors import sse_error_event
from llmrt.server.generation import Generation, until_disconnect
from llmrt.server.logprobs import CONTEXT_TOKENS
from llmrt.server.state import ServerState, access_record, finish_request

logger = logging.getLogger("llmrt.server")


@dataclass(frozen=True)
class ResponseHead:
    """What the response (or every chunk) of one API request carries besides its choices."""

    id: str
    model: str
    created: int


def start_response(state: ServerState, request: Request, prefix: str, req: P._SamplingFields,
                   max_tokens: Optional[int] = None) -> ResponseHead:
    """A new response id (`prefix`-<hex>), noted in the request's access record with the reserved max_tokens."""
    head = ResponseHead(f"{prefix}-{uuid.uuid4().hex}", state.model_name, int(time.time()))
    # max_tokens is what was reserved: `llmrt tokens --access-log` compares it with what was used.
    access_record(request).update(response_id=head.id, model=head.model, stream=bool(req.stream), user=req.user,
                                  max_tokens=max_tokens)
    return head


async def respond(request: Request, gen: Generation, stream: Optional["StreamFormatter"],
                  build: Callable[[], BaseModel]) -> Any:
    """Stream `gen` with `stream`'s chunks, or run it to its end and answer `build()`."""
    if stream is not None:
        return await stream_response(request, gen, stream)
    try:
        await until_disconnect(request, gen.run())
    finally:
        await gen.close()
        finish_request(request, gen)
    return build()


@dataclass
class _ChoiceState:
    chars: int = 0  # text sent
    tokens: int = 0  # token ids accounted for
    finished: bool = False


@dataclass
class Delta:
    """What one choice gained since the last look."""

    index: int
    text: str
    context: list[int]  # the tokens before `token_ids`
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str]
    stop_reason: Union[int, str, None]


class DeltaTracker:
    """Turns cumulative outputs into per-choice deltas, holding back text a stop string could still cut."""

    def __init__(self, num_prompts: int, params: SamplingParams, holdback: bool):
        self.n = params.n
        self.states = [_ChoiceState() for _ in range(num_prompts * params.n)]
        stops = params.stop or []
        self.holdback = max((len(s) for s in stops), default=1) - 1 if holdback else 0

    def update(self, prompt_index: int, out: RequestOutput) -> list[Delta]:
        deltas = []
        for sample in out.outputs:
            index = prompt_index * self.n + sample.index
            st = self.states[index]
            if st.finished:
                continue
            final = sample.finish_reason is not None
            limit = len(sample.text) if final else len(sample.text) - self.holdback
            text = sample.text[st.chars:limit] if limit > st.chars else ""
            st.chars = max(st.chars, limit)
            new_ids = sample.token_ids[st.tokens:]
            lps = sample.logprobs[st.tokens:] if sample.logprobs is not None else None
            context = _context(out.prompt_token_ids, sample, st.tokens)
            st.tokens = len(sample.token_ids)
            st.finished = final
            if text or new_ids or final:
                deltas.append(Delta(index, text, context, new_ids, lps, sample.finish_reason if final else None,
                                    sample.stop_reason if final else None))
        return deltas


def _context(prompt_ids: list[int], sample: CompletionOutput, upto: int) -> list[int]:
    if upto >= CONTEXT_TOKENS:
        return sample.token_ids[upto - CONTEXT_TOKENS:upto]
    return prompt_ids[-(CONTEXT_TOKENS - upto):] + sample.token_ids[:upto]


def stop_reason(value: Any) -> Union[int, str, None]:
    return value if isinstance(value, (int, str)) else None


# -- SSE ------------------------------------------------------------------------------------------------------------
def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class StreamFormatter:
    """Chunks of one streamed response; subclasses give the endpoint's shapes."""

    object_name = ""

    def __init__(self, head: ResponseHead, include_usage: bool):
        self.response = head
        self.include_usage = include_usage
        self.timing: Optional[dict[str, Any]] = None  # the `llmrt` object, set once every prompt has finished

    def chunk(self, choices: list[dict[str, Any]], usage: Optional[P.UsageInfo] = None) -> str:
        head = self.response
        body: dict[str, Any] = {"id": head.id, "object": self.object_name, "created": head.created,
                                "model": head.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage.model_dump() if usage is not None else None
        # The final chunk carries the timings: the usage chunk, else the chunks finishing the last choices.
        final = usage is not None if self.include_usage else any(c.get("finish_reason") for c in choices)
        if self.timing is not None and final:
            body["llmrt"] = self.timing
        return sse(body)

    def head(self, gen: Generation) -> list[str]:
        return []

    def delta(self, gen: Generation, prompt_index: int, d: Delta) -> list[str]:
        raise NotImplementedError

    def tail(self, gen: Generation) -> list[str]:
        return [self.chunk([], gen.usage())] if self.include_usage else []


async def stream_response(request: Request, gen: Generation, fmt: StreamFormatter) -> StreamingResponse:
    """Start the engine requests (errors up to the first output are plain HTTP errors), then stream SSE."""
    record = access_record(request)
    try:
        await until_disconnect(request, gen.started())
    except BaseException:
        await gen.close()
        raise
    tracker = DeltaTracker(len(gen.gens), gen.params, holdback=True)

    async def events() -> AsyncIterator[str]:
        try:
            for event in fmt.head(gen):
                yield event
            updated = [i for i, out in enumerate(gen.latest) if out is not None]
            while True:
                if gen.finished:
                    fmt.timing = request_timing(gen.latest)
                for i in updated:
                    out = gen.latest[i]
                    assert out is not None
                    for d in tracker.update(i, out):
                        for event in fmt.delta(gen, i, d):
                            yield event
                if gen.finished:
                    break
                updated = await gen.next()
            for event in fmt.tail(gen):
                yield event
        except LLMRTError as e:
            record["error"] = e.code
            yield sse_error_event(e)
        except Exception:  # noqa: BLE001 - a bug; the stream still ends properly, the log has the detail
            request_id = record.get("request_id")
            logger.exception("error while streaming %s (request id %s)", fmt.response.id, request_id)
            record["error"] = "internal_error"
            yield sse_error_event(InternalError(request_id))
        except BaseException:
            record["error"] = "cancelled"  # the client went away; close() below aborts the engine requests
            raise
        finally:
            await gen.close()
            finish_request(request, gen)
        yield "data: [DONE]\n\n"

    return EventStreamResponse(events(), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its iterator, so that a client leaving mid-stream aborts the
    engine requests at once rather than whenever the suspended generator is garbage-collected."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


