"""The engine's command-line flags, with every default read from the config dataclasses (their one home)."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from llmrt.config import (CPU_ALL_REDUCE, DEFAULT_CPU_KV_CACHE_BYTES, KV_CACHE_DTYPES, PREEMPTION_MODES, QUANT_GROUP_SIZES, SCHEDULING_POLICIES, SPECULATIVE_METHODS,
                          CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                          SpeculativeConfig)

_GiB = 1 << 30


def default_of(cls: type, name: str) -> Any:
    """The default of dataclass field `name` of `cls`."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '24GB', '1000' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for unit, mult in units.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def _gib(n: int) -> str:
    return f"{n / _GiB:g}GiB"


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that configure the engine; the same names as LLM(...) keyword arguments."""
    from llmrt.attention import ATTENTION_BACKENDS

    c, s = CacheConfig, SchedulerConfig
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default=default_of(ModelConfig, "dtype"), choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and KV-cache dtype; auto takes the checkpoint's (default: %(default)s)")
    g.add_argument("--device", default=default_of(EngineConfig, "device"),
                   help="cpu, cuda or cuda:N; auto picks cuda when present (default: %(default)s)")
    g.add_argument("--attention-backend", default=default_of(EngineConfig, "attention_backend"),
                   choices=["auto", *sorted(ATTENTION_BACKENDS)],
                   help="attention kernels; auto picks the best one for the device (default: %(default)s)")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant numerics: a request's logits are bitwise the same whatever else shares "
                        "its steps, however its prompt is chunked and whether its prefix was cached (fixed-size "
                        "matmul row tiles, the batch_invariant attention backend); costs throughput "
                        "(docs/determinism.md)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the model's Python: no step graphs (decode steps recorded once per "
                        "batch size and replayed from C++ on CPU, docs/performance.md)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    g.add_argument("--block-size", type=int, default=default_of(c, "block_size"),
                   help="tokens per KV-cache block (default: %(default)s)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help=f"bytes for KV blocks on CPU, e.g. 2GiB (default: {_gib(DEFAULT_CPU_KV_CACHE_BYTES)}, capped "
                        "at what max-num-seqs sequences of max-model-len tokens could use)")
    g.add_argument("--gpu-memory-utilization", type=float, default=default_of(c, "gpu_memory_utilization"),
                   help="fraction of GPU memory llmrt may use for weights, activations and KV (default: %(default)s)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="fix the number of KV blocks")
    g.add_argument("--max-num-seqs", type=int, default=default_of(s, "max_num_seqs"),
                   help="most sequences in one batch (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=default_of(s, "max_num_batched_tokens"),
                   help="token budget of one step; long prompts are prefilled in chunks of at most this "
                        "(default: %(default)s)")
    g.add_argument("--scheduling-policy", default=default_of(s, "policy"), choices=list(SCHEDULING_POLICIES),
                   help="order of waiting work: fcfs; priority (the request's `priority`, lower first, may preempt "
                        "lower priorities); short-first (fewest remaining prompt tokens, with aging); fair (token "
                        "shares across the request's `user`) (default: %(default)s)")
    g.add_argument("--short-first-aging-steps", type=int, default=default_of(s, "short_first_aging_steps"),
                   help="short-first: after waiting this many steps no later arrival passes a request "
                        "(default: %(default)s)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse the KV of prompt blocks earlier requests computed (prefix caching is on by default)")
    g.add_argument("--preemption-mode", default=default_of(s, "preemption_mode"), choices=list(PREEMPTION_MODES),
                   help="when KV blocks run out, a preempted sequence's KV is dropped and recomputed later, or "
                        "swapped to host memory and back (default: %(default)s)")
    g.add_argument("--swap-space", type=parse_bytes, default=default_of(c, "swap_space"),
                   help=f"host memory for swapped-out KV blocks with --preemption-mode swap, e.g. 4GiB "
                        f"(default: {_gib(default_of(c, 'swap_space'))})")
    g.add_argument("--quantization", default=None, choices=["int8", "int4", "fp8", "none"],
                   help="weight-only quantization at load: int8 (symmetric, per output channel), int4 (group-wise, "
                        "--quant-group-size), fp8 (e4m3 per channel; CUDA sm_89+ only); refused at start-up where "
                        "the device cannot compute it. Default: what the checkpoint implies: GPTQ/AWQ checkpoints "
                        "their own 4-bit weights (as int4), a GGUF int4 when most layer weights are Q4_0/Q4_1/Q4_K "
                        "(integers kept) or int8 when most are Q8_0, else unquantized; none: unquantized (a GGUF "
                        "dequantized)")
    g.add_argument("--quant-group-size", type=int, default=default_of(ModelConfig, "quant_group_size"),
                   choices=list(QUANT_GROUP_SIZES), help="int4: weights per scale group (default: %(default)s)")
    g.add_argument("--quant-calibration", default=default_of(ModelConfig, "quant_calibration"),
                   metavar="{none,builtin,PATH}",
                   help="with --quantization int4: calibrate the int4 weights by GPTQ at load (asymmetric groups of "
                        "--quant-group-size, on activations through the model) on 'builtin' sequences the float "
                        "model samples itself or on a text file; the GPTQ checkpoint is cached under "
                        "$LLMRT_CACHE_DIR/gptq (default ~/.cache/llmrt/gptq, or $LLMRT_GPTQ_CACHE_DIR) keyed by the "
                        "model files and options, so only the first load pays for it. none: the data-free fit "
                        "(default: %(default)s; docs/quantization.md)")
    g.add_argument("--quant-calibration-samples", type=int,
                   default=default_of(ModelConfig, "quant_calibration_samples"),
                   help="--quant-calibration: calibration sequences of up to 256 tokens (default: %(default)s)")
    g.add_argument("--lm-head-quantization", default=default_of(ModelConfig, "lm_head_quantization"),
                   choices=["auto", "int8", "none"],
                   help="the LM head's format: auto quantizes it to int8 (per output channel) with --quantization "
                        "int8 or int4 (from a GGUF, only when the file's output matrix is quantized; a GPTQ/AWQ "
                        "checkpoint's only with int8); none keeps it in the model dtype (default: %(default)s)")
    g.add_argument("--dense-weight-copy", default=default_of(ModelConfig, "dense_weight_copy"),
                   choices=["auto", "on", "off"],
                   help="CPU: fp32/bf16 layers keep a dense copy of their weights beside the kernels' packed one, "
                        "so batched and prefill steps (more rows than the kernels take) run torch's GEMM on it "
                        "instead of unpacking every layer per step; costs the layers' weight memory again. auto: "
                        "on when the copies take at most 1/8 of the machine's memory (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", default=default_of(c, "kv_cache_dtype"), choices=list(KV_CACHE_DTYPES),
                   help="KV-cache storage: auto (the model dtype), int8 or fp8 (e4m3), both with per-token, per-head "
                        "scales: about 2x the tokens of bf16 in the same memory; fp8 is converted in software where "
                        "the device has no fp8 instructions (CPUs, CUDA before sm_89) (default: %(default)s)")
    g.add_argument("--kv-watermark", type=float, default=default_of(s, "kv_watermark"),
                   help="fraction of KV blocks new admissions leave free, so running sequences can grow before "
                        "anyone is preempted (default: %(default)s)")


    from llmrt.executor import EXECUTORS  # the registry: a new executor's name is a valid choice at once

    pc = ParallelConfig
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=default_of(pc, "tensor_parallel_size"),
                   help="split every layer over this many ranks (heads, MLP and vocabulary; one process per rank); "
                        "refused when the model's heads do not divide, or with more ranks than devices (CUDA) or CPU "
                        "cores (gloo) (default: %(default)s)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=default_of(pc, "pipeline_parallel_size"),
                   help="split the decoder layers into this many contiguous stages, each on its own group of "
                        "--tensor-parallel-size ranks; activations go stage to stage point to point; refused when "
                        "the stages do not divide the layers (default: %(default)s)")
    g.add_argument("--pipeline-micro-batches", type=int, default=default_of(pc, "pipeline_micro_batches"),
                   help="micro-batches a pipelined step is cut into (by sequences) so stages overlap; 0: one per "
                        "stage when the step has that many sequences (default: %(default)s)")
    g.add_argument("--distributed-executor-backend", default=default_of(pc, "distributed_executor_backend"),
                   choices=["auto", *EXECUTORS],
                   help="how ranks run: uni (one rank, in the engine core), mp (a spawned process per rank), ray "
                        "(ranks 1..N-1 as actors on the Ray cluster the engine joins: RAY_ADDRESS or the local one; "
                        "pip install 'llmrt[ray]'); auto picks uni for one rank, mp for more (default: %(default)s)")
    g.add_argument("--distributed-timeout", type=float, default=default_of(pc, "distributed_timeout"),
                   help="seconds a collective waits for the other ranks before the engine is declared dead "
                        "(a hung rank becomes engine_dead, never a hang) (default: %(default)s)")
    g.add_argument("--cpu-all-reduce", default=default_of(pc, "cpu_all_reduce"), choices=list(CPU_ALL_REDUCE),
                   help="how CPU ranks meet in collectives: shm (a shared-memory segment, every rank on this x86 "
                        "host), gloo (torch.distributed over TCP), auto (shm when every rank is on this host); "
                        "CUDA ranks use NCCL (default: %(default)s)")

    sp = SpeculativeConfig
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-method", default=None, choices=list(SPECULATIVE_METHODS),
                   help="propose tokens for the model to verify in one pass: ngram (prompt lookup in the "
                        "sequence's own tokens) or draft (a smaller model, --speculative-model); outputs keep the "
                        "model's own distribution (default: off)")
    g.add_argument("--num-speculative-tokens", type=int, default=default_of(sp, "num_speculative_tokens"),
                   help="most tokens proposed per sequence and step (default: %(default)s)")
    g.add_argument("--ngram-min", type=int, default=default_of(sp, "ngram_min"),
                   help="ngram: shortest suffix looked up (default: %(default)s)")
    g.add_argument("--ngram-max", type=int, default=default_of(sp, "ngram_max"),
                   help="ngram: longest suffix looked up (default: %(default)s)")
    g.add_argument("--speculative-model", default=None,
                   help="draft: a checkpoint directory with the model's vocabulary (default: none)")
    g.add_argument("--speculative-max-batch-tokens", type=int, default=default_of(sp, "speculative_max_batch_tokens"),
                   help="no proposals in steps whose own tokens reach this: such steps are compute-bound and "
                        "verifying costs real work (default: %(default)s)")


_ENGINE_KEYS = ("dtype", "device", "attention_backend", "deterministic", "enforce_eager", "max_model_len", "block_size",
                "kv_cache_memory", "gpu_memory_utilization", "num_gpu_blocks_override", "max_num_seqs", "max_num_batched_tokens",
                "scheduling_policy", "short_first_aging_steps", "enable_prefix_caching", "preemption_mode",
                "swap_space", "kv_watermark", "quantization", "quant_group_size", "quant_calibration",
                "quant_calibration_samples", "lm_head_quantization", "dense_weight_copy", "kv_cache_dtype", "speculative_method", "num_speculative_tokens", "ngram_min", "ngram_max",
                "speculative_model", "speculative_max_batch_tokens", "tensor_parallel_size",
                "pipeline_parallel_size", "pipeline_micro_batches",
                "distributed_executor_backend", "distributed_timeout", "cpu_all_reduce")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags as LLM(...) keyword arguments."""
    return {k: getattr(args, k) for k in _ENGINE_KEYS}
