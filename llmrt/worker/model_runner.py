"""Turns a SchedulerOutput into flat tensors, runs the model over the paged KV cache, and samples."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from llmrt.attention import build_common_metadata, select_attention_backend
from llmrt.config import EngineConfig
from llmrt.engine.memory_plan import parameter_bytes
from llmrt.engine.step import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from llmrt.hardware import measure_peak_memory
from llmrt.model.layers.sampler import Sampler, SamplingMetadata
from llmrt.model.loader import load_model
from llmrt.sampling_params import SamplingParams
from llmrt.structured.backend import allocate_bitmask


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: Any  # the attention backend's metadata for this step
    logits_indices: torch.Tensor
    sample_items: list[ScheduledSequence]  # items with num_samples > 0, in scheduler order
    prompt_spans: list[tuple[ScheduledSequence, int, int]]  # (item, flat start, rows) needing prompt logprobs


class ModelRunner:
    """Owns the model, its attention backend and the sampler on one device; the worker owns the KV tensors."""

    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        start = time.perf_counter()
        self.model = load_model(config.model, self.device)
        self.load_seconds = time.perf_counter() - start
        self.attn_backend = select_attention_backend(config.attention_backend, self.device)
        self.block_size = config.cache.block_size
        self.vocab_size = int(config.model.hf_config["vocab_size"] if "vocab_size" in config.model.hf_config
                              else self.model.lm_head.out_features)
        self.kv_spec = self.model.kv_cache_spec()
        self.sampler = Sampler()

    # -- start-up --------------------------------------------------------------------------------------
    def weights_bytes(self) -> int:
        """Bytes of parameters (tied ones counted once)."""
        return parameter_bytes(self.model)

    @torch.inference_mode()
    def profile_activation_peak(self, allocate_kv: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]) -> int:
        """Measure the peak memory of the largest step the scheduler can issue (over a throwaway KV cache)."""
        sc = self.config.scheduler
        num_tokens = min(sc.max_num_batched_tokens, self.config.model.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        self.bind_kv_cache(allocate_kv(num_blocks))
        fake = ScheduledSequence(_ProfileSeq(num_tokens, list(range(num_blocks))), num_tokens, 0)  # type: ignore[arg-type]
        batch = self._prepare(SchedulerOutput([fake], [], num_tokens))
        rows = min(sc.max_num_seqs, num_tokens)
        idx = torch.arange(num_tokens - rows, num_tokens, device=self.device)

        def step() -> None:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
            self.model.compute_logits(hidden[idx]).softmax(-1)

        peak = measure_peak_memory(step, self.device)
        self.bind_kv_cache(None)
        return peak

    def bind_kv_cache(self, kv_caches: Optional[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Give each attention layer its (K, V) tensors and the backend (None: detach them)."""
        layers = self.model.attention_layers()
        for i, layer in enumerate(layers):
            k, v = kv_caches[i] if kv_caches is not None else (None, None)
            layer.bind(k, v, self.attn_backend if kv_caches is not None else None)

    # -- one step --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample for every sequence whose known tokens are now all computed."""
        batch = self._prepare(out)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta)
        prompt_logprobs = {item.seq.seq_id: self._prompt_logprobs(item, hidden[start:start + rows])
                           for item, start, rows in batch.prompt_spans}
        if not batch.sample_items:
            return ModelRunnerOutput([], prompt_logprobs=prompt_logprobs)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        meta = self._sampling_metadata(batch.sample_items)
        result = self.sampler(logits, meta)
        out = self._collect(batch.sample_items, result)
        out.prompt_logprobs = prompt_logprobs
        return out

    def _prompt_logprobs(self, item: ScheduledSequence, hidden: torch.Tensor) -> list[dict[int, float]]:
        """For each prompt position in the span, the logprob of the next prompt token (and the top-K)."""
        seq = item.seq
        p0 = seq.num_computed_tokens
        targets = torch.tensor(seq.token_ids[p0 + 1:p0 + 1 + hidden.shape[0]], device=self.device)
        logprobs = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        k = seq.params.prompt_logprobs or 0
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        result = []
        for r, tok in enumerate(targets.tolist()):
            entry = {tok: chosen[r]}
            if k:
                for t, v in zip(top_ids[r].tolist(), top_vals[r].tolist()):
                    entry.setdefault(t, v)
            result.append(entry)
        return result

    def _prepare(self, out: SchedulerOutput) -> _Batch:
        # Decodes first: one-token spans, unless their row must also score a prompt token.
        scoring = {id(s): _prompt_logprob_rows(s) for s in out.scheduled}
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1 and not scoring[id(s)]]
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1 or scoring[id(s)]]
        ids: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        last_index: dict[int, int] = {}  # id(item) -> flat index of its last token
        prompt_spans: list[tuple[ScheduledSequence, int, int]] = []
        for item in decodes + prefills:
            seq, n = item.seq, item.num_new_tokens
            p0 = seq.num_computed_tokens
            start = len(ids)
            ids.extend(seq.token_ids[p0:p0 + n])
            positions.extend(range(p0, p0 + n))
            tables.append(seq.block_ids)
            query_lens.append(n)
            seq_lens.append(p0 + n)
            last_index[id(item)] = start + n - 1
            if scoring[id(item)]:
                prompt_spans.append((item, start, scoring[id(item)]))

        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long)
        common = build_common_metadata(tables, query_lens, seq_lens, pos, len(decodes), self.block_size, dev)
        sample_items = [s for s in out.scheduled if s.num_samples > 0]
        logits_indices = [last_index[id(s)] for s in sample_items for _ in range(s.num_samples)]
        return _Batch(
            torch.tensor(ids, dtype=torch.long, device=dev), pos.to(dev), self.attn_backend.build_metadata(common),
            torch.tensor(logits_indices, dtype=torch.long, device=dev), sample_items, prompt_spans,
        )

    def _sampling_metadata(self, items: list[ScheduledSequence]) -> SamplingMetadata:
        params, prompts, outputs, gens = [], [], [], []
        for item in items:
            seq = item.seq
            req = seq.request
            for j in range(item.num_samples):
                params.append(req.params)
                prompts.append(req.prompt_token_ids)
                outputs.append(seq.output_token_ids)
                gens.append(req.generators[j] if item.num_samples > 1 and req.generators else seq.generator)
        bitmask, rows = self._token_bitmask(items, len(params))
        return SamplingMetadata.build(params, prompts, outputs, gens, self.vocab_size, self.device, bitmask, rows)

    def _token_bitmask(self, items: list[ScheduledSequence], num_rows: int) -> tuple[Optional[torch.Tensor], list[int]]:
        """Each constrained row's allowed tokens from its sequence's grammar; None when no row is constrained."""
        if not any(item.seq.grammar is not None for item in items):
            return None, []
        bitmask = allocate_bitmask(num_rows, self.vocab_size)
        rows: list[int] = []
        row = 0
        for item in items:
            grammar = item.seq.grammar
            if grammar is not None:
                grammar.fill_bitmask(bitmask, row)
                # The n samples of a first step all start from sample 0's state: the same row.
                bitmask[row + 1:row + item.num_samples] = bitmask[row]
                rows.extend(range(row, row + item.num_samples))
            row += item.num_samples
        return bitmask, rows

    def _collect(self, items: list[ScheduledSequence], result) -> ModelRunnerOutput:  # type: ignore[no-untyped-def]
        tokens = result.sampled_token_ids.tolist()
        want_logprobs = result.logprobs is not None
        lp_vals = result.logprobs.tolist() if want_logprobs else None
        lp_ids = result.logprob_token_ids.tolist() if want_logprobs else None
        sampled: list[list[int]] = []
        logprobs: list[list[dict[int, float]]] = []
        row = 0
        for item in items:
            k = item.seq.params.logprobs
            sampled.append(tokens[row:row + item.num_samples])
            if want_logprobs:
                group = []
                for r in range(row, row + item.num_samples):
                    entry: dict[int, float] = {}
                    if k is not None:
                        entry[lp_ids[r][0]] = lp_vals[r][0]
                        for t, v in zip(lp_ids[r][1:1 + k], lp_vals[r][1:1 + k]):
                            entry.setdefault(t, v)
                    group.append(entry)
                logprobs.append(group)
            row += item.num_samples
        return ModelRunnerOutput(sampled, logprobs if want_logprobs else None)


def _prompt_logprob_rows(item: ScheduledSequence) -> int:
    """How many rows of this span predict a prompt token whose logprob the request asked for."""
    seq = item.seq
    if seq.params.prompt_logprobs is None or seq.index != 0 or seq.request.prompt_logprobs is None:
        return 0
    start = max(seq.num_computed_tokens, len(seq.request.prompt_logprobs) - 1)  # recompute: skip what we have
    end = min(seq.num_computed_tokens + item.num_new_tokens, seq.request.num_prompt_tokens - 1)
    return max(0, end - seq.num_computed_tokens) if end > start else 0


class _ProfileSeq:
    """A stand-in sequence for the profiling step: num_tokens of token 0 in blocks 0..n-1."""

    def __init__(self, num_tokens: int, block_ids: list[int]):
        self.token_ids = [0] * num_tokens
        self.num_computed_tokens = 0
        self.block_ids = block_ids
        self.params = SamplingParams()
