"""Token texts and the two logprobs formats (legacy completions, chat)."""
from __future__ import annotations

from typing import Optional, Sequence

from llmrt.server import protocol as P
from llmrt.tokenizer import Tokenizer

CONTEXT_TOKENS = 4  # tokens of left context when turning one token id into its text (leading spaces)
_MIN_LOGPROB = -9999.0  # -inf is not JSON


class TokenTexts:
    """The text one token adds after its left context (so that leading spaces survive)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def entries(self, context: Sequence[int], token_ids: Sequence[int],
                logprobs: Optional[Sequence[Optional[dict[int, float]]]], top: Optional[int]
                ) -> list[tuple[str, Optional[float], list[tuple[str, float]]]]:
        """(token text, its logprob, [(alternative text, logprob)] best first) for each token."""
        ctx = list(context[-CONTEXT_TOKENS:])
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
            ctx = (ctx + [tid])[-CONTEXT_TOKENS:]
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

