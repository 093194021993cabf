"""EngineConfig and its parts; the one place knobs are defined and validated."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from llmrt.errors import InvalidRequestError, ModelLoadError, UnsupportedError

DEFAULT_MODEL_DIR = Path(__file__).parent / "data" / "stories260K"
DEFAULT_MODEL_NAME = "stories260K"

QUANT_GROUP_SIZES = (32, 64, 128)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # auto: the model dtype
SCHEDULING_POLICIES = ("fcfs", "priority", "short-first", "fair")
PREEMPTION_MODES = ("recompute", "swap")
# On CPU the KV cache gets this many bytes unless told otherwise, capped at what max_num_seqs sequences of
# max_model_len tokens could ever use (CUDA sizes it from gpu_memory_utilization instead).
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str, hf_config: dict[str, Any]) -> torch.dtype:
    """Resolve `auto` to the checkpoint's dtype; reject unknown names."""
    if name == "auto":
        name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32").replace("torch.", "")
        if name not in _DTYPES:
            name = "float32"
    if name not in _DTYPES:
        raise InvalidRequestError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}", param="dtype")
    return _DTYPES[name]


def context_limit(hf_config: dict[str, Any]) -> int:
    """A model's own context limit from its config.json (2048 when it names none)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(hf_config.get(key), int):
            return int(hf_config[key])
    return 2048


@dataclass
class ModelConfig:
    """Which checkpoint to run and how."""

    model: str = ""
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0
    served_model_name: Optional[str] = None
    # A name in llmrt.model.quantization.QUANTIZATION_METHODS; None: what the checkpoint implies (GPTQ/AWQ, a GGUF's
    # types; else unquantized); "none": unquantized even then.
    quantization: Optional[str] = None
    quant_group_size: int = 32  # int4: weights per scale/zero group along the input dim (32, 64 or 128)
    # The LM head's format: auto (int8 with --quantization int8/int4; from a GGUF, only if the file's is quantized),
    # int8, or none (the model dtype). Resolved in __post_init__ (quantization.resolve_lm_head).
    lm_head_quantization: str = "auto"
    # int4 only: "builtin" or a text file to calibrate on by GPTQ at load (the checkpoint cached; gptq_at_load.py);
    # "none": the data-free fit. Its sequences, `llmrt quantize`'s default 128 unless set.
    quant_calibration: str = "none"
    quant_calibration_samples: int = 128
    # CPU: whether fp32/bf16 layers packed for llmrt's kernels also keep dense weights for steps larger than the
    # kernels take (auto: when the copies fit in 1/8 of memory; kernels.packed.keep_dense_copy), or unpack per step.
    dense_weight_copy: str = "auto"
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)
    torch_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not self.model:
            self.model = str(DEFAULT_MODEL_DIR)
            self.served_model_name = self.served_model_name or DEFAULT_MODEL_NAME
        from llmrt.model.gguf_file import is_gguf

        path = Path(self.model)
        cfg = path / "config.json"
        if is_gguf(str(path)):
            from llmrt.model.gguf_file import gguf_hf_config

            self.hf_config = gguf_hf_config(str(path))  # config, tokenizer and weights all come from the file
        elif not cfg.is_file():
            raise ModelLoadError(
                f"model {self.model!r}: no config.json there. llmrt loads local Hugging Face checkpoint "
                "directories (config.json + *.safetensors + tokenizer files) and GGUF files; nothing is downloaded."
            )
        else:
            self.hf_config = json.loads(cfg.read_text())
        self.torch_dtype = parse_dtype(self.dtype, self.hf_config)
        from llmrt.model.quantization.gptq_at_load import check_calibration

        self.quant_calibration = check_calibration(self.quant_calibration, self.quantization, self.model,
                                                   self.hf_config, self.quant_calibration_samples)
        self._checkpoint_quantization()
        from llmrt.model.quantization import resolve_lm_head

        self.lm_head_quantization = resolve_lm_head(self.lm_head_quantization, self.quantization,
                                                    str(path) if is_gguf(str(path)) else None)
        limit = self.derived_max_len()
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len < 1:
            raise InvalidRequestError("max_model_len must be >= 1", param="max_model_len")
        elif self.max_model_len > limit:
            raise UnsupportedError(
                f"max_model_len {self.max_model_len} exceeds the model's context of {limit} tokens",
                param="max_model_len",
            )
        if self.served_model_name is None:
            self.served_model_name = path.resolve().stem if path.is_file() else path.resolve().name
        if self.dense_weight_copy not in ("auto", "on", "off"):
            raise InvalidRequestError("dense_weight_copy must be one of auto, on, off", param="dense_weight_copy")
        if self.quant_group_size not in QUANT_GROUP_SIZES:
            raise InvalidRequestError(f"quant_group_size must be one of {', '.join(map(str, QUANT_GROUP_SIZES))}",
                                      param="quant_group_size")

    def _checkpoint_quantization(self) -> None:
        """What the checkpoint implies when no method was named: a GPTQ/AWQ checkpoint its own (another is
        refused); a GGUF file the method that keeps its decoder weights' bits (int4 for mostly 4-bit types, int8
        for mostly Q8_0). "none" asks for unquantized weights (a GGUF then loads dequantized)."""
        from llmrt.model.gguf_file import is_gguf
        from llmrt.model.quantization.gptq_awq import checkpoint_quantization

        explicit_none = self.quantization == "none"
        if explicit_none:
            self.quantization = None
        method = checkpoint_quantization(self.hf_config)
        if method is None:
            if self.quantization is None and not explicit_none and is_gguf(str(self.model)):
                from llmrt.model.gguf_file import gguf_default_quantization

                self.quantization = gguf_default_quantization(self.model)
            return
        if explicit_none or self.quantization not in (None, method):
            raise UnsupportedError(f"{self.model} is a {method.upper()} checkpoint (4-bit, served by the int4 method); "
                                   f"it cannot be loaded as --quantization {self.quantization or 'none'}",
                                   param="quantization")
        self.quantization = method

    def quant_options(self) -> dict[str, Any]:
        """What get_quantization_config needs besides the name: the group size and the checkpoint's own config."""
        return {"group_size": self.quant_group_size, "checkpoint": self.hf_config.get("quantization_config"),
                "lm_head": self.lm_head_quantization}

    @property
    def quantization_label(self) -> str:
        """How the weights are quantized in words: 'int4 g32', 'int4 g32 gptq (builtin calibration, 128 samples)',
        'none'."""
        if not self.quantization:
            return "none"
        label = f"{self.quantization} g{self.quant_group_size}" if self.quantization == "int4" else self.quantization
        if self.quant_calibration != "none":
            from llmrt.model.quantization.gptq_at_load import calibration_source

            label += f" gptq ({calibration_source(self.quant_calibration)} calibration, " \
                     f"{self.quant_calibration_samples} samples)"
        return label

    def derived_max_len(self) -> int:
        """The model's own context limit from its config."""
        return context_limit(self.hf_config)

    @property
    def architecture(self) -> str:
        """The first entry of `architectures` in config.json."""
        archs = self.hf_config.get("architectures") or []
        return archs[0] if archs else ""


