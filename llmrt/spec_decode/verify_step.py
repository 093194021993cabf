"""One step's verification of every span that carried proposals: target distributions, rejection
sampling, logprobs and the per-position counts."""
from __future__ import annotations

from typing import Optional

import torch

from llmrt.engine.step import ScheduledSequence, SpecStepStats
from llmrt.model.layers.sampler import SamplingMetadata, target_probabilities
from llmrt.spec_decode.base import Proposer
from llmrt.spec_decode.rejection import verify
from llmrt.structured.backend import allocate_bitmask


def verify_spans(items: list[ScheduledSequence], logits: torch.Tensor, vocab_size: int, max_k: int,
                 proposer: Optional[Proposer]) -> tuple[list[list[int]], Optional[list[list[dict[int, float]]]],
                                                        SpecStepStats]:
    """`logits` holds k + 1 rows per item, in order. Returns each item's tokens (accepted proposals and one
    token of the target's), their logprobs when any request asked, and the step's counts."""
    device = logits.device
    params, prompts, outputs, gens = [], [], [], []
    for item in items:
        seq, drafts = item.seq, item.spec_token_ids
        for j in range(len(drafts) + 1):  # row j follows the span's first token and proposals 1..j
            params.append(seq.params)
            prompts.append(seq.request.prompt_token_ids)
            outputs.append(seq.output_token_ids + drafts[:j])
            gens.append(seq.generator)
    bitmask, rows = _bitmask(items, len(params), vocab_size)
    meta = SamplingMetadata.build(params, prompts, outputs, gens, vocab_size, device, bitmask, rows)
    probs = target_probabilities(logits, meta)
    want_logprobs = any(item.seq.params.logprobs is not None for item in items)
    logprobs_all = logits.float().log_softmax(dim=-1) if want_logprobs else None

    stats = SpecStepStats([0] * max_k, [0] * max_k, num_verified_seqs=len(items))
    tokens_out: list[list[int]] = []
    logprobs_out: list[list[dict[int, float]]] = []
    row = 0
    for item in items:
        seq, drafts = item.seq, item.spec_token_ids
        k = len(drafts)
        q = proposer.draft_probs(seq.seq_id) if proposer is not None else None
        tokens, accepted = verify(probs[row:row + k + 1], drafts, q[:k] if q is not None else None,
                                  seq.params.greedy, seq.generator)
        for j in range(k):
            stats.proposed_by_position[j] += 1
            stats.accepted_by_position[j] += int(j < accepted)
        tokens_out.append(tokens)
        if logprobs_all is not None:
            logprobs_out.append(token_logprobs(logprobs_all[row:row + len(tokens)], tokens, seq.params.logprobs))
        row += k + 1
    return tokens_out, logprobs_out if want_logprobs else None, stats


def _bitmask(items: list[ScheduledSequence], num_rows: int, vocab_size: int) -> tuple[Optional[torch.Tensor], list[int]]:
    """Constrained rows: row j holds the grammar's allowed tokens after proposals 1..j, found by advancing
    the matcher through the proposals and rolling it back. Rows after a proposal the grammar refuses stay
    unconstrained: that proposal's target probability is 0, so verification never reaches them."""
    if not any(item.seq.grammar is not None for item in items):
        return None, []
    bitmask = allocate_bitmask(num_rows, vocab_size)
    rows: list[int] = []
    row = 0
    for item in items:
        grammar, drafts = item.seq.grammar, item.spec_token_ids
        if grammar is not None:
            advanced = 0
            grammar.fill_bitmask(bitmask, row)
            rows.append(row)
            for j, token in enumerate(drafts):
                if not grammar.accept(token):
                    break
                advanced += 1
                grammar.fill_bitmask(bitmask, row + j + 1)
                rows.append(row + j + 1)
            grammar.rollback(advanced)
        row += len(drafts) + 1
    return bitmask, rows


def token_logprobs(rows: torch.Tensor, tokens: list[int], k: Optional[int]) -> list[dict[int, float]]:
    """Each row's logprob of its token and the row's top-k, from log-softmaxed `rows` (the model's own
    distribution); `k` None: no logprobs asked, empty entries."""
    if k is None:
        return [{} for _ in tokens]
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0].tolist()
    top_vals, top_ids = rows.topk(k, dim=-1) if k else (None, None)
    out = []
    for r, tok in enumerate(tokens):
        entry = {tok: chosen[r]}
        if k:
            for t, v in zip(top_ids[r].tolist(), top_vals[r].tolist()):
                entry.setdefault(t, v)
        out.append(entry)
    return out
