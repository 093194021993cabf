"""Completions and chat completions over AsyncLLM: request -> SamplingParams, engine streams, responses, SSE.

One API request becomes one engine request per prompt (each with its n samples). Outputs from the engine are
cumulative; responses and stream deltas are computed from them here. Text is held back in streams while a
stop string could still cut it (the engine finds a stop string only once all of it has arrived).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Sequence, TypeVar, Union

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from llmrt.errors import (CancelledError, ContextLengthExceededError, DeadlineExceededError, InvalidRequestError, LLMRTError, ModelNotFoundError, UnsupportedError)
from llmrt.metrics.timing import request_timing
from llmrt.outputs import CompletionOutput, RequestOutput
from llmrt.sampling_params import SamplingParams
from llmrt.server import protocol as P
from llmrt.server.errors import sse_error_event
from llmrt.structured.spec import StructuredOutputs
from llmrt.structured.tool_parsers import ToolParser
from llmrt.structured.tools import ToolCallStream, ToolPlan, plan_tools, tool_calls_json
from llmrt.tokenizer import Tokenizer

logger = logging.getLogger("llmrt.server")
T = TypeVar("T")
Prompt = Union[str, list[int]]

_CONTEXT_TOKENS = 4  # tokens of left context when turning one token id into its text (leading spaces)
_MIN_LOGPROB = -9999.0  # -inf is not JSON
# The engine enforces a request's timeout at step boundaries; the server enforces it too, this much later, so
# that a hung engine cannot hold a request past its deadline.
_DEADLINE_GRACE_S = 0.25


@dataclass
class ServerState:
    """What the routes share."""

    engine: Any  # AsyncLLM or anything with its interface
    model_name: str  # the name /v1/models lists and responses carry
    aliases: frozenset[str]  # other names requests may use for it
    created: int = field(default_factory=lambda: int(time.time()))
    debug: bool = False
    default_timeout: Optional[float] = None  # --request-timeout
    # Called with the final engine outputs of every API request (metrics, dashboard).
    observers: list[Callable[[list[Optional[RequestOutput]]], None]] = field(default_factory=list)
    tool_parser: Optional[ToolParser] = None  # --tool-call-parser, or the chat template's format

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def check_model(self, name: Optional[str]) -> None:
        """404 model_not_found unless `name` is this server's model (or omitted)."""
        if name is None or name == self.model_name or name in self.aliases:
            return
        raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                                 param="model")


def access_record(request: Request) -> dict[str, Any]:
    """The access-log record of this request (filled in by the routes, written by the middleware)."""
    record = getattr(request.state, "access", None)
    return record if isinstance(record, dict) else {}


def finish_request(request: Request, gen: "Generation") -> None:
    """Write a finished (or failed) API request's counts and timings into its access record and the observers."""
    gen.log_into(access_record(request))
    state = getattr(request.app.state, "llmrt", None)
    for observe in state.observers if state is not None else ():
        observe(gen.latest)


