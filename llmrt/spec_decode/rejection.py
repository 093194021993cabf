"""Verification of proposals by rejection sampling (Leviathan et al. 2023; Chen et al. 2023): the accepted
tokens are distributed exactly as the target model's own samples."""
from __future__ import annotations

from typing import Optional

import torch


def verify(target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: Optional[torch.Tensor],
           greedy: bool, generator: Optional[torch.Generator]) -> tuple[list[int], int]:
    """Accept a prefix of the proposals and add one token of the target's; return (tokens, accepted count).

    `target_probs` [k + 1, V]: the distribution for the token after each prefix of the span (row j follows
    the span's first token and proposals 1..j). `draft_probs` [k, V]: the distributions the proposals were
    drawn from; None for a point mass (n-gram proposals, or a greedy draft). Proposal x at row j is accepted
    with probability min(1, p(x) / q(x)); at the first rejection the token is drawn from norm(max(0, p - q));
    when all are accepted, from the last row of p. Greedy rows accept exactly the target's argmax.
    """
    k = len(draft_token_ids)
    tokens: list[int] = []
    if greedy:
        best = target_probs.argmax(dim=-1).tolist()
        for j, x in enumerate(draft_token_ids):
            if x != best[j]:
                return tokens + [best[j]], j
            tokens.append(x)
        return tokens + [best[k]], k
    # One uniform per proposal, drawn up front from the sequence's own stream (reproducible with a seed).
    u = torch.rand(k, generator=generator, device=target_probs.device).tolist() if k else []
    p_at = target_probs[torch.arange(k, device=target_probs.device), torch.tensor(draft_token_ids, device=target_probs.device)].tolist() if k else []
    q_at = [1.0] * k if draft_probs is None else \
        draft_probs[torch.arange(k, device=draft_probs.device), torch.tensor(draft_token_ids, device=draft_probs.device)].tolist()
    for j, x in enumerate(draft_token_ids):
        if q_at[j] > 0 and u[j] < p_at[j] / q_at[j]:
            tokens.append(x)
            continue
        p = target_probs[j]
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere only by rounding: p itself is the answer
            residual = p
        return tokens + [_draw(residual, generator)], j
    return tokens + [_draw(target_probs[k], generator)], k


def _draw(weights: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    """One index drawn with probability proportional to `weights`."""
    return int(torch.multinomial(weights.float(), 1, generator=generator).item())
