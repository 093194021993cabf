"""EngineCore: validates token-level requests and runs the schedule -> execute -> update step loop."""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch

from llmrt.config import EngineConfig
from llmrt.distributed.parallel_state import CollectiveTotals
from llmrt.distributed.pipeline import PipelineTotals
from llmrt.engine.kv_cache import BlockManager, HostBlockPool
from llmrt.engine.messages import EngineCoreOutput, EngineLimits, EngineStats
from llmrt.engine.request import Request
from llmrt.engine.scheduler import Scheduler
from llmrt.executor import Executor, create_executor
from llmrt.errors import ContextLengthExceededError, InvalidRequestError
from llmrt.sampling_params import SamplingParams
from llmrt.structured.backend import StructuredBackend

logger = logging.getLogger(__name__)


def model_eos_token_ids(config: EngineConfig) -> list[int]:
    """EOS ids from generation_config.json and config.json (either may hold an int or a list)."""
    ids: list[int] = []
    sources = [config.model.hf_config]
    gen = Path(config.model.model) / "generation_config.json"
    if gen.is_file():
        sources.insert(0, json.loads(gen.read_text()))
    for src in sources:
        value = src.get("eos_token_id")
        for v in (value if isinstance(value, list) else [value]):
            if isinstance(v, int) and v not in ids:
                ids.append(v)
    return ids


def _sample_seed(seed: int, index: int) -> int:
    # Sample 0 uses the seed as given; later samples get distinct, reproducible streams.
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 63)


