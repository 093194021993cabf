"""The batched sampler: logits for one engine step in, next tokens (and logprobs) out."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import chain
from typing import Callable, Optional

import torch

from llmrt.errors import InvalidRequestError
from llmrt.model.layers.fused import ops_for
from llmrt.sampling_params import SamplingParams
from llmrt.structured.backend import apply_token_bitmask


# Top-p rows first try the nucleus inside their top this-many tokens; a CPU topk that size costs
# ~1/20 of a full sort of a 32k vocabulary. Rows whose nucleus is wider get the full sort.
NUCLEUS_PROBE = 256


@dataclass
class RowGroup:
    """Rows that take the same sampling path, as host ids and as a device index."""

    rows: list[int]
    index: torch.Tensor  # [len(rows)] int64 on the logits' device
    top_k: int = 0  # the k every row of a top-k group shares

    @classmethod
    def of(cls, rows: list[int], device: torch.device, top_k: int = 0) -> Optional["RowGroup"]:
        """A group of rows, or None when there are none."""
        return cls(rows, torch.tensor(rows, dtype=torch.long, device=device), top_k) if rows else None


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step, as tensors."""

    num_rows: int
    vocab_size: int
    temperature: torch.Tensor  # [S] float32; greedy rows hold 1.0
    # Every row is in exactly one group, chosen by its own params alone, so a row runs the same
    # kernels on the same shapes whatever else is in the batch: seeded rows stay batch-invariant,
    # down to which of several tied logits a top-k keeps.
    greedy_rows: Optional[RowGroup]  # temperature < 1e-5: argmax
    top_k_rows: list[RowGroup]  # random with top_k: one group, and one topk(k), per distinct k
    top_p_rows: Optional[RowGroup]  # random with top_p but no top_k: nucleus probe, else full sort
    plain_rows: Optional[RowGroup]  # random with neither: the whole vocabulary
    top_p: Optional[torch.Tensor]  # [S] float32, inf where off; None if no row uses it
    min_p: Optional[torch.Tensor]  # [S] float32, 0 where off; None if no row uses it
    generators: dict[int, torch.Generator]  # row -> its generator, seeded random rows only
    max_num_logprobs: Optional[int]  # K; None when no row asks for logprobs
    # Processors touch only the (row, token) cells they change, as flat positions row * V + token:
    # O(tokens) work and memory instead of dense [S, V] masks and counts.
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor]]  # (positions, bias to add)
    min_tokens_block: Optional[torch.Tensor]  # positions to set to -inf (stop ids before min_tokens)
    repetition: Optional[tuple[torch.Tensor, torch.Tensor]]  # (positions seen in prompt or output, penalty)
    output_penalty: Optional[tuple[torch.Tensor, torch.Tensor]]  # (generated positions, presence + frequency*count)
    # Constrained decoding: [S, ceil(V / 32)] int32 allowed-token bits, read only in `bitmask_rows`.
    token_bitmask: Optional[torch.Tensor] = None
    bitmask_rows: list[int] = field(default_factory=list)

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[Optional[torch.Generator]],
        vocab_size: int,
        device: torch.device,
        token_bitmask: Optional[torch.Tensor] = None,
        bitmask_rows: Optional[list[int]] = None,
    ) -> "SamplingMetadata":
        """Gather one step's per-row params into tensors on `device` (the bitmask, if any, as given)."""
        num_rows, V = len(params), vocab_size
        greedy, top_p_rows, plain = [], [], []
        by_k: dict[int, list[int]] = {}
        for i, p in enumerate(params):
            if p.greedy:
                greedy.append(i)
            elif 0 < p.top_k < V:
                by_k.setdefault(p.top_k, []).append(i)
            elif p.top_p < 1.0:
                top_p_rows.append(i)
            else:
                plain.append(i)
        is_random = [not p.greedy for p in params]

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        # top_p 1.0 is stored as inf: the nucleus filter that other rows need must leave such a row
        # exactly untouched, and a cumsum's rounding can reach 1.0 before the last token.
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        bias_pos, bias_vals, block_pos = [], [], []
        for i, p in enumerate(params):
            for tok, b in (p.logit_bias or {}).items():
                if tok >= V:  # caught here, not as an index error (a device assert on CUDA) mid-step
                    raise InvalidRequestError(
                        f"logit_bias: token id {tok} is outside the vocabulary (size {V})", param="logit_bias")
                bias_pos.append(i * V + tok), bias_vals.append(float(b))
            if len(output_token_ids[i]) < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(p.eos_token_ids))
                block_pos.extend(i * V + t for t in stops if t < V)  # an id the model can't emit needs no block

        repetition = output_penalty = None
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if rep_rows:
            pos = torch.cat([_positions(rep_rows, prompt_token_ids, V), _positions(rep_rows, output_token_ids, V)])
            pos = pos.unique()
            penalty = torch.tensor([p.repetition_penalty for p in params])[pos // V]
            repetition = (pos.to(device), penalty.to(device))
        pen_rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        if pen_rows:
            pos, counts = _positions(pen_rows, output_token_ids, V).unique(return_counts=True)
            rows = pos // V
            presence = torch.tensor([p.presence_penalty for p in params])[rows]
            frequency = torch.tensor([p.frequency_penalty for p in params])[rows]
            output_penalty = (pos.to(device), (presence + frequency * counts).to(device))

        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=num_rows,
            vocab_size=V,
            temperature=column([1.0 if p.greedy else p.temperature for p in params], torch.float32),
            greedy_rows=RowGroup.of(greedy, device),
            top_k_rows=[RowGroup.of(rows, device, k) for k, rows in sorted(by_k.items())],
            top_p_rows=RowGroup.of(top_p_rows, device),
            plain_rows=RowGroup.of(plain, device),
            top_p=column(top_p, torch.float32) if any(r and p.top_p < 1.0 for r, p in zip(is_random, params))
            else None,
            min_p=column([p.min_p for p in params], torch.float32)
            if any(r and p.min_p > 0.0 for r, p in zip(is_random, params)) else None,
            generators={i: g for i, g in enumerate(generators) if g is not None and is_random[i]},
            max_num_logprobs=max(requested) if requested else None,
            logit_bias=(column(bias_pos, torch.long), column(bias_vals, torch.float32)) if bias_pos else None,
            min_tokens_block=column(block_pos, torch.long) if block_pos else None,
            repetition=repetition,
            output_penalty=output_penalty,
            token_bitmask=token_bitmask if bitmask_rows else None,
            bitmask_rows=list(bitmask_rows or []),
        )