# -- request -> SamplingParams ---------------------------------------------------------------------------------
def sampling_params(req: P._SamplingFields, *, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
    """The request's knobs as SamplingParams; raises InvalidRequestError naming the field."""
    kw: dict[str, Any] = {}
    for name in ("temperature", "top_p", "n", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "min_tokens"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if req.timeout is not None and (not math.isfinite(req.timeout) or req.timeout <= 0):
        raise InvalidRequestError(f"timeout: must be a positive number of seconds, got {req.timeout!r}",
                                  param="timeout")
    return SamplingParams(
        **kw, max_tokens=max_tokens, logprobs=logprobs, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=bool(req.ignore_eos), skip_special_tokens=req.skip_special_tokens is not False,
        include_stop_str_in_output=bool(req.include_stop_str_in_output), logit_bias=_logit_bias(req.logit_bias),
        structured=structured_outputs(req), speculative=req.speculative is not False)


def structured_outputs(req: P._SamplingFields) -> Optional[StructuredOutputs]:
    """The request's output constraint from `response_format` or `structured_outputs` (not both)."""
    fmt, extra = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text":
        if extra is not None:
            raise InvalidRequestError("response_format: give either response_format or structured_outputs, not both",
                                      param="response_format")
        if fmt.type == "json_object":
            return StructuredOutputs(json_object=True, param="response_format")
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError('response_format: json_schema needs {"json_schema": {"schema": {...}}}',
                                      param="response_format")
        return StructuredOutputs(json=schema, param="response_format")
    if extra is None:
        return None
    return StructuredOutputs(json=extra.json_schema, json_object=bool(extra.json_object), regex=extra.regex,
                             grammar=extra.grammar, choice=tuple(extra.choice) if extra.choice is not None else None)


def _logit_bias(bias: Optional[dict[str, float]]) -> Optional[dict[int, float]]:
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias") from None
        if not math.isfinite(value):
            raise InvalidRequestError(f"logit_bias: values must be in [-100, 100], got {value!r}", param="logit_bias")
        out[token] = value
    return out


def completion_prompts(prompt: Union[str, list[str], list[int], list[list[int]]]) -> list[Prompt]:
    """The prompts of a completions request, each a string or token ids."""
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif not prompt:
        raise InvalidRequestError("prompt: must not be empty", param="prompt")
    elif isinstance(prompt[0], int):
        prompts = [prompt]  # type: ignore[list-item]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    for i, p in enumerate(prompts):
        if not p:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise InvalidRequestError(f"{where}: must not be empty", param="prompt")
    return prompts


def chat_messages(messages: Sequence[P.ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the tokenizer's chat template takes them; only text content is supported."""
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":  # OpenAI's newer name for the system role
            d["role"] = "system"
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise UnsupportedError(f"messages[{i}].content[{j}]: only text content parts are supported, "
                                           f"not {part.type!r}", param="messages")
            d["content"] = [{"type": "text", "text": part.text} for part in m.content]
        out.append(d)
    return out


# -- engine streams ---------------------------------------------------------------------------------------------
class Generation:
    """The engine requests of one API request (one per prompt), iterated together."""

    def __init__(self, engine: Any, prompts: list[Prompt], params: SamplingParams, base_id: str, *,
                 priority: int = 0, timeout: Optional[float] = None, default_timeout: Optional[float] = None,
                 prompt_param: str = "prompt", user: Optional[str] = None):
        """`timeout` goes to the engine (None: the engine's default); `default_timeout` is that default.

        `prompt_param` is the API field the prompt came from: engine errors about the prompt name it.
        """
        self.prompt_param = prompt_param
        self.request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self.gens = [engine.generate(p, params, rid, priority=priority, timeout=timeout, user=user)
                     for p, rid in zip(prompts, self.request_ids)]
        self.params = params
        limit = timeout if timeout is not None else default_timeout
        self.deadline = time.monotonic() + limit + _DEADLINE_GRACE_S if limit is not None else None
        self.latest: list[Optional[RequestOutput]] = [None] * len(prompts)
        self.done = [False] * len(prompts)
        self._pending: dict[asyncio.Future, int] = {}

    @property
    def finished(self) -> bool:
        return all(self.done)

    async def next(self) -> list[int]:
        """Wait for new outputs; return which prompts got one. Raises the first engine error."""
        waiting = set(self._pending.values())
        for i, gen in enumerate(self.gens):
            if not self.done[i] and i not in waiting:
                self._pending[asyncio.ensure_future(gen.__anext__())] = i
        if not self._pending:
            return []
        wait = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        done, _ = await asyncio.wait(self._pending, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise DeadlineExceededError("the request's timeout passed before it finished (the engine did not "
                                        "answer in time); nothing it generated is kept")
        updated: list[int] = []
        error: Optional[BaseException] = None
        for fut in done:
            i = self._pending.pop(fut)
            try:
                out = fut.result()
            except StopAsyncIteration:
                self.done[i] = True
                continue
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others are recorded
                if isinstance(e, LLMRTError) and e.param == "prompt":
                    e.param = self.prompt_param
                self.done[i] = True
                error = error or e
                continue
            self.latest[i] = out
            if out.finished:
                self.done[i] = True
                if out.error is not None:
                    error = error or out.error
            updated.append(i)
        if error is not None:
            raise error
        return sorted(updated)

    async def started(self) -> None:
        """Wait until every prompt has its first output: validation and admission errors come before it."""
        while any(self.latest[i] is None and not self.done[i] for i in range(len(self.gens))):
            await self.next()

    async def run(self) -> list[RequestOutput]:
        """Run every prompt to its end; the final outputs."""
        while not self.finished:
            await self.next()
        return [out for out in self.latest if out is not None]

    async def close(self) -> None:
        """Stop whatever is still running (the engine aborts those requests and frees their blocks)."""
        with anyio.CancelScope(shield=True):
            pending = list(self._pending)
            self._pending.clear()
            for fut in pending:
                fut.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
            for gen in self.gens:
                try:
                    await gen.aclose()
                except Exception:  # noqa: BLE001 - closing must not fail the response
                    logger.debug("closing an engine stream failed", exc_info=True)

    def usage(self) -> P.UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in self.latest if o is not None)
        completion = sum(len(c.token_ids) for o in self.latest if o is not None for c in o.outputs)
        cached = sum(o.metrics.num_cached_tokens for o in self.latest if o is not None)
        return P.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=P.PromptTokensDetails(cached_tokens=cached))

    def log_into(self, record: dict[str, Any]) -> None:
        usage = self.usage()
        record["prompt_tokens"], record["completion_tokens"] = usage.prompt_tokens, usage.completion_tokens
        metrics = [o.metrics.as_dict() for o in self.latest if o is not None]
        if len(metrics) == 1:
            record["metrics"] = metrics[0]
        elif metrics:
            record["metrics"] = metrics


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, but cancel it if the client disconnects first (then raise CancelledError, 499)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise CancelledError("the client disconnected before the response was ready")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# -- token texts and logprobs ------------------------------------------------------------------------------------
class TokenTexts:
    """The text one token adds after its left context (so that leading spaces survive)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def entries(self, context: Sequence[int], token_ids: Sequence[int],
                logprobs: Optional[Sequence[Optional[dict[int, float]]]], top: Optional[int]
                ) -> list[tuple[str, Optional[float], list[tuple[str, float]]]]:
        """(token text, its logprob, [(alternative text, logprob)] best first) for each token."""
        ctx = list(context[-_CONTEXT_TOKENS:])
        out = []
        for k, tid in enumerate(token_ids):
            base = self.tokenizer.decode(ctx, False)
            lp = logprobs[k] if logprobs is not None and k < len(logprobs) else None
            alts: list[tuple[str, float]] = []
            if lp:
                ranked = sorted(lp.items(), key=lambda kv: -kv[1])
                for alt, alt_lp in ranked if top is None else ranked[:top]:
                    alts.append((self._text(ctx, base, alt), _finite(alt_lp)))
            out.append((self._text(ctx, base, tid), _finite(lp[tid]) if lp and tid in lp else None, alts))
            ctx = (ctx + [tid])[-_CONTEXT_TOKENS:]
        return out

    def _text(self, ctx: list[int], base: str, tid: int) -> str:
        if tid in self.tokenizer.byte_token_ids:  # <0xNN>: part of a character, shown as OpenAI shows bytes
            value = int(self.tokenizer.hf.convert_ids_to_tokens(tid)[3:5], 16)
            if value >= 0x80:
                return f"bytes:\\x{value:02x}"
        full = self.tokenizer.decode(ctx + [tid], False)
        if full.startswith(base):
            return full[len(base):]
        return self.tokenizer.decode([tid], False)


def token_bytes(text: str) -> list[int]:
    """The UTF-8 bytes of a token text ("bytes:\\xNN" for a lone byte)."""
    if text.startswith("bytes:\\x") and len(text) == 10:
        return [int(text[8:], 16)]
    return list(text.encode("utf-8"))


def _finite(x: float) -> float:
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB


def completion_logprobs(entries: list[tuple[str, Optional[float], list[tuple[str, float]]]], offset: int,
                        with_top: bool = True) -> tuple[P.CompletionLogprobs, int]:
    """OpenAI's legacy logprobs object, and the text offset after it."""
    lp = P.CompletionLogprobs()
    for text, logprob, alts in entries:
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob)
        top: Optional[dict[str, float]] = None
        if with_top and logprob is not None:
            top = {}
            for alt, alt_lp in alts:  # best first; two tokens with the same text keep the better one
                top.setdefault(alt, alt_lp)
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(text)
    return lp, offset


def chat_logprobs(entries: list[tuple[str, Optional[float], list[tuple[str, float]]]]) -> P.ChatChoiceLogprobs:
    """The chat format: one object per token with its top alternatives."""
    content = [P.ChatTokenLogprob(token=text, logprob=logprob if logprob is not None else _MIN_LOGPROB,
                                  bytes=token_bytes(text),
                                  top_logprobs=[P.ChatTopLogprob(token=t, logprob=v, bytes=token_bytes(t))
                                                for t, v in alts])
               for text, logprob, alts in entries]
    return P.ChatChoiceLogprobs(content=content)


# -- deltas from cumulative outputs ---------------------------------------------------------------------------------
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
    if upto >= _CONTEXT_TOKENS:
        return sample.token_ids[upto - _CONTEXT_TOKENS:upto]
    return prompt_ids[-(_CONTEXT_TOKENS - upto):] + sample.token_ids[:upto]


def _stop_reason(value: Any) -> Union[int, str, None]:
    return value if isinstance(value, (int, str)) else None


# -- SSE ------------------------------------------------------------------------------------------------------------
def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class StreamFormatter:
    """Chunks of one streamed response; subclasses give the endpoint's shapes."""

    object_name = ""

    def __init__(self, response_id: str, model: str, created: int, include_usage: bool):
        self.response_id, self.model, self.created = response_id, model, created
        self.include_usage = include_usage
        self.timing: Optional[dict[str, Any]] = None  # the `llmrt` object, set once every prompt has finished

    def chunk(self, choices: list[dict[str, Any]], usage: Optional[P.UsageInfo] = None) -> str:
        body: dict[str, Any] = {"id": self.response_id, "object": self.object_name, "created": self.created,
                                "model": self.model, "choices": choices}
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
        except Exception as e:  # noqa: BLE001 - a bug; the stream still ends properly
            logger.exception("error while streaming %s", fmt.response_id)
            record["error"] = "internal_error"
            yield sse_error_event(LLMRTError(f"internal server error: {type(e).__name__}: {e}"))
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


# -- completions -------------------------------------------------------------------------------------------------
class CompletionStream(StreamFormatter):
    object_name = "text_completion"

    def __init__(self, *args: Any, texts: TokenTexts, logprobs: Optional[int], echo: list[Optional[str]]):
        super().__init__(*args)
        self.texts, self.logprobs, self.echo = texts, logprobs, echo
        self.offsets: dict[int, int] = {}

    def head(self, gen: Generation) -> list[str]:
        events = []
        for i, prompt_text in enumerate(self.echo):
            if prompt_text is None:
                continue
            out = gen.latest[i]
            assert out is not None
            lp = None
            if self.logprobs is not None:
                lp, _ = completion_logprobs(self.texts.entries([], out.prompt_token_ids, out.prompt_logprobs, None), 0)
            for j in range(gen.params.n):
                index = i * gen.params.n + j
                self.offsets[index] = len(prompt_text)
                events.append(self.chunk([{"index": index, "text": prompt_text,
                                           "logprobs": lp.model_dump() if lp else None, "finish_reason": None}]))
        return events

    def delta(self, gen: Generation, prompt_index: int, d: Delta) -> list[str]:
        lp = None
        if self.logprobs is not None and d.token_ids:
            entries = self.texts.entries(d.context, d.token_ids, d.logprobs, None)
            logprobs, self.offsets[d.index] = completion_logprobs(entries, self.offsets.get(d.index, 0))
            lp = logprobs.model_dump()
        elif not d.text and d.finish_reason is None:
            return []
        choice = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            choice["stop_reason"] = _stop_reason(d.stop_reason)
        return [self.chunk([choice])]


def completion_response(gen: Generation, response_id: str, model: str, created: int, texts: TokenTexts,
                        logprobs: Optional[int], echo: list[Optional[str]]) -> P.CompletionResponse:
    tracker = DeltaTracker(len(gen.gens), gen.params, holdback=False)
    choices = []
    for i, out in enumerate(gen.latest):
        assert out is not None
        prompt_text = echo[i]
        for d in tracker.update(i, out):
            lp = None
            if logprobs is not None:
                lp, _ = completion_logprobs(texts.entries(d.context, d.token_ids, d.logprobs, None),
                                            len(prompt_text or ""))
                if prompt_text is not None:  # the echoed prompt's tokens come first (the first has no logprob)
                    head, _ = completion_logprobs(
                        texts.entries([], out.prompt_token_ids, out.prompt_logprobs, None), 0)
                    lp = P.CompletionLogprobs(tokens=head.tokens + lp.tokens,
                                              token_logprobs=head.token_logprobs + lp.token_logprobs,
                                              top_logprobs=head.top_logprobs + lp.top_logprobs,
                                              text_offset=head.text_offset + lp.text_offset)
            choices.append(P.CompletionChoice(index=d.index, text=(prompt_text or "") + d.text, logprobs=lp,
                                              finish_reason=d.finish_reason, stop_reason=_stop_reason(d.stop_reason)))
    choices.sort(key=lambda c: c.index)
    return P.CompletionResponse(id=response_id, created=created, model=model, choices=choices, usage=gen.usage(),
                                llmrt=request_timing(gen.latest))


async def create_completion(state: ServerState, req: P.CompletionRequest, request: Request) -> Any:
    record = access_record(request)
    state.check_model(req.model)
    if req.suffix:
        raise UnsupportedError("suffix: insertion (suffix) is not supported by this server", param="suffix")
    n = req.n if req.n is not None else 1
    if req.best_of is not None and req.best_of != n:
        raise UnsupportedError("best_of: only best_of equal to n is supported", param="best_of")
    prompts = completion_prompts(req.prompt)
    params = sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    if req.echo and req.logprobs is not None:
        params.prompt_logprobs = req.logprobs  # echoed prompt tokens carry their logprobs (scoring, lm-eval)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    record.update(response_id=response_id, model=state.model_name, stream=bool(req.stream), user=req.user,
                  max_tokens=params.max_tokens)  # what was reserved: `llmrt tokens --access-log` compares it with use
    tokenizer = state.tokenizer
    echo: list[Optional[str]] = [None] * len(prompts)
    if req.echo:
        echo = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
    prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    texts = TokenTexts(tokenizer)
    gen = Generation(state.engine, list(prompt_ids), params, response_id, priority=req.priority or 0, user=req.user,
                     timeout=req.timeout, default_timeout=state.default_timeout)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = CompletionStream(response_id, state.model_name, created, include_usage, texts=texts,
                               logprobs=req.logprobs, echo=echo)
        return await stream_response(request, gen, fmt)
    try:
        await until_disconnect(request, gen.run())
    finally:
        await gen.close()
        finish_request(request, gen)
    return completion_response(gen, response_id, state.model_name, created, texts, req.logprobs, echo)


# -- chat --------------------------------------------------------------------------------------------------------
class ChatStream(StreamFormatter):
    object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, texts: TokenTexts, top_logprobs: Optional[int], tools: ToolPlan):
        super().__init__(*args)
        self.texts, self.top_logprobs, self.tools = texts, top_logprobs, tools
        self.tool_streams: dict[int, ToolCallStream] = {}

    def head(self, gen: Generation) -> list[str]:
        return [self.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])
                for index in range(len(gen.gens) * gen.params.n)]

    def delta(self, gen: Generation, prompt_index: int, d: Delta) -> list[str]:
        lp = None
        if self.top_logprobs is not None and d.token_ids:
            entries = self.texts.entries(d.context, d.token_ids, d.logprobs, self.top_logprobs)
            lp = chat_logprobs(entries).model_dump()
        elif not d.text and d.finish_reason is None:
            return []
        if self.tools.active:
            return self._tool_delta(d, lp)
        choice: dict[str, Any] = {"index": d.index, "delta": {"content": d.text} if d.text else {},
                                  "logprobs": lp, "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            choice["stop_reason"] = _stop_reason(d.stop_reason)
        return [self.chunk([choice])]

    def _tool_delta(self, d: Delta, lp: Any) -> list[str]:
        """Content and tool-call deltas of a choice whose text may hold tool calls."""
        stream = self.tool_streams.setdefault(d.index, ToolCallStream(self.tools))
        deltas = stream.feed(d.text, d.finish_reason is not None)
        events = [self.chunk([{"index": d.index, "delta": delta, "logprobs": lp if k == 0 else None,
                               "finish_reason": None}]) for k, delta in enumerate(deltas)]
        if d.finish_reason is not None:
            choice = {"index": d.index, "delta": {}, "logprobs": None if deltas else lp,
                      "finish_reason": _tool_finish_reason(d.finish_reason, bool(stream.calls)),
                      "stop_reason": _stop_reason(d.stop_reason)}
            events.append(self.chunk([choice]))
        return events


def _tool_finish_reason(finish_reason: str, has_calls: bool) -> str:
    """OpenAI's tool_calls when a choice that ended by itself holds calls."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


def chat_response(gen: Generation, response_id: str, model: str, created: int, texts: TokenTexts,
                  top_logprobs: Optional[int], tools: ToolPlan) -> P.ChatCompletionResponse:
    tracker = DeltaTracker(len(gen.gens), gen.params, holdback=False)
    choices = []
    for i, out in enumerate(gen.latest):
        assert out is not None
        for d in tracker.update(i, out):
            lp = None
            if top_logprobs is not None:
                lp = chat_logprobs(texts.entries(d.context, d.token_ids, d.logprobs, top_logprobs))
            message, finish = P.ChatResponseMessage(content=d.text), d.finish_reason
            if tools.active:
                parsed = tools.parse(d.text)
                message = P.ChatResponseMessage(content=parsed.content,
                                                tool_calls=tool_calls_json(parsed.calls) if parsed.calls else None)
                finish = _tool_finish_reason(d.finish_reason or "stop", bool(parsed.calls))
            choices.append(P.ChatCompletionChoice(index=d.index, message=message, logprobs=lp, finish_reason=finish,
                                                  stop_reason=_stop_reason(d.stop_reason)))
    choices.sort(key=lambda c: c.index)
    return P.ChatCompletionResponse(id=response_id, created=created, model=model, choices=choices, usage=gen.usage(),
                                    llmrt=request_timing(gen.latest))


async def create_chat_completion(state: ServerState, req: P.ChatCompletionRequest, request: Request) -> Any:
    record = access_record(request)
    state.check_model(req.model)
    tools = plan_tools(req.tools, req.tool_choice, state.tool_parser)
    top_logprobs: Optional[int] = None
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise InvalidRequestError("top_logprobs: needs logprobs set to true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= 20:
            raise InvalidRequestError(f"top_logprobs: must be in [0, 20], got {req.top_logprobs}",
                                      param="top_logprobs")
    if req.logprobs:
        top_logprobs = req.top_logprobs or 0
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    try:
        params = sampling_params(req, max_tokens=max_tokens, logprobs=top_logprobs)
    except InvalidRequestError as e:
        if e.param == "max_tokens" and req.max_completion_tokens is not None:
            e.param, e.message = "max_completion_tokens", e.message.replace("max_tokens", "max_completion_tokens")
        raise
    tool_constraint = tools.structured(req.parallel_tool_calls is not False)
    if tool_constraint is not None:
        if params.structured is not None:
            raise InvalidRequestError("tool_choice: required or a named function already constrains the output; "
                                      "leave out response_format and structured_outputs", param="tool_choice")
        params.structured = tool_constraint
        params.validate()
    tokenizer = state.tokenizer
    prompt_ids = tokenizer.apply_chat_template(chat_messages(req.messages), req.add_generation_prompt is not False,
                                               req.tools if tools.render_tools else None)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    record.update(response_id=response_id, model=state.model_name, stream=bool(req.stream), user=req.user,
                  max_tokens=params.max_tokens)  # what was reserved: `llmrt tokens --access-log` compares it with use
    texts = TokenTexts(tokenizer)
    gen = Generation(state.engine, [prompt_ids], params, response_id, priority=req.priority or 0, user=req.user,
                     timeout=req.timeout, default_timeout=state.default_timeout, prompt_param="messages")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        fmt = ChatStream(response_id, state.model_name, created, include_usage, texts=texts,
                         top_logprobs=top_logprobs, tools=tools)
        return await stream_response(request, gen, fmt)
    try:
        await until_disconnect(request, gen.run())
    finally:
        await gen.close()
        finish_request(request, gen)
    return chat_response(gen, response_id, state.model_name, created, texts, top_logprobs, tools)
