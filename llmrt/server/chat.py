"""POST /v1/chat/completions: messages rendered with the chat template, chat logprobs, tool calls."""
from __future__ import annotations

from typing import Any, Optional

from fastapi import Request

from llmrt.errors import InvalidRequestError
from llmrt.metrics.timing import request_timing
from llmrt.sampling_params import SamplingParams
from llmrt.server import protocol as P
from llmrt.server.generation import Generation
from llmrt.server.logprobs import TokenTexts, chat_logprobs
from llmrt.server.requests import chat_messages, sampling_params
from llmrt.server.state import ServerState
from llmrt.server.streaming import (Delta, DeltaTracker, ResponseHead, StreamFormatter, respond, start_response,
                                    stop_reason)
from llmrt.server.validation import check_request_tokens, reject_lone_surrogates
from llmrt.structured.backend import validate_structured
from llmrt.structured.tools import ToolCallStream, ToolPlan, plan_tools, tool_calls_json


class ChatStream(StreamFormatter):
    object_name = "chat.completion.chunk"

    def __init__(self, head: ResponseHead, include_usage: bool, *, texts: TokenTexts, top_logprobs: Optional[int], tools: ToolPlan):
        super().__init__(head, include_usage)
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
            choice["stop_reason"] = stop_reason(d.stop_reason)
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
                      "stop_reason": stop_reason(d.stop_reason)}
            events.append(self.chunk([choice]))
        return events


def _tool_finish_reason(finish_reason: str, has_calls: bool) -> str:
    """OpenAI's tool_calls when a choice that ended by itself holds calls."""
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


def render_prompt(state: ServerState, req: P.ChatCompletionRequest, tools: ToolPlan,
                  params: SamplingParams) -> list[int]:
    """The token ids of the rendered conversation; the output constraint checked. CPU work: runs on the
    offload pool."""
    ids = state.tokenizer.apply_chat_template(chat_messages(req.messages), req.add_generation_prompt is not False,
                                              req.tools if tools.render_tools else None)
    check_request_tokens(len(ids), state.max_request_tokens, "messages")
    if params.structured is not None:
        validate_structured(params.structured)
    return ids


def chat_response(gen: Generation, head: ResponseHead, texts: TokenTexts, top_logprobs: Optional[int],
                  tools: ToolPlan) -> P.ChatCompletionResponse:
    """The whole (non-streamed) response of a finished Generation."""
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
                                                  stop_reason=stop_reason(d.stop_reason)))
    choices.sort(key=lambda c: c.index)
    return P.ChatCompletionResponse(id=head.id, created=head.created, model=head.model, choices=choices,
                                    usage=gen.usage(), llmrt=request_timing(gen.latest))


async def create_chat_completion(state: ServerState, req: P.ChatCompletionRequest, request: Request) -> Any:
    """Answer one chat completions request (JSON, or SSE with `stream`)."""
    reject_lone_surrogates(req)
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
    prompt_ids = await state.offload.run(render_prompt, state, req, tools, params)
    head = start_response(state, request, "chatcmpl", req, params.max_tokens)
    texts = TokenTexts(tokenizer, as_ids=bool(req.return_tokens_as_token_ids))
    gen = Generation(state.engine, [prompt_ids], params, head.id, priority=req.priority or 0, user=req.user,
                     timeout=req.timeout, default_timeout=state.default_timeout, prompt_param="messages",
                     stream=bool(req.stream))
    stream = None
    if req.stream:
        stream = ChatStream(head, bool(req.stream_options and req.stream_options.include_usage), texts=texts,
                            top_logprobs=top_logprobs, tools=tools)
    return await respond(request, gen, stream, lambda: chat_response(gen, head, texts, top_logprobs, tools))