@dataclass
class CacheConfig:
    """Paged KV cache sizing."""

    block_size: int = 16
    kv_cache_memory: Optional[int] = None  # bytes for KV blocks (CPU); None: DEFAULT_CPU_KV_CACHE_BYTES, capped
    gpu_memory_utilization: float = 0.9  # fraction of device memory llmrt may use (CUDA)
    num_gpu_blocks_override: Optional[int] = None  # fix the block count (tests, experiments)
    enable_prefix_caching: bool = True  # reuse the KV of full blocks that earlier requests computed
    swap_space: int = 4 << 30  # bytes of host memory for KV blocks swapped out (preemption_mode swap only)
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES; int8/fp8 store per-token, per-head scales in the blocks

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got "
                                      f"{self.kv_cache_dtype!r}", param="kv_cache_dtype")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size must be a power of two >= 1", param="block_size")
        if self.swap_space < 0:
            raise InvalidRequestError("swap_space must be >= 0 bytes", param="swap_space")
        if not 0.05 <= self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError("gpu_memory_utilization must be in [0.05, 1]", param="gpu_memory_utilization")


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"  # one of SCHEDULING_POLICIES
    preemption_mode: str = "recompute"  # recompute | swap: what happens to a preempted sequence's KV
    kv_watermark: float = 0.01  # fraction of KV blocks new admissions leave free for running sequences to grow
    short_first_aging_steps: int = 32  # short-first: after this many steps waiting, nothing later passes a request

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be >= 1", param="max_num_seqs")
        if self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_batched_tokens must be >= 1", param="max_num_batched_tokens")
        if self.policy not in SCHEDULING_POLICIES:
            raise UnsupportedError(f"scheduling policy {self.policy!r} is not supported; supported: "
                                   f"{', '.join(SCHEDULING_POLICIES)}", param="scheduling_policy")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidRequestError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; got "
                                      f"{self.preemption_mode!r}", param="preemption_mode")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise InvalidRequestError("kv_watermark must be in [0, 1)", param="kv_watermark")
        if self.short_first_aging_steps < 1:
            raise InvalidRequestError("short_first_aging_steps must be >= 1", param="short_first_aging_steps")


