"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of the sequence's
own last n tokens, n from ngram_max down to ngram_min. No model, no state."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from llmrt.config import SpeculativeConfig
from llmrt.spec_decode.base import ProposalInput, Proposer


class NgramProposer(Proposer):
    """Prompt-lookup decoding over the sequence's prompt and output."""

    name = "ngram"

    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.ngram_min, config.ngram_max

    def propose(self, inputs: list[ProposalInput]) -> list[list[int]]:
        return [self.lookup(inp.token_ids, inp.max_proposals) if inp.max_proposals > 0 else [] for inp in inputs]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier match of the longest suffix that has one."""
        arr = np.asarray(tokens, dtype=np.int64)
        total = len(arr)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. total-n-1: every earlier occurrence, the suffix itself excluded.
            windows = sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[total - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []
