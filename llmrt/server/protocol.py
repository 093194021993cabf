"""The OpenAI protocol as pydantic models: request bodies, responses, stream chunks and the error body.

Request models are strict (no "5" for 5, no true for 1) and ignore fields they do not know, as OpenAI's own
clients send a few this server has no use for. Ranges are checked once, by `SamplingParams`, which names the
bad field; the descriptions here say what it accepts.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors -----------------------------------------------------------------------------------------------
class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = Field(None, description="the request field at fault, e.g. `messages[0].content`")
    code: str
    retryable: bool = Field(..., description="whether the same request can succeed later (or elsewhere); the "
                                             "same value as the body's top-level `retryable`")


class ErrorResponse(_Response):
    """Every failure: OpenAI's error object plus whether retrying the same request can succeed."""

    error: ErrorInfo
    retryable: bool


# -- shared request parts -----------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: Optional[bool] = Field(False, description="add a last chunk (with empty choices) carrying usage")


class ResponseFormat(_Request):
    """OpenAI's response_format: text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[dict[str, Any]] = Field(
        None, description='for json_schema: {"name": ..., "schema": {...}, "strict": ...}')


class StructuredOutputsRequest(_Request):
    """vLLM's structured_outputs extra: exactly one of json, regex, grammar (EBNF), choice, json_object."""

    json_schema: Union[dict[str, Any], str, None] = Field(None, alias="json", description="a JSON schema")
    regex: Optional[str] = None
    grammar: Optional[str] = Field(None, description="an EBNF grammar (GBNF dialect) with a `root` rule")
    choice: Optional[list[str]] = Field(None, description="the output is one of these strings")
    json_object: Optional[bool] = Field(None, description="any JSON object")


class _SamplingFields(_Request):
    """Fields both completion endpoints share; names and meanings as OpenAI's, extras as vLLM's."""

    model: Optional[str] = Field(None, description="the served model name (GET /v1/models); omitted: that model")
    temperature: Optional[float] = Field(None, description="[0, 2]; 0 is greedy (default 1)")
    top_p: Optional[float] = Field(None, description="nucleus mass in (0, 1] (default 1)")
    n: Optional[int] = Field(None, description="samples per prompt, [1, 128] and at most the server's max-num-seqs")
    stream: Optional[bool] = Field(False, description="send server-sent events, ending with `data: [DONE]`")
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = Field(None, description="up to 16 stop strings, not included in the text")
    seed: Optional[int] = Field(None, description="the same seed and parameters give the same text")
    presence_penalty: Optional[float] = Field(None, description="[-2, 2]")
    frequency_penalty: Optional[float] = Field(None, description="[-2, 2]")
    logit_bias: Optional[dict[str, float]] = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit")
    user: Optional[str] = Field(None, description="an end-user id, logged; the fair scheduling policy shares "
                                                  "tokens across users")
    # extensions
    top_k: Optional[int] = Field(None, description="sample among the k likeliest; 0 or -1 is off")
    min_p: Optional[float] = Field(None, description="[0, 1]: drop tokens under min_p x the top probability")
    repetition_penalty: Optional[float] = Field(None, description="(0, 10]; HF-style, 1 is off")
    min_tokens: Optional[int] = Field(None, description="generate at least this many tokens before EOS or a stop")
    ignore_eos: Optional[bool] = Field(False, description="keep generating past the end-of-sequence token")
    stop_token_ids: Optional[list[int]] = Field(None, description="token ids that end a sample")
    skip_special_tokens: Optional[bool] = Field(True, description="leave special tokens out of the text")
    include_stop_str_in_output: Optional[bool] = Field(False, description="keep the matched stop string in the text")
    speculative: Optional[bool] = Field(True, description="false: never verify speculative proposals for this "
                                                          "request (the output distribution is the same either way)")
    priority: Optional[int] = Field(0, description="scheduling priority (used by priority scheduling policies)")
    timeout: Optional[float] = Field(
        None, description="seconds this request may take in all; past it the request fails with 408 "
                          "deadline_exceeded (default: the server's --request-timeout)")
    response_format: Optional[ResponseFormat] = Field(
        None, description='{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}: '
                          "the output is valid by construction (constrained decoding)")
    structured_outputs: Optional[StructuredOutputsRequest] = Field(
        None, description="constrain the output to a JSON schema, regex, EBNF grammar or choice (vLLM's names)")
    return_tokens_as_token_ids: Optional[bool] = Field(
        None, description="with logprobs: name every token (sampled, alternatives, echoed prompt) `token_id:<id>` "
                          "instead of its text, so tokens that are not valid UTF-8 on their own stay identifiable "
                          "(vLLM's extension)")


# -- completions ----------------------------------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]] = Field(
        ..., description="a string, a list of strings, token ids, or a list of token-id lists")
    max_tokens: Optional[int] = Field(16, description="most tokens to generate per sample (default 16); null: "
                                                      "what the context leaves")
    echo: Optional[bool] = Field(False, description="put the prompt in front of each completion")
    logprobs: Optional[int] = Field(None, description="[0, 20]: log probabilities of the sampled tokens and of "
                                                      "this many likeliest alternatives")
    suffix: Optional[str] = Field(None, description="not supported: insertion is not implemented")
    best_of: Optional[int] = Field(None, description="only best_of == n is supported")