SPECULATIVE_METHODS = ("ngram", "draft")  # llmrt.spec_decode.PROPOSERS


@dataclass
class SpeculativeConfig:
    """Speculative decoding: who proposes tokens, how many, and when a step is too big to speculate."""

    method: Optional[str] = None  # one of SPECULATIVE_METHODS; None: off
    num_speculative_tokens: int = 4  # most tokens proposed per sequence and step
    ngram_min: int = 2  # ngram: shortest suffix looked up in the sequence's own tokens
    ngram_max: int = 5  # ngram: longest suffix looked up
    speculative_model: Optional[str] = None  # draft: a smaller checkpoint with the same vocabulary
    speculative_max_batch_tokens: int = 16  # no speculation in steps whose own tokens reach this (compute-bound)

    def __post_init__(self) -> None:
        if self.method is None:
            return
        if self.method not in SPECULATIVE_METHODS:
            raise UnsupportedError(f"speculative method {self.method!r} is not supported; supported: "
                                   f"{', '.join(SPECULATIVE_METHODS)}", param="speculative_method")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise InvalidRequestError("num_speculative_tokens must be in [1, 16]", param="num_speculative_tokens")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError("need 1 <= ngram_min <= ngram_max", param="ngram_min")
        if self.method == "draft" and not self.speculative_model:
            raise InvalidRequestError("speculative method 'draft' needs a speculative_model (--speculative-model)",
                                      param="speculative_model")
        if self.method != "draft" and self.speculative_model:
            raise InvalidRequestError("speculative_model is only used by the 'draft' method", param="speculative_model")
        if self.speculative_max_batch_tokens < 2:
            raise InvalidRequestError("speculative_max_batch_tokens must be >= 2", param="speculative_max_batch_tokens")

    @property
    def enabled(self) -> bool:
        """True when a method is set."""
        return self.method is not None

    @property
    def lookahead_slots(self) -> int:
        """KV slots a running sequence needs beyond its span: a draft model writes its proposals' KV there."""
        return self.num_speculative_tokens if self.method == "draft" else 0


CPU_ALL_REDUCE = ("auto", "shm", "gloo")


