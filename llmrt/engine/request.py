"""Request / Sequence state: a request owns n samples (sequences); the scheduler moves sequences."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from llmrt.engine.messages import FinishReason, StopReason
from llmrt.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV freed, to be recomputed
    FINISHED = "finished"


@dataclass
class Request:
    """One submitted prompt and its sampling settings; its samples fork from sequence 0 after prefill."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_tokens: int  # resolved: params.max_tokens or what max_model_len leaves
    priority: int = 0  # lower runs first under the priority policy
    generators: list[Optional[torch.Generator]] = field(default_factory=list, repr=False)
    sequences: list["Sequence"] = field(default_factory=list, repr=False)
    forked: bool = False  # whether samples 1..n-1 exist yet
    first_scheduled_time: Optional[float] = None
    num_preemptions: int = 0
    deadline: Optional[float] = None  # time.monotonic() instant after which the request is dropped
    prompt_logprobs: Optional[list] = None  # [None, {token: logprob, ...}, ...] when params.prompt_logprobs is set
    arrival_order: int = 0  # set by the scheduler: ties between policies' ranks break by arrival
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the first admission
    user: Optional[str] = None  # the OpenAI `user` field: the fair policy shares tokens across users
    spec_proposed: int = 0  # speculative tokens proposed for it, and those the target accepted
    spec_accepted: int = 0
    grammar: Any = None  # the SequenceGrammar sample 0 starts with, when params.structured is set

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has nothing before it

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    def is_finished(self) -> bool:
        """True when every sample exists and has finished."""
        return len(self.sequences) == self.params.n and all(s.is_finished for s in self.sequences)


@dataclass(eq=False)
class Sequence:
    """One sample: its tokens (prompt + output), how many have KV computed, and its blocks."""

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[FinishReason] = None
    stop_reason: StopReason = None
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # prefix-cache names of full blocks
    num_cached_blocks: int = 0  # leading blocks already named in the prefix cache
    host_block_ids: list[int] = field(default_factory=list)  # swapped out: where its KV waits in host memory
    queued_at_step: int = 0  # the scheduler step it last joined the waiting queue (aging)
    grammar: Any = None  # its SequenceGrammar (llmrt.structured), advanced with every sampled token
    spec_token_ids: list[int] = field(default_factory=list)  # proposals for its next step (speculative decoding)
    spec_acceptance: float = 1.0  # moving average of the share of its proposals the target accepted
    spec_step: int = -1  # the scheduler step its proposals were made in (only the next step may use them)

    @property
    def is_swapped(self) -> bool:
        """True while its KV lives in host memory (preempted by swap)."""
        return bool(self.host_block_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens so far."""
        return self.token_ids[self.request.num_prompt_tokens:]

    @property
    def params(self) -> SamplingParams:
        """The request's sampling settings."""
        return self.request.params

    @property
    def generator(self) -> Optional[torch.Generator]:
        """This sample's seeded generator, if the request has a seed."""
        gens = self.request.generators
        return gens[self.index] if gens else None

    @property
    def is_finished(self) -> bool:
        """True once a finish reason is set."""
        return self.status is SequenceStatus.FINISHED
