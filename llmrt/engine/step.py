"""What one step carries between the scheduler and the executor: the schedule in, the sampled tokens out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from llmrt.distributed.pipeline import StageTimes
    from llmrt.engine.request import Sequence


@dataclass
class ScheduledSequence:
    """A sequence's share of one step: how many new tokens, and how many samples to draw after them."""

    seq: "Sequence"
    num_new_tokens: int  # 1 + len(spec_token_ids) for a decode that verifies proposals
    num_samples: int  # 0 for a prefill chunk that does not reach the end of the known tokens
    spec_token_ids: list[int] = field(default_factory=list)  # proposals verified in this span, after its token


@dataclass
class SchedulerOutput:
    """What the executor runs this step."""

    scheduled: list[ScheduledSequence]
    block_copies: list[tuple[int, int]]
    num_batched_tokens: int
    num_preempted: int = 0
    # Block moves the workers do before the step, in this order: swap-outs, copies, swap-ins.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    propose: bool = False  # make speculative proposals for the next step (it may verify them)

    @property
    def is_empty(self) -> bool:
        """True when nothing runs this step."""
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Sampled tokens (and their logprobs) for each ScheduledSequence with num_samples > 0, in order."""

    # One list per item: its n samples' tokens, or, for a span with proposals, the accepted proposals and the
    # target's own next token (1 to k + 1 tokens of one sample).
    sampled_token_ids: list[list[int]]
    logprobs: Optional[list[list[dict[int, float]]]] = None
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)  # seq_id -> rows of a span
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> proposals for its next step
    spec: Optional["SpecStepStats"] = None
    # Tensor parallel: rank 0's time inside collectives this step and the bytes it sent into them.
    collective_seconds: float = 0.0
    collective_bytes: int = 0
    # Pipeline parallel: each stage's seconds waiting for another stage and in all this step (rank 0's first).
    stage_times: list["StageTimes"] = field(default_factory=list)


@dataclass
class SpecStepStats:
    """What speculation did in one step."""

    proposed_by_position: list[int]  # [k] proposals verified at each draft position
    accepted_by_position: list[int]  # [k] of which the target accepted
    num_verified_seqs: int = 0  # sequences whose span carried proposals
    propose_seconds: float = 0.0  # time spent making the next step's proposals


@dataclass
class StepInput:
    """What every rank needs to run one step's forward pass, in plain lists: rank 0 builds it from the
    SchedulerOutput and sends it to the other ranks as the step's one message."""

    input_ids: list[int]
    block_tables: list[list[int]]
    query_lens: list[int]
    seq_lens: list[int]
    num_decodes: int
    logits_rows: list[int]  # flat rows whose logits rank 0 needs: sampling, then prompt logprobs, then proposals
    # Block moves rank 0 made since the previous message, one per step, done first and in order.
    block_moves: list["BlockMoves"] = field(default_factory=list)

    def positions(self) -> torch.Tensor:
        """Each new token's position, sequence by sequence: a span of q new tokens ending at length s holds
        positions s - q .. s - 1 (derived, so the step's message does not carry them)."""
        if len(self.input_ids) == len(self.query_lens):  # one new token per sequence: each at its length - 1
            return torch.tensor([s - 1 for s in self.seq_lens], dtype=torch.long)
        q = torch.tensor(self.query_lens, dtype=torch.long)
        first = torch.tensor(self.seq_lens, dtype=torch.long) - q
        starts = torch.cumsum(q, 0) - q
        return torch.arange(int(q.sum())) + torch.repeat_interleave(first - starts, q)


@dataclass
class BlockMoves:
    """One step's block moves (the same fields as SchedulerOutput's): swap-outs, copies, swap-ins."""

    swap_out: list[tuple[int, int]]
    block_copies: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