@dataclass
class ParallelConfig:
    """How the model is split over workers; this process's rank within them."""

    tensor_parallel_size: int = 1
    # Contiguous layer stages, each on its own group of tensor_parallel_size ranks.
    pipeline_parallel_size: int = 1
    # Micro-batches a pipelined step is split into (by sequences); 0: as many as stages, when there are enough.
    pipeline_micro_batches: int = 0
    # A name in llmrt.executor.EXECUTORS; auto: "uni" for one rank, "mp" (a process per rank) for more.
    distributed_executor_backend: str = "auto"
    distributed_timeout: float = 20.0  # seconds a collective may wait for the other ranks before failing
    # How CPU ranks meet in collectives: shm (a shared-memory segment; every rank on this host), gloo, or auto
    # (shm when every rank is on this host, else gloo). CUDA ranks use NCCL whatever this says.
    cpu_all_reduce: str = "auto"
    rank: int = 0  # set per worker by the executor

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise InvalidRequestError(f"tensor_parallel_size must be a positive integer, got "
                                      f"{self.tensor_parallel_size!r}", param="tensor_parallel_size")
        if not isinstance(self.pipeline_parallel_size, int) or self.pipeline_parallel_size < 1:
            raise InvalidRequestError(f"pipeline_parallel_size must be a positive integer, got "
                                      f"{self.pipeline_parallel_size!r}", param="pipeline_parallel_size")
        if not isinstance(self.pipeline_micro_batches, int) or self.pipeline_micro_batches < 0:
            raise InvalidRequestError(f"pipeline_micro_batches must be 0 (auto) or a positive integer, got "
                                      f"{self.pipeline_micro_batches!r}", param="pipeline_micro_batches")
        if self.distributed_timeout <= 0:
            raise InvalidRequestError("distributed_timeout must be positive", param="distributed_timeout")
        if self.cpu_all_reduce not in CPU_ALL_REDUCE:
            raise InvalidRequestError(f"cpu_all_reduce must be one of {', '.join(CPU_ALL_REDUCE)}, got "
                                      f"{self.cpu_all_reduce!r}", param="cpu_all_reduce")
        if self.distributed_executor_backend == "auto":
            self.distributed_executor_backend = "uni" if self.world_size == 1 else "mp"
        elif self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise UnsupportedError(f"the uni executor runs one rank; {self.world_size} ranks need mp or ray",
                                   param="distributed_executor_backend")

    @property
    def world_size(self) -> int:
        """Workers in all: tensor-parallel ranks x pipeline stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    """Everything the engine needs; built once, validated once."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    device: str = "auto"
    attention_backend: str = "auto"  # a name in llmrt.attention.ATTENTION_BACKENDS, or auto for the device's best
    formats: list = field(default_factory=list, init=False, repr=False)  # hardware.FormatSupport, set below
    # Batch-invariant numerics: a request's logits do not depend on what shares its steps (docs/determinism.md).
    deterministic: bool = False
    # Every step through the model's Python: no step graphs (llmrt/worker/step_graph.py), as vLLM's flag.
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.deterministic:
            if self.attention_backend not in ("auto", "batch_invariant"):
                raise UnsupportedError(f"--deterministic computes attention with the batch_invariant backend; "
                                       f"attention backend {self.attention_backend!r} cannot be combined with it",
                                       param="attention_backend")
            if self.cache.kv_cache_dtype != "auto":
                raise UnsupportedError("--deterministic reads the KV cache in the model dtype; it cannot be combined "
                                       f"with --kv-cache-dtype {self.cache.kv_cache_dtype}", param="kv_cache_dtype")
            self.attention_backend = "batch_invariant"
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UnsupportedError("device cuda requested but no CUDA device is available", param="device")
        from llmrt.hardware import check_formats
        from llmrt.model.quantization import get_quantization_config

        # An unknown name or an unsupported checkpoint format (bits, packing) fails here, before any weight is read.
        get_quantization_config(self.model.quantization, self.model.quant_options())
        self._check_parallel()
        self.formats = check_formats(torch.device(self.device), self.model.torch_dtype, self.model.quantization,
                                     self.cache.kv_cache_dtype)

    def _check_parallel(self) -> None:
        """Refuse a split the model or the other options cannot take, before anything is loaded."""
        tp, pp = self.parallel.tensor_parallel_size, self.parallel.pipeline_parallel_size
        if pp > 1:
            from llmrt.distributed.sizes import check_pipeline_parallel

            if self.model.quant_calibration != "none":  # each stage would calibrate the whole model again
                raise UnsupportedError("--quant-calibration is not run per pipeline stage; calibrate once with "
                                       "`llmrt quantize` and serve that checkpoint", param="quant_calibration")

            check_pipeline_parallel(self.model.hf_config, self.model.architecture, pp)
            if self.speculative.method == "draft":
                raise UnsupportedError("a draft model is not split into pipeline stages yet; use "
                                       "--speculative-method ngram or --pipeline-parallel-size 1",
                                       param="speculative_method")
            if self.deterministic:
                raise UnsupportedError("--deterministic is not checked with pipeline parallelism yet; use "
                                       "--pipeline-parallel-size 1", param="pipeline_parallel_size")
        if tp == 1:
            return
        from llmrt.distributed.sizes import check_tensor_parallel

        check_tensor_parallel(self.model.hf_config, self.model.architecture, tp)
        from llmrt.model.gguf_file import is_gguf

        # Their loaders place whole pre-quantized rows; they do not cut them into per-rank slices yet.
        if self.model.hf_config.get("quantization_config") or self.model.quant_calibration != "none" or (
                is_gguf(str(self.model.model)) and self.model.quantization == "int4"):
            raise UnsupportedError("pre-quantized 4-bit checkpoints (GPTQ, AWQ, GGUF 4-bit kept as int4, and those "
                                   "--quant-calibration writes) are not split over tensor-parallel ranks yet; use "
                                   "--tensor-parallel-size 1, or a GGUF with --quantization none|int8",
                                   param="tensor_parallel_size")
        if self.speculative.method == "draft":
            raise UnsupportedError("a draft model is not split over tensor-parallel ranks yet; use "
                                   "--speculative-method ngram or --tensor-parallel-size 1", param="speculative_method")
        if self.deterministic:
            raise UnsupportedError("--deterministic is not checked with tensor parallelism yet; use "
                                   "--tensor-parallel-size 1", param="tensor_parallel_size")

    def formats_report(self) -> dict[str, Any]:
        """The weight and KV formats chosen and how this device computes them (for /version and logs)."""
        from llmrt.model.quantization.gptq_at_load import calibration_source

        return {"dtype": str(self.model.torch_dtype).replace("torch.", ""), "quantization": self.model.quantization,
                "quant_group_size": self.model.quant_group_size if self.model.quantization == "int4" else None,
                "lm_head_quantization": self.model.lm_head_quantization,
                "quant_calibration": calibration_source(self.model.quant_calibration),
                "quant_calibration_samples": self.model.quant_calibration_samples
                if self.model.quant_calibration != "none" else None,
                "kv_cache_dtype": self.cache.kv_cache_dtype, "formats": [f.as_dict() for f in self.formats]}

    @classmethod
    def create(cls, model: Optional[str] = None, **kwargs: Any) -> "EngineConfig":
        """Build from flat keyword arguments (the LLM() and CLI surface)."""
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "parallel": {}, "speculative": {}}
        owners = {
            "model": ModelConfig.__dataclass_fields__, "cache": CacheConfig.__dataclass_fields__,
            "scheduler": SchedulerConfig.__dataclass_fields__, "parallel": ParallelConfig.__dataclass_fields__,
            "speculative": SpeculativeConfig.__dataclass_fields__,
        }
        speculative = kwargs.pop("speculative", None)  # LLM(speculative={"method": "ngram", "num_tokens": 4})
        if isinstance(speculative, dict):
            spec = dict(speculative)
            if "num_tokens" in spec:
                spec["num_speculative_tokens"] = spec.pop("num_tokens")
            if "model" in spec:
                spec["speculative_model"] = spec.pop("model")
            kwargs.update({k: v for k, v in spec.items() if k != "method"}, speculative_method=spec.get("method"))
        if "speculative_method" in kwargs:
            kwargs["method"] = kwargs.pop("speculative_method")
        device = kwargs.pop("device", None) or "auto"
        attention_backend = kwargs.pop("attention_backend", None) or "auto"
        deterministic = bool(kwargs.pop("deterministic", False))
        enforce_eager = bool(kwargs.pop("enforce_eager", False))
        if "scheduling_policy" in kwargs:
            kwargs["policy"] = kwargs.pop("scheduling_policy")
        for key, value in kwargs.items():
            if value is None:
                continue
            for part, fields in owners.items():
                if key in fields:
                    parts[part][key] = value
                    break
            else:
                raise InvalidRequestError(f"unknown engine option {key!r}", param=key)
        model_cfg = ModelConfig(model=model or os.environ.get("LLMRT_MODEL", ""), **parts["model"])
        return cls(model=model_cfg, cache=CacheConfig(**parts["cache"]), scheduler=SchedulerConfig(**parts["scheduler"]),
                   parallel=ParallelConfig(**parts["parallel"]), speculative=SpeculativeConfig(**parts["speculative"]),
                   device=device, attention_backend=attention_backend, deterministic=deterministic,
                   enforce_eager=enforce_eager)


@dataclass
class ServerConfig:
    """The knobs of `llmrt serve` beyond the engine's: its flags read their defaults here."""

    max_waiting_requests: Optional[int] = None  # 429 while this many wait (None: unbounded)
    max_queue_delay_ms: Optional[float] = None  # 429 when the queue would delay a request longer (None: no limit)
    health_step_timeout: float = 30.0  # /health is 503 when no step completes this long while requests pend
    request_timeout: Optional[float] = None  # seconds a request may take unless it sets its own timeout
    # larger bodies are refused (400) before they are parsed; server.middleware.MAX_BODY_BYTES is the same default
    # (that module is shared with the router, which must not import torch through this one)
    max_body_bytes: int = 10 * 1024 * 1024
    max_request_tokens: int = 262144  # prompt tokens one request may carry, all its prompts together
    # The bounded pool that tokenizes, renders chat templates and checks grammars: up to 4 threads, leaving a
    # core to the event loop (on 2 cores, 1 thread: more would take the loop's CPU while bodies are tokenized).
    tokenizer_threads: int = max(1, min(4, (os.cpu_count() or 2) - 1))
