"""Turns a SchedulerOutput into flat tensors, runs the model over the paged KV cache, and samples."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from llmrt.attention import build_common_metadata, select_attention_backend
from llmrt.config import EngineConfig
from llmrt.distributed.pipeline import PipeComm, StageTimes
from llmrt.engine.memory_plan import estimate_activation_peak, parameter_bytes
from llmrt.engine.step import ModelRunnerOutput, ScheduledSequence, SchedulerOutput, SpecStepStats, StepInput
from llmrt.hardware import compute_dtype, measure_peak_memory
from llmrt.model.layers.fused import fused_ops
from llmrt.model.layers.sampler import Sampler, SamplingMetadata
from llmrt.model.loader import load_model
from llmrt.spec_decode import ProposalInput, create_proposer
from llmrt.spec_decode.verify_step import token_logprobs, verify_spans
from llmrt.structured.backend import allocate_bitmask
from llmrt.worker.pipeline_step import pipelined_forward
from llmrt.worker.step_graph import StepGraphs, extension as step_graph_extension


@dataclass
class _Batch:
    inp: StepInput  # what every rank computes (logits_rows: sampling rows, prompt-logprob rows, proposal rows)
    num_sample_rows: int
    sample_items: list[ScheduledSequence]  # items with num_samples > 0 and no proposals, in scheduler order
    prompt_spans: list[tuple[ScheduledSequence, int, int]]  # (item, flat start, rows) needing prompt logprobs
    spec_items: list[ScheduledSequence]  # spans that verify proposals (their k + 1 rows each, last in logits_rows)


class ModelRunner:
    """Owns the model, its attention backend and the sampler on one device; the worker owns the KV tensors."""

    def __init__(self, config: EngineConfig, device: torch.device):
        self.config = config
        self.device = device
        start = time.perf_counter()
        self.model = load_model(config.model, self.device)
        self.load_seconds = time.perf_counter() - start
        if config.deterministic:
            from llmrt.model.layers.batch_invariant import make_batch_invariant

            make_batch_invariant(self.model)
        # Whether the model's norms/rotary/SiLU run the fused CPU kernels (smaller activations, memory_plan).
        self.fused_layers = (self.device.type == "cpu" and not config.deterministic
                             and compute_dtype(self.device, config.model.torch_dtype) in (torch.float32, torch.bfloat16)
                             and fused_ops() is not None)
        self.compute_dtype = compute_dtype(self.device, config.model.torch_dtype)
        self.attn_backend = select_attention_backend(config.attention_backend, self.device)
        self.block_size = config.cache.block_size
        self.vocab_size = int(config.model.hf_config["vocab_size"] if "vocab_size" in config.model.hf_config
                              else self.model.lm_head.out_features)
        self.kv_spec = self.model.kv_cache_spec()
        self.sampler = Sampler()
        self.spec_config = config.speculative
        self.proposer = create_proposer(config, self)
        # Called with each step's StepInput before its forward pass (the multi-process executor sends it on).
        self.step_listener: Optional[Callable[[StepInput], None]] = None
        # Pipeline parallel: this rank's links to the other stages (set by the worker), and on rank 0 the last
        # step's (waiting, total) seconds of every stage.
        self.pipe: Optional[PipeComm] = None
        self.stage_times: list[StageTimes] = []
        # Decode steps replayed from a recording per batch size (step_graph.py): one rank, no draft model.
        par = config.parallel
        self.step_graphs: Optional[StepGraphs] = None
        self.kv_cache_dtype: Optional[torch.dtype] = None
        if not config.enforce_eager and par.tensor_parallel_size == 1 and par.pipeline_parallel_size == 1 \
                and self.proposer is None and self.attn_backend.replayable and step_graph_extension() is not None:
            self.step_graphs = StepGraphs(step_graph_extension(), self._graph_constants)

    # -- start-up --------------------------------------------------------------------------------------
    def weights_bytes(self) -> int:
        """Bytes of parameters (tied ones counted once)."""
        return parameter_bytes(self.model)

    def estimate_activation_peak(self, tp: int = 1) -> int:
        """The activation peak of the largest step the scheduler can issue, from the layer shapes (no forward)."""
        sc = self.config.scheduler
        num_tokens = min(sc.max_num_batched_tokens, self.config.model.max_model_len)
        dtype = compute_dtype(self.device, self.config.model.torch_dtype)
        return estimate_activation_peak(self.config.model.hf_config, num_tokens, min(sc.max_num_seqs, num_tokens),
                                        dtype, self.kv_spec.num_kv_heads, self.kv_spec.head_dim, tp, self.fused_layers)

    @torch.inference_mode()
    def profile_activation_peak(self, allocate_kv: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]) -> int:
        """Measure the peak memory of the largest step the scheduler can issue (over a throwaway KV cache)."""
        sc = self.config.scheduler
        num_tokens = min(sc.max_num_batched_tokens, self.config.model.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        self.bind_kv_cache(allocate_kv(num_blocks))
        rows = min(sc.max_num_seqs, num_tokens)
        inp = StepInput([0] * num_tokens, [list(range(num_blocks))], [num_tokens],
                        [num_tokens], 0, list(range(num_tokens - rows, num_tokens)))

        def step() -> None:
            logits = self.forward(inp)
            if logits is not None:
                logits.softmax(-1)

        peak = measure_peak_memory(step, self.device)
        self.bind_kv_cache(None)
        return peak

    def bind_kv_cache(self, kv_caches: Optional[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Give each attention layer its (K, V) tensors and the backend (None: detach them)."""
        layers = self.model.attention_layers()
        for i, layer in enumerate(layers):
            k, v = kv_caches[i] if kv_caches is not None else (None, None)
            layer.bind(k, v, self.attn_backend if kv_caches is not None else None)
        self.kv_cache_dtype = kv_caches[0][0].dtype if kv_caches else None
        if self.step_graphs is not None:
            self.step_graphs.clear()

    def _graph_constants(self) -> list[torch.Tensor]:
        """What a recorded step may read besides its inputs: the model's parameters and buffers, the KV caches."""
        caches = [t for layer in self.model.attention_layers() for t in (layer.k_cache, layer.v_cache)
                  if t is not None]
        return [*self.model.parameters(), *self.model.buffers(), *caches]

    # -- one step --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step, sample for every sequence whose known tokens are now all computed, verify the
        proposals of spans that carry them, and make the next step's proposals."""
        batch = self._prepare(out)
        if self.step_listener is not None:
            self.step_listener(batch.inp)
        logits = self._forward(batch.inp, observe=True)
        prompt_logprobs: dict[int, list[dict[int, float]]] = {}
        row = batch.num_sample_rows
        for item, _, rows in batch.prompt_spans:
            prompt_logprobs[item.seq.seq_id] = self._prompt_logprobs(item, logits[row:row + rows])
            row += rows
        tokens: dict[int, list[int]] = {}  # id(item) -> its tokens
        logprobs: dict[int, list[dict[int, float]]] = {}
        want_logprobs = False
        if batch.sample_items:
            rows = [(i.seq.params, len(i.seq.output_token_ids), i.seq.grammar is not None)
                    for i in batch.sample_items for _ in range(i.num_samples)]
            result = self.sampler.sample(logits[:batch.num_sample_rows], rows,
                                         lambda: self._sampling_metadata(batch.sample_items))
            sampled, lps = self._collect(batch.sample_items, result)
            tokens.update((id(i), t) for i, t in zip(batch.sample_items, sampled))
            if lps is not None:
                want_logprobs = True
                logprobs.update((id(i), lp) for i, lp in zip(batch.sample_items, lps))
        spec_stats = None
        if batch.spec_items:
            sampled, lps, spec_stats = verify_spans(batch.spec_items, logits[row:], self.vocab_size,
                                                    self.spec_config.num_speculative_tokens, self.proposer)
            tokens.update((id(i), t) for i, t in zip(batch.spec_items, sampled))
            if lps is not None:
                want_logprobs = True
                logprobs.update((id(i), lp) for i, lp in zip(batch.spec_items, lps))
        items = [s for s in out.scheduled if s.num_samples > 0]
        result_out = ModelRunnerOutput(
            [tokens[id(i)] for i in items],
            [logprobs.get(id(i), [{} for _ in tokens[id(i)]]) for i in items] if want_logprobs else None,
            prompt_logprobs=prompt_logprobs, spec=spec_stats)
        if self.proposer is not None and items and out.propose:
            start = time.perf_counter()
            result_out.draft_token_ids = self._propose(items, tokens)
            if result_out.spec is None:
                result_out.spec = SpecStepStats([0] * self.spec_config.num_speculative_tokens,
                                                [0] * self.spec_config.num_speculative_tokens)
            result_out.spec.propose_seconds = time.perf_counter() - start
        return result_out

    def _propose(self, items: list[ScheduledSequence], tokens: dict[int, list[int]]) -> dict[int, list[int]]:
        """Proposals for the next step of every single-sample sequence that sampled in this one."""
        inputs: list[ProposalInput] = []
        bound_by_slots = self.spec_config.lookahead_slots > 0  # a draft model writes KV at the proposals' slots
        for item in items:
            seq = item.seq
            if item.num_samples != 1 or not seq.params.speculative:
                continue
            token_ids = seq.token_ids + tokens[id(item)]
            limit = min(self.spec_config.num_speculative_tokens,
                        seq.request.max_tokens - (len(token_ids) - seq.request.num_prompt_tokens) - 1,
                        int(self.config.model.max_model_len) - len(token_ids) - 1)
            if bound_by_slots:
                limit = min(limit, len(seq.block_ids) * self.block_size - (len(token_ids) - 1))
            inputs.append(ProposalInput(seq.seq_id, token_ids, seq.request.num_prompt_tokens, seq.block_ids,
                                        max(0, limit), seq.params, seq.generator))
        proposals = self.proposer.propose(inputs) if inputs else []
        return {inp.seq_id: p for inp, p in zip(inputs, proposals) if p}

    @torch.inference_mode()
    def forward(self, inp: StepInput, observe: bool = False) -> Optional[torch.Tensor]:
        """The model over the step's flat batch, then the logits of `inp.logits_rows` (None when there are none,
        and on every rank but 0 when the model is split). Every rank runs this with the same `inp`; `observe` shows
        the step to the proposer (a draft model keeps its KV in step). Pipeline parallel: micro-batched through
        the stages (pipeline_step.py)."""
        return self._forward(inp, observe)

    def _forward(self, inp: StepInput, observe: bool = False) -> Optional[torch.Tensor]:
        # forward's body, for callers already in inference mode (execute: one mode entry a step, not two)
        if self.pipe is not None:
            return pipelined_forward(self, inp)
        dev = self.device
        ids, pos, meta = self.model_inputs(inp)
        graph_inputs = self._graph_inputs(inp, ids, pos, meta, observe)
        if graph_inputs is not None:
            return self.step_graphs.run(len(inp.query_lens), graph_inputs,
                                        lambda: self.model.compute_logits(self.model(ids, pos, meta)))
        hidden = self.model(ids, pos, meta)
        if observe and self.proposer is not None:
            self.proposer.observe_forward(ids, pos, meta)
        rows = inp.logits_rows
        if not rows:
            return None
        if len(rows) == hidden.shape[0] and rows == list(range(len(rows))):  # every row, in order (decode steps)
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)])

    def _graph_inputs(self, inp: StepInput, ids: torch.Tensor, pos: torch.Tensor, meta: Any,
                      observe: bool) -> Optional[list[torch.Tensor]]:
        """The tensors that differ between decode steps of one batch size, when this step can be replayed (every
        sequence decodes, every row is sampled in order, and the backend's metadata is all tensors); else None."""
        if self.step_graphs is None or inp.num_decodes != len(inp.query_lens) or (observe and self.proposer):
            return None
        if inp.logits_rows != list(range(inp.num_decodes)):
            return None
        varying = self.attn_backend.graph_inputs(meta, self.kv_cache_dtype, self.compute_dtype)
        return None if varying is None else [ids, pos, *varying]

    def model_inputs(self, inp: StepInput) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Token ids, positions and attention metadata of a flat batch, on this runner's device."""
        ids = torch.tensor(inp.input_ids, dtype=torch.long, device=self.device)
        pos = inp.positions()
        common = build_common_metadata(inp.block_tables, inp.query_lens, inp.seq_lens, pos, inp.num_decodes,
                                       self.block_size, self.device)
        return ids, pos.to(self.device), self.attn_backend.build_metadata(common)

    def _prompt_logprobs(self, item: ScheduledSequence, logits: torch.Tensor) -> list[dict[int, float]]:
        """For each prompt position in the span, the logprob of the next prompt token (and the top-K)."""
        seq = item.seq
        p0 = seq.num_computed_tokens
        targets = seq.token_ids[p0 + 1:p0 + 1 + logits.shape[0]]
        logprobs = torch.log_softmax(logits, dim=-1)
        return token_logprobs(logprobs, targets, seq.params.prompt_logprobs or 0)

    def _prepare(self, out: SchedulerOutput) -> _Batch:
        # Decodes first: one-token spans, unless their row must also score a prompt token.
        scoring = {id(s): _prompt_logprob_rows(s) for s in out.scheduled}
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1 and not scoring[id(s)]]
        prefills = [s for s in out.scheduled if s.num_new_tokens > 1 or scoring[id(s)]]
        ids: list[int] = []
        tables: list[list[int]] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        last_index: dict[int, int] = {}  # id(item) -> flat index of its last token
        prompt_spans: list[tuple[ScheduledSequence, int, int]] = []
        for item in decodes + prefills:
            seq, n = item.seq, item.num_new_tokens
            p0 = seq.num_computed_tokens
            start = len(ids)
            # A span with proposals: the sequence's last token, then the proposals to verify.
            ids.extend(seq.token_ids[p0:p0 + n] + item.spec_token_ids)
            tables.append(seq.block_ids)
            query_lens.append(n)
            seq_lens.append(p0 + n)
            last_index[id(item)] = start + n - 1
            if scoring[id(item)]:
                prompt_spans.append((item, start, scoring[id(item)]))

        sample_items = [s for s in out.scheduled if s.num_samples > 0 and not s.spec_token_ids]
        spec_items = [s for s in out.scheduled if s.spec_token_ids]
        logits_rows = [last_index[id(s)] for s in sample_items for _ in range(s.num_samples)]
        num_sample_rows = len(logits_rows)
        logits_rows += [r for _, start, rows in prompt_spans for r in range(start, start + rows)]
        logits_rows += [r for s in spec_items for r in range(last_index[id(s)] - len(s.spec_token_ids), last_index[id(s)] + 1)]
        inp = StepInput(ids, tables, query_lens, seq_lens, len(decodes), logits_rows)
        return _Batch(inp, num_sample_rows, sample_items, prompt_spans, spec_items)

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

    def _collect(self, items: list[ScheduledSequence],
                 result) -> tuple[list[list[int]], Optional[list[list[dict[int, float]]]]]:  # type: ignore[no-untyped-def]
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
        return sampled, logprobs if want_logprobs else None


def _prompt_logprob_rows(item: ScheduledSequence) -> int:
    """How many rows of this span predict a prompt token whose logprob the request asked for."""
    seq = item.seq
    if seq.params.prompt_logprobs is None or seq.index != 0 or seq.request.prompt_logprobs is None:
        return 0
    start = max(seq.num_computed_tokens, len(seq.request.prompt_logprobs) - 1)  # recompute: skip what we have
    end = min(seq.num_computed_tokens + item.num_new_tokens, seq.request.num_prompt_tokens - 1)
    return max(0, end - seq.num_computed_tokens) if end > start else 0