@dataclass
class SamplerOutput:
    """Sampled tokens for one step and, when asked, their logprobs."""

    sampled_token_ids: torch.Tensor  # [S] int64
    logprobs: Optional[torch.Tensor]  # [S, 1+K] float32: the sampled token's, then the top-K; None if no row asked
    logprob_token_ids: Optional[torch.Tensor]  # [S, 1+K] int64 matching ids


def argmax_only(params: SamplingParams, num_output_tokens: int, constrained: bool) -> bool:
    """Whether a row's token is the plain argmax of its logits and nothing more is asked: greedy, no logprobs,
    nothing that changes logits first (logit_bias, penalties, a min_tokens block still pending, a grammar).
    The same rules as SamplingMetadata.build's processors and Sampler.forward's paths."""
    p = params
    return (p.greedy and p.logprobs is None and not p.logit_bias and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and not constrained
            and num_output_tokens >= p.min_tokens)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1) of [S, V] logits, by the fused CPU kernel where it loads (torch's CPU argmax took
    ~60 us a 32k-token row)."""
    ops = ops_for(logits, True) if logits.dim() == 2 and logits.stride(-1) == 1 and logits.size(-1) else None
    return ops.argmax(logits) if ops is not None else logits.argmax(dim=-1)


class Sampler(torch.nn.Module):
    """Turns one step's logits into next tokens, row by row per its SamplingParams, all rows at once."""

    def sample(self, logits: torch.Tensor, rows: list[tuple[SamplingParams, int, bool]],
               build_metadata: Callable[[], SamplingMetadata]) -> SamplerOutput:
        """Sample one token per row; `rows` holds each row's (params, output tokens so far, has a grammar).

        When every row is `argmax_only`, the argmax is the whole sampler: the per-step metadata tensors are not
        built and the logits not copied to float. Otherwise `forward` with `build_metadata()`."""
        if all(argmax_only(*row) for row in rows):
            return SamplerOutput(_argmax(logits), None, None)
        return self(logits, build_metadata())

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [S, V]; the caller's tensor is never modified."""
        logits = logits.float()
        raw = logits  # logprobs describe the model's own distribution, before any penalty or temperature
        logits = _apply_processors(logits, meta)
        if meta.token_bitmask is not None:
            # After the processors (no bias can re-allow a token), before temperature and top-k/p/min-p.
            if logits is raw:
                logits = logits.clone()
            apply_token_bitmask(logits, meta.token_bitmask, meta.bitmask_rows)

        if meta.greedy_rows is not None and len(meta.greedy_rows.rows) == meta.num_rows:
            sampled = _argmax(logits)
        else:
            sampled = torch.empty(meta.num_rows, dtype=torch.long, device=logits.device)
            if meta.greedy_rows is not None:
                sampled[meta.greedy_rows.index] = _argmax(_take(logits, meta.greedy_rows))
            paths = [(g, _sample_top_k) for g in meta.top_k_rows]
            paths += [(meta.top_p_rows, _sample_top_p), (meta.plain_rows, _sample_plain)]
            for group, path in paths:
                if group is not None:
                    tokens = path(logits, group, meta)
                    if len(group.rows) == meta.num_rows:
                        sampled = tokens
                    else:
                        sampled[group.index] = tokens

        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled, None, None)
        # A full log_softmax beats logit - logsumexp on CPU: torch's logsumexp is unfused there.
        logprobs = raw.log_softmax(dim=-1)
        ids = sampled[:, None]
        if meta.max_num_logprobs:
            ids = torch.cat([ids, logprobs.topk(meta.max_num_logprobs, dim=-1).indices], dim=1)
        return SamplerOutput(sampled, logprobs.gather(1, ids), ids)


