"""POST /v1/completions: prompts (text or token ids) -> one engine request each, echo and legacy logprobs."""
from __future__ import annotations

from typing import Any, Optional

from fastapi import Request

from llmrt.errors import UnsupportedError
from llmrt.metrics.timing import request_timing
from llmrt.sampling_params import SamplingParams
from llmrt.server import protocol as P
from llmrt.server.generation import Generation
from llmrt.server.logprobs import TokenTexts, completion_logprobs
from llmrt.server.requests import Prompt, completion_prompts, sampling_params
from llmrt.server.state import ServerState
from llmrt.server.streaming import (Delta, DeltaTracker, ResponseHead, StreamFormatter, respond, start_response,
                                    stop_reason)
from llmrt.server.validation import check_request_tokens, check_token_ids, reject_lone_surrogates
from llmrt.structured.backend import validate_structured


class CompletionStream(StreamFormatter):
    object_name = "text_completion"

    def __init__(self, head: ResponseHead, include_usage: bool, *, texts: TokenTexts, logprobs: Optional[int], echo: list[Optional[str]]):
        super().__init__(head, include_usage)
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
            choice["stop_reason"] = stop_reason(d.stop_reason)
        return [self.chunk([choice])]


def prepare_prompts(state: ServerState, prompts: list[Prompt], echo: bool,
                    params: SamplingParams) -> tuple[list[list[int]], list[Optional[str]]]:
    """(token ids, echoed text or None) of each prompt, token ids checked first; the output constraint
    checked. CPU work: runs on the offload pool."""
    engine, tokenizer = state.engine, state.tokenizer
    wheres = ["prompt" if len(prompts) == 1 else f"prompt[{i}]" for i in range(len(prompts))]
    checked = {i: check_token_ids(p, engine.vocab_size, engine.max_model_len, wheres[i], "prompt")
               for i, p in enumerate(prompts) if not isinstance(p, str)}
    limit, total = state.max_request_tokens, sum(len(ids) for ids in checked.values())
    check_request_tokens(total, limit, "prompt")
    prompt_ids, texts = [], []
    for i, p in enumerate(prompts):
        ids = checked.get(i)
        if ids is None:
            assert isinstance(p, str)
            ids = tokenizer.encode(p)
            total += len(ids)
            check_request_tokens(total, limit, "prompt")
        prompt_ids.append(ids)
        texts.append(None if not echo else p if isinstance(p, str) else tokenizer.decode(ids))
    if params.structured is not None:
        validate_structured(params.structured)
    return prompt_ids, texts


def completion_response(gen: Generation, head: ResponseHead, texts: TokenTexts, logprobs: Optional[int],
                        echo: list[Optional[str]]) -> P.CompletionResponse:
    """The whole (non-streamed) response of a finished Generation."""
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
                    first, _ = completion_logprobs(
                        texts.entries([], out.prompt_token_ids, out.prompt_logprobs, None), 0)
                    lp = P.CompletionLogprobs(tokens=first.tokens + lp.tokens,
                                              token_logprobs=first.token_logprobs + lp.token_logprobs,
                                              top_logprobs=first.top_logprobs + lp.top_logprobs,
                                              text_offset=first.text_offset + lp.text_offset)
            choices.append(P.CompletionChoice(index=d.index, text=(prompt_text or "") + d.text, logprobs=lp,
                                              finish_reason=d.finish_reason, stop_reason=stop_reason(d.stop_reason)))
    choices.sort(key=lambda c: c.index)
    return P.CompletionResponse(id=head.id, created=head.created, model=head.model, choices=choices,
                                usage=gen.usage(), llmrt=request_timing(gen.latest))


async def create_completion(state: ServerState, req: P.CompletionRequest, request: Request) -> Any:
    """Answer one completions request (JSON, or SSE with `stream`)."""
    reject_lone_surrogates(req)
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
    head = start_response(state, request, "cmpl", req, params.max_tokens)
    tokenizer = state.tokenizer
    prompt_ids, echo = await state.offload.run(prepare_prompts, state, prompts, bool(req.echo), params)
    texts = TokenTexts(tokenizer, as_ids=bool(req.return_tokens_as_token_ids))
    gen = Generation(state.engine, prompt_ids, params, head.id, priority=req.priority or 0, user=req.user,
                     timeout=req.timeout, default_timeout=state.default_timeout, stream=bool(req.stream))
    stream = None
    if req.stream:
        stream = CompletionStream(head, bool(req.stream_options and req.stream_options.include_usage),
                                  texts=texts, logprobs=req.logprobs, echo=echo)
    return await respond(request, gen, stream,
                         lambda: completion_response(gen, head, texts, req.logprobs, echo))
