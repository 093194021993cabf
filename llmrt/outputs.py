"""What a request returns: RequestOutput with one CompletionOutput per sample, and its timings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# token id -> logprob for the top-N candidates (the sampled token is always included)
Logprobs = dict[int, float]


@dataclass
class RequestMetrics:
    """Per-request timings (seconds, time.monotonic clock) and counts."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # over all samples
    num_generation_steps: int = 0  # tokens of the longest sample
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    spec_proposed: int = 0  # speculative proposals verified for the request, and those accepted
    spec_accepted: int = 0
    # Gaps (seconds) between the engine steps that gave sample 0 new tokens: the inter-token latencies.
    inter_token_latencies: list[float] = field(default_factory=list)
    sample0_last_token_time: Optional[float] = None

    @property
    def preempted(self) -> bool:
        """Whether any sample of the request was preempted and recomputed."""
        return self.num_preemptions > 0

    @property
    def queue_time(self) -> Optional[float]:
        """Arrival to first scheduled step."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: arrival to the first sampled token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_steps < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_steps - 1)

    @property
    def e2e(self) -> Optional[float]:
        """Arrival to finish."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    def as_dict(self) -> dict[str, Optional[float]]:
        """A flat dict for logs and API extensions."""
        return {
            "queue_time": self.queue_time, "ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e,
            "prompt_tokens": self.num_prompt_tokens, "output_tokens": self.num_output_tokens,
            "cached_tokens": self.num_cached_tokens, "preemptions": self.num_preemptions,
            "spec_proposed": self.spec_proposed, "spec_accepted": self.spec_accepted,
        }


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[Logprobs]] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: Optional[object] = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        """True once the sample has a finish reason."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its samples so far (or final)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: Optional[list[Optional[Logprobs]]] = None
    error: Optional[Exception] = field(default=None, repr=False)
