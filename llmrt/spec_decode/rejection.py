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
    if greedy:
        best = target_probs.argmax(dim=-1).tolist()
        return _match(best, draft_token_ids)
    if draft_probs is None:
        return _verify_point_mass(target_probs, draft_token_ids, generator)
    tokens: list[int] = []
    # One uniform per proposal, drawn up front from the sequence's own stream (reproducible with a seed).
    u = torch.rand(k, generator=generator, device=target_probs.device).tolist() if k else []
    rows = torch.arange(k, device=target_probs.device)
    ids = torch.tensor(draft_token_ids, device=target_probs.device)
    p_at = target_probs[rows, ids].tolist() if k else []
    q_at = draft_probs[rows.to(draft_probs.device), ids.to(draft_probs.device)].tolist() if k else []
    for j, x in enumerate(draft_token_ids):
        if q_at[j] > 0 and u[j] < p_at[j] / q_at[j]:
            tokens.append(x)
            continue
        p = target_probs[j]
        residual = (p - draft_probs[j].to(p.device)).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere only by rounding: p itself is the answer
            residual = p
        return tokens + [_draw(residual, generator)], j
    return tokens + [_draw(target_probs[k], generator)], k


def _verify_point_mass(target_probs: torch.Tensor, draft_token_ids: list[int],
                       generator: Optional[torch.Generator]) -> tuple[list[int], int]:
    """Rejection sampling against a point mass q = [x]: accept x with probability p(x), else draw from p
    without x. Drawing t ~ p and accepting x iff t == x is exactly that, and drawing t the way the sampler
    does (an exponential race on one uniform per vocabulary token from the sequence's stream) makes a
    seeded request's tokens the ones it gets without speculation, whatever the number of proposals."""
    tokens: list[int] = []
    for j in range(len(draft_token_ids) + 1):
        p = target_probs[j].float()
        u = p.new_empty(p.shape[0]).uniform_(generator=generator)
        tokens.append(int(p.div(u.log_().neg_()).argmax()))
        if j == len(draft_token_ids) or tokens[-1] != draft_token_ids[j]:
            return tokens, j
    raise AssertionError("unreachable")


def _match(best: list[int], draft_token_ids: list[int]) -> tuple[list[int], int]:
    """The longest prefix of the proposals equal to `best`, then best's next token."""
    for j, x in enumerate(draft_token_ids):
        if x != best[j]:
            return draft_token_ids[:j] + [best[j]], j
    return draft_token_ids + [best[len(draft_token_ids)]], len(draft_token_ids)


def _draw(weights: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    """One index drawn with probability proportional to `weights`."""
    return int(torch.multinomial(weights.float(), 1, generator=generator).item())