class CompletionLogprobs(_Response):
    """OpenAI's legacy logprobs object."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = Field(None, description="stop (EOS or a stop string) or length")
    stop_reason: Union[int, str, None] = Field(None, description="the stop string or token id that ended the sample")


class PromptTokensDetails(_Response):
    cached_tokens: int = Field(0, description="prompt tokens whose KV the prefix cache supplied")


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class RequestTiming(_Response):
    """llmrt's extension object: where the time of this request went (seconds) and what it reused."""

    queue_time: Optional[float] = Field(None, description="arrival to the first scheduled engine step")
    ttft: Optional[float] = Field(None, description="time to first token: arrival to the first sampled token")
    tpot: Optional[float] = Field(None, description="mean time per output token after the first")
    e2e: Optional[float] = Field(None, description="arrival to finish")
    cached_tokens: int = Field(0, description="prompt tokens served from the prefix cache")
    preemptions: int = Field(0, description="times a sample was preempted and recomputed")
    spec_proposed: int = Field(0, description="speculative proposals verified for this request")
    spec_accepted: int = Field(0, description="speculative proposals accepted (each one a token without its "
                                              "own step)")


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    llmrt: Optional[RequestTiming] = None
    system_fingerprint: Optional[str] = None


class CompletionStreamResponse(_Response):
    """One server-sent event of a streamed completion; `text` is the delta."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    llmrt: Optional[RequestTiming] = Field(None, description="on the final chunk only")
    system_fingerprint: Optional[str] = None


# -- chat -------------------------------------------------------------------------------------------------------
class ContentPart(_Request):
    """A part of a message's content; only {"type": "text", "text": ...} is supported."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(_Request):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="the conversation, rendered with the "
                                                                      "model's chat template")
    max_tokens: Optional[int] = Field(None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: Optional[int] = Field(None, description="most tokens to generate per choice (default: "
                                                                   "what the context leaves)")
    logprobs: Optional[bool] = Field(False, description="return log probabilities of the sampled tokens")
    top_logprobs: Optional[int] = Field(None, description="[0, 20] likeliest alternatives per token; needs logprobs")
    add_generation_prompt: Optional[bool] = Field(True, description="end the rendered chat with the assistant's "
                                                                    "turn header")
    tools: Optional[list[dict[str, Any]]] = Field(None, description='functions the model may call: '
                                                   '[{"type": "function", "function": {"name", "parameters"}}]')
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = Field(
        None, description="none, auto (the model's own format, read by the server's tool-call parser), required "
                          "(arguments generated under the schema), or {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}; default auto with tools, none without")
    parallel_tool_calls: Optional[bool] = Field(True, description="with required: allow more than one call")


class FunctionCall(_Response):
    name: str
    arguments: str = Field(..., description="the arguments as JSON text")


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="present only when the model called tools")

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = Field(None, description="stop (EOS or a stop string), length, or tool_calls")
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    llmrt: Optional[RequestTiming] = None
    system_fingerprint: Optional[str] = None


class DeltaFunctionCall(_Response):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Response):
    """A piece of a tool call: the first carries id, type and name; later ones more of the arguments."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None


class DeltaMessage(_Response):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionStreamResponse(_Response):
    """One server-sent event of a streamed chat completion: the role first, then content deltas."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None
    llmrt: Optional[RequestTiming] = Field(None, description="on the final chunk only")
    system_fingerprint: Optional[str] = None


class StreamErrorEvent(_Response):
    """A failure after a stream started: one event like this, then `data: [DONE]`."""

    error: ErrorInfo
    retryable: bool


# -- models, tokenizer, health ---------------------------------------------------------------------------------
class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmrt"
    root: Optional[str] = None
    max_model_len: Optional[int] = None
    model_version: Optional[str] = None  # --model-version, or a hash of the checkpoint and llmrt's version


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """POST /tokenize: give `prompt` or `messages`."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = Field(True, description="for prompt: add BOS and the like")
    add_generation_prompt: Optional[bool] = Field(True, description="for messages: end with the assistant header")


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class HealthResponse(_Response):
    status: Literal["ok", "unhealthy"]
    reason: Optional[str] = None


class VersionResponse(_Response):
    version: str
    model_version: Optional[str] = None
    formats: Optional[dict[str, Any]] = Field(None, description="weight/KV formats and how the device computes them")


class FaultRequest(_Request):
    """POST /debug/fault (debug endpoints only)."""

    kind: Literal["stall", "crash", "oom", "slow"]
    seconds: Optional[float] = Field(0.0, description="for stall: how long the next engine step sleeps; for slow: "
                                                      "how long every later step sleeps (0: off)")


class FaultResponse(_Response):
    status: Literal["injected"] = "injected"
    kind: str
    seconds: float


STREAM_MODELS: tuple[type[BaseModel], ...] = (CompletionStreamResponse, ChatCompletionStreamResponse,
                                              StreamErrorEvent)