class EngineCore:
    """Owns the scheduler and the block manager, and steps the executor it is handed; sees tokens, never text."""

    def __init__(self, config: EngineConfig, executor: Optional[Executor] = None, tokenizer: Any = None):
        """`executor`: default, the one `config.parallel` names. `tokenizer`: a HF or llmrt tokenizer or its directory
        (default: the model's), read only for structured output."""
        self.config = config
        self.executor = executor if executor is not None else create_executor(config)
        self.memory = self.executor.initialize_cache()
        # The extra key names what else shapes the KV besides the tokens (the weights, their quantization, the KV
        # dtype and its storage format).
        m = config.model
        extra_key = (f"{m.model}|{m.torch_dtype}|{m.quantization}|{m.quant_group_size}|{m.lm_head_quantization}|"
                     f"{m.quant_calibration}|{m.quant_calibration_samples}|{config.cache.kv_cache_dtype}").encode()
        self.block_manager = BlockManager(self.memory.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching, extra_key)
        host_pool = None
        if config.scheduler.preemption_mode == "swap":
            host_pool = HostBlockPool(self.executor.initialize_host_cache(config.cache.swap_space))
        self.scheduler = Scheduler(config.scheduler, self.block_manager, config.model.max_model_len, host_pool,
                                   config.speculative)
        self.eos_token_ids = model_eos_token_ids(config)
        self.vocab_size = self.executor.vocab_size
        self.structured = StructuredBackend(tokenizer or config.model.model, self.vocab_size, self.eos_token_ids)
        self.num_steps = 0
        self.last_step_tokens = 0
        self.last_step_seqs = 0
        self.inject_oom_steps = 0  # fault injection: fail this many next steps with out-of-memory
        k = config.speculative.num_speculative_tokens if config.speculative.enabled else 0
        self.spec_proposed_by_position = [0] * k  # cumulative speculative-decoding counts (see EngineStats)
        self.spec_accepted_by_position = [0] * k
        self.spec_verify_steps = 0
        self.spec_propose_seconds = 0.0
        self.collectives = CollectiveTotals() if config.parallel.world_size > 1 else None
        pp = config.parallel.pipeline_parallel_size
        self.pipeline = PipelineTotals.of(pp) if pp > 1 else None

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output this engine accepts."""
        return int(self.config.model.max_model_len)

    def limits(self) -> EngineLimits:
        """What a request must fit in; the front end checks the same numbers before sending."""
        return EngineLimits(self.vocab_size, self.max_model_len, self.block_manager.num_blocks,
                            self.block_manager.block_size, self.config.scheduler.max_num_seqs, self.eos_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: Optional[float] = None, priority: int = 0,
                    deadline: Optional[float] = None, user: Optional[str] = None) -> None:
        """Validate and queue a request; raises an LLMRTError and changes nothing if it is bad.

        `deadline` is a time.monotonic() instant: a request not finished by then is dropped (queued ones
        before any compute).
        """
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        prompt = list(prompt_token_ids)
        max_tokens = validate_request(prompt, params, self.limits())
        params = dataclasses.replace(params)
        params.eos_token_ids = list(self.eos_token_ids)
        gens: list[Optional[torch.Generator]] = []
        if params.seed is not None:
            for i in range(params.n):
                g = torch.Generator(device=self.executor.device)
                g.manual_seed(_sample_seed(params.seed, i))
                gens.append(g)
        grammar = None
        if params.structured is not None:  # compiled (or found in the cache) before anything is queued
            grammar = self.structured.new_grammar(self.structured.compile(params.structured))
        request = Request(request_id, prompt, params, arrival_time or time.monotonic(), max_tokens, priority, gens,
                          deadline=deadline, user=user, grammar=grammar)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> list[EngineCoreOutput]:
        """Stop a request now; its blocks are free when this returns."""
        return self.scheduler.abort_request(request_id)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one sample (the front end matched a stop string); frees its blocks."""
        self.scheduler.finish_sequence(request_id, index, "stop")

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute and update once; returns the new tokens and finishes of this step."""
        expired = self.scheduler.drop_expired(time.monotonic())
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return expired
        # Before anything can fail: swap-outs queued by preemptions must copy their KV before it is reused.
        self.executor.move_blocks(sched)
        try:
            if self.inject_oom_steps > 0:
                self.inject_oom_steps -= 1
                raise torch.OutOfMemoryError("injected out-of-memory fault")
            started = time.perf_counter()
            result = self.executor.execute(sched)
            step_seconds = time.perf_counter() - started
        except (torch.OutOfMemoryError, MemoryError) as e:
            # Absorb: shrink the batch by preempting (recompute later) and retry on the next step; only a
            # sequence that fails alone gets an out_of_memory error.
            logger.warning("out of memory in a step of %d sequences: %s", len(sched.scheduled), e)
            return expired + self.scheduler.shrink_after_oom(sched)
        self.num_steps += 1
        if self.collectives is not None:
            self.collectives.observe(result.collective_seconds, result.collective_bytes, step_seconds,
                                     sched.num_batched_tokens)
        if self.pipeline is not None:
            self.pipeline.observe(result.stage_times)
        self.last_step_tokens = sched.num_batched_tokens
        self.last_step_seqs = len(sched.scheduled)
        if result.spec is not None:
            for j, (p, a) in enumerate(zip(result.spec.proposed_by_position, result.spec.accepted_by_position)):
                self.spec_proposed_by_position[j] += p
                self.spec_accepted_by_position[j] += a
            self.spec_verify_steps += result.spec.num_verified_seqs
            self.spec_propose_seconds += result.spec.propose_seconds
        return expired + self.scheduler.update(sched, result)

    def stats(self) -> EngineStats:
        """Queue and cache figures after the latest step."""
        sch, bm = self.scheduler, self.block_manager
        waiting_tokens = sum(s.num_tokens - s.num_computed_tokens for s in sch.waiting)
        preempted = sum(1 for s in sch.waiting if s.request.num_preemptions)
        return EngineStats(len(sch.running), sch.num_waiting, waiting_tokens, bm.num_blocks, bm.num_free_blocks,
                           self.num_steps, self.last_step_tokens, sch.num_preemptions_total,
                           last_step_seqs=self.last_step_seqs, num_preempted=preempted,
                           prefix_cache_queried_tokens=bm.prefix_cache_queried_tokens,
                           prefix_cache_hit_tokens=bm.prefix_cache_hit_tokens,
                           spec_method=self.config.speculative.method,
                           spec_proposed_by_position=list(self.spec_proposed_by_position),
                           spec_accepted_by_position=list(self.spec_accepted_by_position),
                           spec_verify_steps=self.spec_verify_steps, spec_propose_seconds=self.spec_propose_seconds,
                           **self._collective_stats())

    def _collective_stats(self) -> dict[str, Any]:
        c, p = self.collectives, self.pipeline
        if c is None:
            return {}
        pipe = {} if p is None else dict(pipeline_wait_seconds=list(p.wait), pipeline_stage_seconds=list(p.total),
                                         pipeline_steps=p.steps)
        return dict(collective_bucket_counts=list(c.bucket_counts), collective_seconds=c.seconds,
                    collective_steps=c.steps, collective_step_seconds=c.step_seconds, collective_bytes=c.bytes,
                    collective_tokens=c.tokens, **pipe)


def validate_request(prompt: list[int], params: SamplingParams, limits: EngineLimits) -> int:
    """Check a tokenized request against the engine's limits; return its resolved max_tokens."""
    if not prompt:
        raise InvalidRequestError("the prompt is empty; give at least one token", param="prompt")
    vocab = limits.vocab_size
    bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"token id {bad[0]!r} is out of the vocabulary [0, {vocab})", param="prompt")
    if params.n > limits.max_num_seqs:
        raise InvalidRequestError(
            f"n={params.n} samples cannot run together with max_num_seqs={limits.max_num_seqs}", param="n")
    bias_ids = [t for t in (params.logit_bias or {}) if t >= vocab]
    if bias_ids:
        raise InvalidRequestError(f"logit_bias token id {bias_ids[0]} is out of the vocabulary [0, {vocab})",
                                  param="logit_bias")
    n_prompt, limit = len(prompt), limits.max_model_len
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - n_prompt
    if n_prompt + max(max_tokens, 1) > limit:
        too_long_prompt = n_prompt >= limit or params.max_tokens is None
        raise ContextLengthExceededError(
            f"this model's maximum context length is {limit} tokens, but {n_prompt + max_tokens} were "
            f"requested ({n_prompt} in the prompt, {max_tokens} for the completion); shorten the prompt "
            "or lower max_tokens", param="prompt" if too_long_prompt else "max_tokens")
    need = -(-(n_prompt + max_tokens) // limits.block_size)
    if need > limits.num_blocks:
        raise ContextLengthExceededError(
            f"{n_prompt} prompt + {max_tokens} completion tokens need {need} KV blocks of {limits.block_size} "
            f"tokens, but the whole cache holds {limits.num_blocks}", param="max_tokens")
    return max_tokens