def target_probabilities(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution each row's token is drawn from, dense [S, V]: the same processors, bitmask,
    temperature, min-p, top-k and top-p as `Sampler`, with greedy rows as a point mass on their argmax.
    Speculative decoding verifies proposals against it."""
    logits = _apply_processors(logits.float(), meta)
    if meta.token_bitmask is not None:
        logits = logits.clone()
        apply_token_bitmask(logits, meta.token_bitmask, meta.bitmask_rows)
    probs = (logits / meta.temperature[:, None]).clone()
    if meta.min_p is not None:
        _min_p_(probs, meta.min_p)
    for group in meta.top_k_rows:
        rows = probs[group.index]
        kth = rows.topk(group.top_k, dim=-1).values[:, -1:]
        probs[group.index] = rows.masked_fill(rows < kth, float("-inf"))
    probs = probs.softmax(dim=-1)
    if meta.top_p is not None:
        vals, ids = probs.sort(dim=-1, descending=True)
        probs = torch.zeros_like(probs).scatter_(1, ids, _nucleus_(vals, meta.top_p))
        probs /= probs.sum(dim=-1, keepdim=True)
    if meta.greedy_rows is not None:
        idx = meta.greedy_rows.index
        probs[idx] = torch.nn.functional.one_hot(logits[idx].argmax(dim=-1), meta.vocab_size).to(probs.dtype)
    return probs


def _positions(rows: list[int], token_lists: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Flat positions row * V + token of every token listed for `rows`, on the CPU (duplicates kept)."""
    lens = torch.tensor([len(token_lists[i]) for i in rows], dtype=torch.long)
    if not int(lens.sum()):
        return torch.empty(0, dtype=torch.long)
    # array -> frombuffer is ~3x faster than torch.tensor(list) for long prompts.
    ids = torch.frombuffer(array("q", chain.from_iterable(token_lists[i] for i in rows)), dtype=torch.long)
    lo, hi = torch.aminmax(ids)
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token id {int(lo) if lo < 0 else int(hi)} is outside the vocabulary (size {vocab_size})")
    return ids + torch.repeat_interleave(torch.tensor(rows, dtype=torch.long) * vocab_size, lens)


def _take(x: torch.Tensor, group: RowGroup) -> torch.Tensor:
    """The group's rows of x, without a copy when the group is every row."""
    return x if len(group.rows) == x.shape[0] else x[group.index]


def _apply_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logit_bias, min_tokens, then repetition/presence/frequency penalties."""
    if meta.logit_bias is None and meta.min_tokens_block is None and meta.repetition is None \
            and meta.output_penalty is None:
        return logits
    # Our own contiguous copy: the caller's logits stay as the model produced them, and view(-1) works.
    logits = logits.clone(memory_format=torch.contiguous_format)
    flat = logits.view(-1)
    if meta.logit_bias is not None:
        flat.index_add_(0, *meta.logit_bias)
    if meta.min_tokens_block is not None:
        flat.index_fill_(0, meta.min_tokens_block, float("-inf"))
    if meta.repetition is not None:  # HF: seen tokens' logits move toward zero if positive, away if not
        pos, penalty = meta.repetition
        seen = flat[pos]
        flat.index_copy_(0, pos, torch.where(seen > 0, seen / penalty, seen * penalty))
    if meta.output_penalty is not None:  # OpenAI: logit -= presence * (count > 0) + frequency * count
        flat.index_add_(0, *meta.output_penalty, alpha=-1)
    return logits


def _sample_top_k(logits: torch.Tensor, group: RowGroup, meta: SamplingMetadata) -> torch.Tensor:
    """Rows sharing one top_k: topk() gives sorted candidates for min_p and top_p too."""
    vals, ids = _take(logits, group).topk(group.top_k, dim=-1)
    vals /= _take(meta.temperature, group)[:, None]
    if meta.min_p is not None:
        _min_p_(vals, _take(meta.min_p, group))
    probs = vals.softmax(dim=-1)
    if meta.top_p is not None:
        _nucleus_(probs, _take(meta.top_p, group))
    return _race(probs, ids, group.rows, meta)


def _sample_top_p(logits: torch.Tensor, group: RowGroup, meta: SamplingMetadata) -> torch.Tensor:
    """Rows with top_p and no top_k: nucleus from a top-NUCLEUS_PROBE probe, full sort only where wider."""
    probs = _scaled_probs(logits, group, meta)
    top_p = _take(meta.top_p, group)
    vals, ids = probs.topk(min(NUCLEUS_PROBE, probs.shape[-1]), dim=-1)
    # A row's nucleus fits the probe when the probe's mass reaches top_p. Its path depends on its
    # own row only; the host sync costs little, as the engine reads the tokens right after.
    wide = (vals.cumsum(dim=-1)[:, -1] < top_p).tolist()
    if not any(wide):
        return _race(_nucleus_(vals, top_p), ids, group.rows, meta)
    tokens = torch.empty(len(group.rows), dtype=torch.long, device=probs.device)
    for is_wide in (False, True):
        pos = [i for i, w in enumerate(wide) if w == is_wide]
        if pos:
            sel = torch.tensor(pos, device=probs.device)
            v, ix = probs[sel].sort(dim=-1, descending=True) if is_wide else (vals[sel], ids[sel])
            tokens[sel] = _race(_nucleus_(v, top_p[sel]), ix, [group.rows[p] for p in pos], meta)
    return tokens


def _sample_plain(logits: torch.Tensor, group: RowGroup, meta: SamplingMetadata) -> torch.Tensor:
    """Rows with neither top_k nor top_p: the race runs over the whole vocabulary, no sort."""
    return _race(_scaled_probs(logits, group, meta), None, group.rows, meta)


def _scaled_probs(logits: torch.Tensor, group: RowGroup, meta: SamplingMetadata) -> torch.Tensor:
    """softmax(logits / temperature) over the whole vocabulary, after min_p."""
    scaled = _take(logits, group) / _take(meta.temperature, group)[:, None]
    if meta.min_p is not None:
        _min_p_(scaled, _take(meta.min_p, group))
    return scaled.softmax(dim=-1)


def _min_p_(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set -inf where p < min_p * p_max, i.e. logit < max_logit + log(min_p); min_p 0 is a no-op."""
    floor = scaled.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    return scaled.masked_fill_(scaled < floor, float("-inf"))


def _nucleus_(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero best-first sorted probs outside the nucleus: the smallest prefix whose mass reaches top_p."""
    # Kept while the mass ranked strictly above is < top_p; that is 0 for the top token, always kept.
    return probs.masked_fill_(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)


def _race(probs: torch.Tensor, ids: Optional[torch.Tensor], rows: list[int], meta: SamplingMetadata) -> torch.Tensor:
    """Sample each row from probs (unnormalized is fine) as argmax(probs / q), q ~ Exp(1) per token.

    `ids` maps candidate columns to token ids (None: columns are token ids); `rows` are the batch
    rows of probs' rows. A seeded row draws one U per vocabulary token from its own generator and
    reads it by token id, so its token and its generator's stream depend on nothing else in the batch.
    """
    seeded = [(pos, meta.generators[row]) for pos, row in enumerate(rows) if row in meta.generators]
    u = torch.empty_like(probs) if len(seeded) == len(rows) else torch.empty_like(probs).uniform_()
    for pos, gen in seeded:
        if ids is None:
            u[pos].uniform_(generator=gen)
        else:
            u[pos] = probs.new_empty(meta.vocab_size).uniform_(generator=gen)[ids[pos]]
    # q = -log(U): on CPU ~5x faster than Tensor.exponential_ (which draws through doubles), and one
    # batched log for all rows. U is in [0, 1), so q is in (0, inf]: never 0, so never 0 / 0.
    q = u.log_().neg_()
    choice = _argmax(probs.div_(q))
    return choice if ids is None else ids.gather(1, choice[:, None]).squeeze(1)
