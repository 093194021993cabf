"""SamplingParams: every per-request generation knob, validated once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from llmrt.errors import InvalidRequestError
from llmrt.structured.spec import StructuredOutputs

_MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Per-request generation settings, shaped like vLLM's."""

    n: int = 1
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrained decoding: the output must match this (a dict of StructuredOutputs fields is accepted too).
    structured: Optional[StructuredOutputs] = None
    # Speculative decoding, when the engine has it on: False opts this request out (it is never proposed for).
    speculative: bool = True

    # Filled in by the engine from the model, not by the user.
    eos_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured, dict):
            self.structured = StructuredOutputs(**self.structured)
        self.validate()

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}: {msg}", param=param)

        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            raise bad("n", f"must be an integer in [1, 128], got {self.n!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if not 0.0 <= self.temperature <= 2.0 or self.temperature != self.temperature:
            raise bad("temperature", f"must be in [0, 2], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= _MAX_LOGPROBS):
                raise bad(name, f"must be an integer in [0, {_MAX_LOGPROBS}], got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "every stop sequence must be a non-empty string")
        if len(self.stop) > 16:
            raise bad("stop", f"at most 16 stop sequences, got {len(self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or tok < 0:
                    raise bad("logit_bias", f"keys must be token ids, got {tok!r}")
                if not -100.0 <= float(bias) <= 100.0:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {bias!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutputs):
                raise bad("structured", f"must be a StructuredOutputs, got {type(self.structured).__name__}")
            # A grammar ends only at EOS, so EOS must stay allowed wherever the grammar may end.
            if self.ignore_eos:
                raise bad("ignore_eos", "cannot be combined with structured output (a grammar ends at EOS)")
            if self.min_tokens:
                raise bad("min_tokens", "cannot be combined with structured output (a grammar ends at EOS)")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature < 1e-5
