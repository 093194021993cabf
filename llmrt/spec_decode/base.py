"""The proposer seam: something that guesses a sequence's next tokens cheaply, for the target to verify."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch

from llmrt.sampling_params import SamplingParams


@dataclass
class ProposalInput:
    """One sequence after a step: everything a proposer may read to guess what follows."""

    seq_id: int
    token_ids: list[int]  # prompt + output, this step's new tokens included
    num_prompt_tokens: int
    block_ids: list[int]  # its KV blocks (a draft model writes its own KV at the same slots)
    max_proposals: int  # bounded by num_speculative_tokens, max_tokens, the context and allocated slots
    params: SamplingParams
    generator: Optional[torch.Generator]


class Proposer(ABC):
    """Makes up to k proposals per sequence at the end of a step; the next step verifies them."""

    name: ClassVar[str]

    def observe_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_meta: Any) -> None:
        """See the target's forward batch (a draft model computes its own KV for the same tokens)."""

    @abstractmethod
    def propose(self, inputs: list[ProposalInput]) -> list[list[int]]:
        """Proposals for each input, at most its max_proposals each (possibly none)."""

    def draft_probs(self, seq_id: int) -> Optional[torch.Tensor]:
        """[k, V]: the distributions the latest proposals of `seq_id` were drawn from; None for a point mass."""
        return None

    def forget(self, live_seq_ids: set[int]) -> None:
        """Drop state kept for sequences not in `live_seq_ids`."""
