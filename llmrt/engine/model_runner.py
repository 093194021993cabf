"""Turns a SchedulerOutput into flat tensors, runs the model over the paged KV cache, and samples."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch

from llmrt.config import EngineConfig
from llmrt.errors import OutOfMemoryError
from llmrt.engine.memory_plan import MemoryPlan, kv_budget_bytes, num_kv_blocks, parameter_bytes
from llmrt.engine.scheduler import ModelRunnerOutput, ScheduledSequence, SchedulerOutput
from llmrt.hardware import device_memory_free_total, measure_peak_memory, tune_cpu_allocator
from llmrt.model.layers.attention import AttentionMetadata, PrefillSpan
from llmrt.model.layers.sampler import Sampler, SamplingMetadata
from llmrt.model.loader import load_model
from llmrt.sampling_params import SamplingParams
from llmrt.structured.backend import allocate_bitmask

logger = logging.getLogger(__name__)

_GiB = 1 << 30
_DEFAULT_CPU_KV_BYTES = 2 * _GiB


@dataclass
class _Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_items: list[ScheduledSequence]  # items with num_samples > 0, in scheduler order
    prompt_spans: list[tuple[ScheduledSequence, int, int]]  # (item, flat start, rows) needing prompt logprobs


class ModelRunner:
    """Owns the model, its KV cache tensors and the sampler on one device."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        torch.manual_seed(config.model.seed)
        start = time.perf_counter()
        self.model = load_model(config.model, self.device)
        self.load_seconds = time.perf_counter() - start
        self.block_size = config.cache.block_size
        self.vocab_size = int(config.model.hf_config["vocab_size"] if "vocab_size" in config.model.hf_config
                              else self.model.lm_head.out_features)
        self.kv_dtype = config.model.torch_dtype
        self.kv_spec = self.model.kv_cache_spec()
        self.sampler = Sampler()
        self.memory: Optional[MemoryPlan] = None
        self.host_cache: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer (K, V) swap space

    # -- start-up --------------------------------------------------------------------------------------
    def weights_bytes(self) -> int:
        """Bytes of parameters (tied ones counted once)."""
        return parameter_bytes(self.model)

    @torch.inference_mode()
    def profile_activation_peak(self) -> int:
        """Measure the peak memory of the largest step the scheduler can issue."""
        sc = self.config.scheduler
        num_tokens = min(sc.max_num_batched_tokens, self.config.model.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        self._bind_cache(num_blocks)
        fake = ScheduledSequence(_ProfileSeq(num_tokens, list(range(num_blocks))), num_tokens, 0)  # type: ignore[arg-type]
        batch = self._prepare(SchedulerOutput([fake], [], num_tokens))
        rows = min(sc.max_num_seqs, num_tokens)
        idx = torch.arange(num_tokens - rows, num_tokens, device=self.device)

        def step() -> None:
            hidden = self.model(batch.input_ids, batch.positions, batch.meta)
            self.model.compute_logits(hidden[idx]).softmax(-1)

        peak = measure_peak_memory(step, self.device)
        self._unbind_cache()
        return peak

    def initialize_kv_cache(self) -> MemoryPlan:
        """Size the KV cache from the memory budget left after weights and activations, and allocate it."""
        cc = self.config.cache
        weights = self.weights_bytes()
        activation = self.profile_activation_peak()
        per_token = self.kv_spec.bytes_per_token(self.kv_dtype)
        block_bytes = per_token * self.block_size
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        elif self.device.type == "cuda":
            _, total = device_memory_free_total(self.device)
            used_elsewhere = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            budget = kv_budget_bytes(total, cc.gpu_memory_utilization, weights, activation, used_elsewhere)
            num_blocks = num_kv_blocks(budget, per_token, self.block_size)
        else:
            budget = cc.kv_cache_memory if cc.kv_cache_memory is not None else _DEFAULT_CPU_KV_BYTES
            num_blocks = num_kv_blocks(budget, per_token, self.block_size)
            if cc.kv_cache_memory is None:
                # A default budget never allocates more than the scheduler could ever fill.
                useful = self.config.scheduler.max_num_seqs * -(-self.config.model.max_model_len // self.block_size)
                num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise_oom(weights, activation, block_bytes)
        self._bind_cache(num_blocks)
        max_len = int(self.config.model.max_model_len)
        contexts = tuple(c for c in (1024, 4096, 16384) if c < max_len) + (max_len,)
        self.memory = MemoryPlan(weights, activation, per_token, self.block_size, num_blocks, contexts)
        logger.info(self.memory.describe())
        return self.memory

    def initialize_host_cache(self, swap_bytes: int) -> int:
        """Allocate the host-memory pool swapped-out KV blocks go to (pinned on CUDA); return its block count."""
        spec = self.kv_spec
        num = swap_bytes // (spec.bytes_per_token(self.kv_dtype) * self.block_size)
        shape = (num, self.block_size, spec.num_kv_heads, spec.head_dim)
        pin = self.device.type == "cuda"
        # torch.empty: pages are touched only when a block is swapped out, so an unused pool costs nothing.
        self.host_cache = [(torch.empty(shape, dtype=self.kv_dtype, pin_memory=pin),
                            torch.empty(shape, dtype=self.kv_dtype, pin_memory=pin))
                           for _ in self.model.attention_layers()]
        logger.info("swap space: %d host blocks (%.1f MiB)", num, num * shape[1] * spec.bytes_per_token(self.kv_dtype) / (1 << 20))
        return num

    def _bind_cache(self, num_blocks: int) -> None:
        spec = self.kv_spec
        shape = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
        # Zeroed, not empty: padded decode reads touch unwritten slots, and 0 * NaN would poison the output.
        for layer in self.model.attention_layers():
            layer.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _unbind_cache(self) -> None:
        for layer in self.model.attention_layers():
            layer.k_cache = layer.v_cache = None

    # -- one step --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and sample for every sequence whose known tokens are now all computed.

        The step's block moves (`move_blocks`) must have run first."""
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

    @torch.inference_mode()
    def move_blocks(self, out: SchedulerOutput) -> None:
        """Swap-outs, then copy-on-write copies, then swap-ins: a block freed by a swap-out may be the
        destination of a copy or a swap-in in the same step."""
        if out.swap_out:
            dev = torch.tensor([d for d, _ in out.swap_out], device=self.device)
            host = torch.tensor([h for _, h in out.swap_out])
            for layer, (hk, hv) in zip(self.model.attention_layers(), self.host_cache):
                hk.index_copy_(0, host, layer.k_cache.index_select(0, dev).to("cpu"))
                hv.index_copy_(0, host, layer.v_cache.index_select(0, dev).to("cpu"))
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        if out.swap_in:
            host = torch.tensor([h for h, _ in out.swap_in])
            dev = torch.tensor([d for _, d in out.swap_in], device=self.device)
            for layer, (hk, hv) in zip(self.model.attention_layers(), self.host_cache):
                layer.k_cache.index_copy_(0, dev, hk.index_select(0, host).to(self.device, non_blocking=True))
                layer.v_cache.index_copy_(0, dev, hv.index_select(0, host).to(self.device, non_blocking=True))

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for layer in self.model.attention_layers():
            layer.k_cache[dst] = layer.k_cache[src]
            layer.v_cache[dst] = layer.v_cache[src]

    def _prepare(self, out: SchedulerOutput) -> _Batch:
        bs = self.block_size
        # One-token spans take the batched decode path, unless their row must also score a prompt token.
        scoring = {id(s): _prompt_logprob_rows(s) for s in out.scheduled}
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1 and not scoring[id(s)]]
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1 or scoring[id(s)]]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_index: dict[int, int] = {}  # id(item) -> flat index of its last token

        tables: list[list[int]] = []
        ctx_lens: list[int] = []
        for item in decodes:
            seq = item.seq
            p = seq.num_computed_tokens
            last_index[id(item)] = len(ids)
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_ids[p // bs] * bs + p % bs)
            tables.append(seq.block_ids)
            ctx_lens.append(p + 1)

        spans: list[PrefillSpan] = []
        span_slots: list[torch.Tensor] = []
        prompt_spans: list[tuple[ScheduledSequence, int, int]] = []
        for item in prefills:
            seq, n = item.seq, item.num_new_tokens
            p0 = seq.num_computed_tokens
            start = len(ids)
            ids.extend(seq.token_ids[p0:p0 + n])
            positions.extend(range(p0, p0 + n))
            table = torch.tensor(seq.block_ids, dtype=torch.long)
            pos = torch.arange(p0, p0 + n)
            span_slots.append(table[pos // bs] * bs + pos % bs)
            spans.append(PrefillSpan(start, n, p0 + n, table.to(self.device, non_blocking=True)))
            last_index[id(item)] = start + n - 1
            if scoring[id(item)]:
                prompt_spans.append((item, start, scoring[id(item)]))

        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long)
        if span_slots:
            slot_mapping = torch.cat([slot_mapping, *span_slots])
        decode_tables = decode_lens = None
        if decodes:
            width = max(len(t) for t in tables)
            decode_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
            decode_lens = torch.tensor(ctx_lens, dtype=torch.long, device=dev)
        meta = AttentionMetadata(slot_mapping.to(dev), len(decodes), decode_tables, decode_lens, spans)

        sample_items = [s for s in out.scheduled if s.num_samples > 0]
        logits_indices = [last_index[id(s)] for s in sample_items for _ in range(s.num_samples)]
        return _Batch(
            torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
            meta, torch.tensor(logits_indices, dtype=torch.long, device=dev), sample_items, prompt_spans,
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


def raise_oom(weights: int, activation: int, block_bytes: int) -> None:
    """No room for even one KV block: say the numbers."""
    raise OutOfMemoryError(
        f"no memory left for the KV cache: weights {weights} B and activation peak {activation} B leave less "
        f"than one block ({block_bytes} B); raise --gpu-memory-utilization / --kv-cache-memory or lower "
        "--max-num-batched-tokens"
    )
