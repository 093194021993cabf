"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of the sequence's
own last n tokens, n from ngram_max down to ngram_min. No model, no state."""
from __future__ import annotations

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
        total = len(tokens)
        last = tokens[-1]
        # Every match ends at an earlier occurrence of the last token: find those with list.index (C speed;
        # usually few), then see how far back each keeps matching. This runs for every sequence every step,
        # so it avoids per-call array conversions, which cost more than the search itself.
        ends, i = [], -1
        try:
            while True:
                i = tokens.index(last, i + 1, total - 1)
                ends.append(i)
        except ValueError:
            pass
        cap = min(self.max_n, total - 1)
        best, best_end = 0, -1
        for end in reversed(ends):  # latest first: a later match wins a tie
            n = 1
            while n < cap and n <= end and tokens[end - n] == tokens[total - 1 - n]:
                n += 1
            if n > best:
                best, best_end = n, end
                if n == cap:
                    break
        if best < self.min_n:
            return []
        return list(tokens[best_end + 1:best_end + 1 + k])
