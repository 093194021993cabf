"""The scheduler's side of speculative decoding: how many proposals each decode verifies in a step."""
from __future__ import annotations

from llmrt.config import SpeculativeConfig
from llmrt.engine.kv_cache import BlockManager
from llmrt.engine.request import Sequence, SequenceStatus


class SpeculationPlanner:
    """Decides per step and per sequence how many of the proposals made in the previous step are verified."""

    def __init__(self, config: SpeculativeConfig, block_manager: BlockManager, max_model_len: int):
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len

    def share(self, decodes: list[Sequence], prefills: list[Sequence], free_slots: int, budget: int) -> int:
        """Proposals each decode may verify this step. Verifying costs little while a step is memory-bound
        (few tokens); once the step's own tokens reach speculative_max_batch_tokens it is compute-bound and
        nothing is proposed. The room left below that bound is shared evenly by the decodes.

        The step's own tokens are its decodes and the prefill work it can take: running chunks, and waiting
        sequences only as many as there are free batch slots (the rest cannot join this step)."""
        if not decodes:
            return 0
        limit = min(self.config.speculative_max_batch_tokens, budget)
        tokens = len(decodes)
        for s in prefills:
            if s.status is not SequenceStatus.RUNNING:
                if free_slots <= 0:
                    continue
                free_slots -= 1
            tokens += s.num_tokens - s.num_computed_tokens
            if tokens >= limit:
                return 0
        return (limit - tokens) // len(decodes)

    def worth_proposing(self, num_running: int, budget: int) -> bool:
        """Whether the next step may verify proposals: not when the running sequences' decodes alone reach
        the bound (then proposing would be work thrown away, every step, for every sequence)."""
        return num_running < min(self.config.speculative_max_batch_tokens, budget)

    def drafts(self, seq: Sequence, room: int, step: int) -> list[int]:
        """The proposals `seq` verifies at `step`: those made in the previous step, as many as its acceptance
        rate makes worth it (the j-th proposal pays while acceptance^j >= 1/4; always at least one, so the
        rate keeps being measured), within its max_tokens and the context."""
        if not seq.spec_token_ids or seq.spec_step != step - 1 or not seq.params.speculative:
            return []
        worth, a = 1, seq.spec_acceptance
        while worth < len(seq.spec_token_ids) and a ** (worth + 1) >= 0.25:
            worth += 1
        left = min(seq.request.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
        k = min(room, worth, left, len(seq.spec_token_ids))
        if k <= 0 or not self.block_manager.can_allocate(seq, 1 + k):
            return []  # proposals never cost a preemption
        return seq.spec_token_ids[:k]

    def lookahead(self, seq: Sequence, n: int) -> int:
        """Extra slots for a draft model's proposals after this step, when they are free to take."""
        extra = self.config.lookahead_slots
        return extra if extra and self.block_manager.can_allocate(seq, n + extra) else 0

    @staticmethod
    def count_acceptance(seq: Sequence, proposed: int, accepted: int) -> None:
        """Fold one verification into the sequence's acceptance estimate and its request's counters."""
        seq.spec_acceptance = 0.7 * seq.spec_acceptance + 0.3 * (accepted / proposed)
        seq.request.spec_proposed += proposed
        seq.request.spec_accepted += accepted
