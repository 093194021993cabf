"""What crosses the boundary between the API side and the engine core: one definition of each message.

The front end (`AsyncLLM`, or `LLM` in-process) sends `AddRequest` / `AbortRequest` / `FinishSequence` /
`InjectFault` / `Shutdown`; the core answers `CoreReady` or `CoreFailed` once, then a `StepResult` after every
step (and after a batch of messages that produced outputs without a step), and `RequestRejected` for a request
it refused. Nothing here depends on the scheduler or the model: the text side imports only this module.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from llmrt.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a sample ended; compares equal to its string value ("stop" == FinishReason.STOP)."""

    STOP = "stop"  # EOS, a stop token id, or (front end) a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # the client went away, or the request was cancelled
    DEADLINE = "deadline"  # the request's timeout passed
    ERROR = "error"  # the core could not run it (stop_reason holds the error code)

    def __str__(self) -> str:
        return self.value


# A stop token id, an error code (finish reason ERROR), or a stop string (set by the front end).
StopReason = Union[int, str, None]


@dataclass
class EngineCoreOutput:
    """What one step produced for one sample: its new tokens and, if it ended, why."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: Optional[list[dict[int, float]]] = None
    finish_reason: Optional[FinishReason] = None
    stop_reason: StopReason = None
    first_scheduled_time: Optional[float] = None
    num_preemptions: int = 0
    timestamp: float = field(default_factory=time.monotonic)
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None  # with a request's first token
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied (with a request's first token)
    spec_proposed: int = 0  # the request's speculative proposals so far, and those accepted (cumulative)
    spec_accepted: int = 0


@dataclass
class EngineStats:
    """A snapshot of the engine core for admission control, health and debugging."""

    num_running: int
    num_waiting: int
    waiting_tokens: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_steps: int
    last_step_tokens: int
    num_preemptions: int  # cumulative
    last_step_seqs: int = 0
    num_preempted: int = 0  # waiting sequences that were preempted and wait to be recomputed
    # Cumulative prompt tokens looked up in the prefix cache, and those found there.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # Speculative decoding, cumulative: proposals verified and accepted at each draft position, spans that
    # verified proposals, and seconds spent making proposals. Empty lists while it is off.
    spec_method: Optional[str] = None
    spec_proposed_by_position: list[int] = field(default_factory=list)
    spec_accepted_by_position: list[int] = field(default_factory=list)
    spec_verify_steps: int = 0
    spec_propose_seconds: float = 0.0
    # Tensor parallelism, cumulative over steps: rank 0's time inside collectives per step as histogram counts
    # (upper bounds: parallel_state.COLLECTIVE_BUCKETS), its sum, the steps, the executor's time in those steps,
    # the bytes rank 0 put into collectives and the tokens those steps computed. Empty/zero with one rank.
    collective_bucket_counts: list[int] = field(default_factory=list)
    collective_seconds: float = 0.0
    collective_steps: int = 0
    collective_step_seconds: float = 0.0
    collective_bytes: int = 0
    collective_tokens: int = 0
    # Pipeline parallelism, cumulative over steps, per stage: seconds waiting for another stage (the bubble) and
    # seconds in the step in all, and the steps that reported. Empty/zero with one stage.
    pipeline_wait_seconds: list[float] = field(default_factory=list)
    pipeline_stage_seconds: list[float] = field(default_factory=list)
    pipeline_steps: int = 0

    @classmethod
    def idle(cls, num_blocks: int) -> "EngineStats":
        """The figures of an engine that has not stepped yet."""
        return cls(0, 0, 0, num_blocks, num_blocks, 0, 0, 0)


@dataclass
class EngineLimits:
    """The numbers a request is checked against."""

    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    max_num_seqs: int
    eos_token_ids: list[int]


# -- front end -> core ---------------------------------------------------------------------------------------
@dataclass
class AddRequest:
    """A tokenized request for the core to validate and queue."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    deadline: Optional[float] = None  # a time.monotonic() instant
    user: Optional[str] = None


@dataclass
class AbortRequest:
    """Stop a request now and free its blocks."""

    request_id: str


@dataclass
class FinishSequence:
    """End one sample: the front end matched a stop string."""

    request_id: str
    index: int


@dataclass
class InjectFault:
    """Test hook: stall the next step, slow every step, crash the core, or fail the next step with out-of-memory."""

    kind: str  # one of FAULT_KINDS
    seconds: float = 0.0


@dataclass
class Shutdown:
    """Stop the core process."""


FAULT_KINDS = ("stall", "crash", "oom", "slow")  # slow: every later step sleeps `seconds` (0: off)
CoreRequest = Union[AddRequest, AbortRequest, FinishSequence, InjectFault, Shutdown]


# -- core -> front end ---------------------------------------------------------------------------------------
@dataclass
class CoreReady:
    """The model is loaded and the KV cache sized."""

    limits: EngineLimits
    memory: Any  # MemoryPlan


@dataclass
class CoreFailed:
    """Start-up failed; the front end re-raises the error."""

    error: BaseException


@dataclass
class StepResult:
    """A step's outputs and the stats after it.

    `acknowledged` names every request the core took in (queued or refused) since its previous message: the
    stats include the queued ones, so the front end counts as pending only requests not yet acknowledged.
    """

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    core_time: float  # time.monotonic() in the core when the message was made
    acknowledged: list[str] = field(default_factory=list)


@dataclass
class RequestRejected:
    """The core refused a request (it changed nothing)."""

    request_id: str
    error: Exception


CoreMessage = Union[CoreReady, CoreFailed, StepResult, RequestRejected]
