"""Token texts and the two logprobs formats (legacy completions, chat)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from llmrt.server import protocol as P
from llmrt.tokenizer import Tokenizer

CONTEXT_TOKENS = 4  # tokens of left context when turning one token id into its text (leading spaces)
_MIN_LOGPROB = -9999.0  # -inf is not JSON


def token_id_name(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids` rendering of a token: `token_id:<id>`."""
    return f"token_id:{token_id}"


@dataclass
class TokenEntry:
    """One token of a logprobs object: how it is named, the text it adds, its logprob, its alternatives."""

    name: str  # what `token` says: the text, or `token_id:<id>` with return_tokens_as_token_ids
    text: str  # the text it adds to the output (offsets and the chat `bytes` always use this)
    logprob: Optional[float]
    alts: list[tuple[str, float]] = field(default_factory=list)  # (name, logprob), best first


class TokenTexts:
    """The text one token adds after its left context (so that leading spaces survive); with `as_ids`, tokens
    are named `token_id:<id>` (vLLM's `return_tokens_as_token_ids`), so a client gets the exact ids."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool = False):
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def entries(self, context: Sequence[int], token_ids: Sequence[int],
                logprobs: Optional[Sequence[Optional[dict[int, float]]]], top: Optional[int]) -> list[TokenEntry]:
        """Each token's entry, its alternatives best first (at most `top` of them)."""
        ctx = list(context[-CONTEXT_TOKENS:])
        out = []
        for k, tid in enumerate(token_ids):
            base = self.tokenizer.decode(ctx, False)
            lp = logprobs[k] if logprobs is not None and k < len(logprobs) else None
            alts: list[tuple[str, float]] = []
            if lp:
                ranked = sorted(lp.items(), key=lambda kv: -kv[1])
                for alt, alt_lp in ranked if top is None else ranked[:top]:
                    alts.append((self._name(ctx, base, alt), _finite(alt_lp)))
            text = self._text(ctx, base, tid)
            out.append(TokenEntry(token_id_name(tid) if self.as_ids else text, text,
                                  _finite(lp[tid]) if lp and tid in lp else None, alts))
            ctx = (ctx + [tid])[-CONTEXT_TOKENS:]
        return out

    def _name(self, ctx: list[int], base: str, tid: int) -> str:
        return token_id_name(tid) if self.as_ids else self._text(ctx, base, tid)

    def _text(self, ctx: list[int], base: str, tid: int) -> str:
        value = self.tokenizer.byte_values.get(tid)  # <0xNN>: part of a character, shown as OpenAI shows bytes
        if value is not None:
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


def completion_logprobs(entries: list[TokenEntry], offset: int,
                        with_top: bool = True) -> tuple[P.CompletionLogprobs, int]:
    """OpenAI's legacy logprobs object, and the text offset after it. `text_offset` counts the output text's
    characters even when tokens are named by id (vLLM counts the `token_id:<id>` names there)."""
    lp = P.CompletionLogprobs()
    for e in entries:
        lp.tokens.append(e.name)
        lp.token_logprobs.append(e.logprob)
        top: Optional[dict[str, float]] = None
        if with_top and e.logprob is not None:
            top = {}
            for alt, alt_lp in e.alts:  # best first; two tokens with the same text keep the better one
                top.setdefault(alt, alt_lp)
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)
        offset += len(e.text)
    return lp, offset


def chat_logprobs(entries: list[TokenEntry]) -> P.ChatChoiceLogprobs:
    """The chat format: one object per token with its top alternatives. As in vLLM, a token's `bytes` are those
    of its text, an alternative's those of its name (its `token_id:<id>` with return_tokens_as_token_ids)."""
    content = [P.ChatTokenLogprob(token=e.name, logprob=e.logprob if e.logprob is not None else _MIN_LOGPROB,
                                  bytes=token_bytes(e.text),
                                  top_logprobs=[P.ChatTopLogprob(token=t, logprob=v, bytes=token_bytes(t))
                                                for t, v in e.alts])
               for e in entries]
    return P.ChatChoiceLogprobs(content=content)

