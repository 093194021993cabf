"""POST /tokenize and /detokenize: the tokenizer behind the same front door and the same offload pool."""
from __future__ import annotations

from llmrt.errors import InvalidRequestError
from llmrt.server import protocol as P
from llmrt.server.requests import chat_messages
from llmrt.server.state import ServerState
from llmrt.server.validation import check_request_tokens, reject_lone_surrogates


async def tokenize(state: ServerState, req: P.TokenizeRequest) -> P.TokenizeResponse:
    """Token ids of a prompt, or of messages rendered with the chat template."""
    reject_lone_surrogates(req)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if req.messages is not None and not req.messages:
        raise InvalidRequestError("messages: must not be empty", param="messages")
    tokens = await state.offload.run(_tokens, state, req)
    return P.TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=state.engine.max_model_len)


def _tokens(state: ServerState, req: P.TokenizeRequest) -> list[int]:
    tokenizer = state.tokenizer
    if req.prompt is not None:
        tokens = tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        assert req.messages is not None
        tokens = tokenizer.apply_chat_template(chat_messages(req.messages), req.add_generation_prompt is not False)
    check_request_tokens(len(tokens), state.max_request_tokens, "prompt" if req.prompt is not None else "messages")
    return tokens


async def detokenize(state: ServerState, req: P.DetokenizeRequest) -> P.DetokenizeResponse:
    """The text of token ids."""
    reject_lone_surrogates(req)
    state.check_model(req.model)
    check_request_tokens(len(req.tokens), state.max_request_tokens, "tokens")
    vocab = state.engine.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"tokens: token id {bad[0]} is out of the vocabulary [0, {vocab})",
                                  param="tokens")
    return P.DetokenizeResponse(prompt=await state.offload.run(state.tokenizer.decode, req.tokens))
