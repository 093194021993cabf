"""The xgrammar backend: compiles StructuredOutputs against the model's vocabulary (cached by key) and gives
each constrained sequence its own GrammarMatcher, which fills that sequence's row of the step's token bitmask."""
from __future__ import annotations

import functools
import importlib
import logging
import re
import threading
from typing import TYPE_CHECKING, Any, Optional

import torch

from llmrt.errors import InvalidRequestError
from llmrt.structured.spec import StructuredOutputs

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


@functools.cache
def _xgr() -> Any:
    """xgrammar, imported on first use: it pulls in transformers and torch._dynamo (seconds at start-up)
    that a request without a constraint never needs. Cached: the bitmask calls of every decode step use it."""
    return importlib.import_module("xgrammar")


_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[17:52:06] /project/cpp/x.cc:94: " on compiler errors
_CACHE_LIMIT = 256  # compiled grammars kept; the oldest goes first
# JSON string characters as xgrammar 0.2.9 writes them: length-bounded strings let control characters through,
# and both kinds let UTF-16 surrogates through (invalid UTF-8, decoded as U+FFFD).
_XGRAMMAR_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n\ud800-\udfff]'


def compiler_message(error: Exception) -> str:
    """The compiler's own message, without xgrammar's C++ source location."""
    return _CPP_PREFIX.sub("", str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)


def _grammar_error(spec: StructuredOutputs, error: Exception) -> InvalidRequestError:
    return InvalidRequestError(f"{spec.param}: the {spec.kind} constraint does not compile: {compiler_message(error)}",
                               param=spec.param)


def json_schema_grammar(schema_text: str, strict_mode: bool = True) -> xgr.Grammar:
    """The grammar of a JSON schema: fixed separators and no free whitespace, so that bounded schemas give
    bounded outputs."""
    grammar = _xgr().Grammar.from_json_schema(schema_text, any_whitespace=False, strict_mode=strict_mode)
    text = fixed = str(grammar)
    for loose in _XGRAMMAR_STRING_CHARS:  # JSON forbids raw control characters; UTF-8 has no surrogates
        fixed = fixed.replace(loose, _JSON_STRING_CHAR)
    return grammar if fixed == text else _xgr().Grammar.from_ebnf(fixed)


# Constraints validate_structured passed: the server checks them on a worker thread, and AsyncLLM.generate
# checks them again on the event loop, where a second compile of a large schema would stall the loop.
_validated: dict[tuple[str, str], None] = {}
_validated_lock = threading.Lock()


def validate_structured(spec: StructuredOutputs) -> None:
    """Check that a constraint compiles, without a vocabulary (fast; for the front end before queueing)."""
    key = spec.key()
    with _validated_lock:
        if key in _validated:
            return
    _check_compiles(spec)
    with _validated_lock:
        if len(_validated) >= _CACHE_LIMIT:
            _validated.pop(next(iter(_validated)))
        _validated[key] = None


def _check_compiles(spec: StructuredOutputs) -> None:
    kind = spec.kind
    try:
        if kind == "json":
            json_schema_grammar(spec.json_schema_text or "")
        elif kind == "regex":
            _xgr().Grammar.from_regex(spec.regex or "")
        elif kind in ("grammar", "choice"):
            _xgr().Grammar.from_ebnf(spec.grammar if kind == "grammar" else spec.ebnf() or "")
    except InvalidRequestError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
        raise _grammar_error(spec, e) from None


class SequenceGrammar:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher):
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next (EOS only where the grammar may end) into `bitmask[row]`."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the state is unchanged)."""
        return bool(self.matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative proposals checked tentatively)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fork(self) -> "SequenceGrammar":
        """An independent copy at the same position (for n > 1 samples)."""
        return SequenceGrammar(self.matcher.fork())

    @property
    def is_terminated(self) -> bool:
        """True once the grammar has ended with a stop token."""
        return bool(self.matcher.is_terminated())


class StructuredBackend:
    """Compiles constraints for one model: its tokenizer's vocabulary, padded to the model's vocab size, with
    the engine's EOS ids as the tokens that end a grammar. The tokenizer loads on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        """`tokenizer`: a HF tokenizer, an llmrt Tokenizer, or the path of a directory to load one from, used
        only when the first constraint compiles."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: Optional[xgr.GrammarCompiler] = None
        self._cache: dict[tuple[str, str], xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        """The GrammarCompiler over this model's vocabulary (built on first use)."""
        if self._compiler is None:
            tok = self._tokenizer
            if isinstance(tok, str):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(tok)
            elif getattr(tok, "hf", None) is not None:  # an llmrt Tokenizer: its HF tokenizer loads now
                tok = tok.hf
            info = _xgr().TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = _xgr().GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec` (from the cache when seen before); InvalidRequestError if it cannot be."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                return hit
            compiled = self._compile(spec)
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
            return compiled

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        c, kind = self.compiler, spec.kind
        try:
            if kind == "json":
                return c.compile_grammar(json_schema_grammar(spec.json_schema_text or ""))
            if kind == "json_object":
                return c.compile_grammar(json_schema_grammar('{"type": "object"}', strict_mode=False))
            if kind == "regex":
                return c.compile_regex(spec.regex or "")
            return c.compile_grammar(spec.grammar if kind == "grammar" else spec.ebnf() or "")
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the compiler's message
            raise _grammar_error(spec, e) from None

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> SequenceGrammar:
        """A matcher at the start of `compiled`."""
        return SequenceGrammar(_xgr().GrammarMatcher(compiled))


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab_size / 32)] int32 on the CPU, every token allowed."""
    return _xgr().allocate_token_bitmask(rows, vocab_size)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf in `rows`, in place (xgrammar's kernel; CPU or CUDA)."""
    mask = bitmask if bitmask.device == logits.device else bitmask.to(logits.device, non_blocking=True)
    _xgr().apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[-1], indices=rows)
