"""Request -> engine inputs: SamplingParams from a request's knobs, the prompts of a completion, chat messages."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

from llmrt.errors import InvalidRequestError, UnsupportedError
from llmrt.sampling_params import SamplingParams
from llmrt.server import protocol as P
from llmrt.structured.spec import StructuredOutputs

Prompt = Union[str, list[int]]


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

