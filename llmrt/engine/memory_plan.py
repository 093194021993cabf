"""Memory accounting: how weights, activations and KV blocks split device memory, and how many sequences fit.

The engine measures weights and the activation peak at start-up and sizes its KV cache with the formulas here;
`llmrt plan` applies the same formulas to any HF config.json without weights: the weights are counted on a
model built on the meta device (the engine's own model classes), the KV bytes per token come from the same
`KVCacheSpec`, and the activation peak is estimated per token from the layer shapes (see
`estimate_activation_peak`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from llmrt.config import context_limit

_MiB = 1 << 20
DEFAULT_CONTEXTS = (1024, 4096, 32768)


@dataclass
class MemoryPlan:
    """How device memory is split: measured at start-up by the engine, estimated by `llmrt plan`."""

    weights_bytes: int
    activation_peak_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    contexts: tuple[int, ...] = field(default=DEFAULT_CONTEXTS)
    kv_format: str = ""  # e.g. "bfloat16" or "int8 + float32 scale per token and head"
    dense_copy_bytes: int = 0  # of weights_bytes: dense copies kept beside packed layers (`llmrt plan`'s count)

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of all KV blocks."""
        return self.num_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def max_tokens(self) -> int:
        """Tokens the KV cache holds at once."""
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        """Weights, activation peak and KV cache together."""
        return self.weights_bytes + self.activation_peak_bytes + self.kv_cache_bytes

    def max_concurrent_sequences(self, context_len: int) -> int:
        """Sequences of `context_len` tokens whose KV fits at once."""
        return self.num_blocks // -(-context_len // self.block_size)

    def concurrency(self) -> dict[int, int]:
        """Max concurrent sequences at each of `contexts`."""
        return {c: self.max_concurrent_sequences(c) for c in self.contexts}

    def describe(self) -> str:
        """One log line."""
        fits = ", ".join(f"{_tokens(c)}: {n}" for c, n in self.concurrency().items())
        return (f"memory: weights {self.weights_bytes / _MiB:.1f} MiB, activation peak "
                f"{self.activation_peak_bytes / _MiB:.1f} MiB, KV cache {self.kv_cache_bytes / _MiB:.1f} MiB "
                f"= {self.num_blocks} blocks x {self.block_size} tokens x {self.kv_bytes_per_token} B/token "
                f"{'(' + self.kv_format + ') ' if self.kv_format else ''}"
                f"(max {self.max_tokens} tokens); max concurrent sequences by context: {fits}")

    def as_dict(self) -> dict[str, Any]:
        """Every figure, for --json and logs."""
        d = asdict(self)
        d.update(kv_cache_bytes=self.kv_cache_bytes, max_tokens=self.max_tokens, total_bytes=self.total_bytes,
                 max_concurrent_sequences={str(c): n for c, n in self.concurrency().items()})
        return d


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters (tied ones counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


FREE_MARGIN = 0.03  # of the memory free now, left to the allocator's rounding


def kv_budget_bytes(device_total: int, utilization: float, weights: int, activation: int,
                    used_elsewhere: int = 0, free: Optional[int] = None) -> int:
    """Bytes left for KV blocks on a device: its usable share minus weights, activations and other use; with
    `free` (what the device has free now, weights already loaded), never more than that less the activations and
    a margin: another engine of the process may hold its own share, and fewer blocks or a clear out-of-memory
    error beat a failed allocation."""
    budget = int(device_total * utilization) - weights - activation - used_elsewhere
    return budget if free is None else min(budget, int(free * (1 - FREE_MARGIN)) - activation)


def num_kv_blocks(budget_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Whole KV blocks that fit in `budget_bytes` (0 when nothing fits)."""
    return max(0, budget_bytes // (kv_bytes_per_token * block_size))


def estimate_activation_peak(hf_config: dict[str, Any], num_tokens: int, num_logit_rows: int,
                             compute_dtype: torch.dtype, kv_heads: int, head_dim: int, tp: int = 1,
                             fused: bool = False) -> int:
    """Estimated peak bytes of one forward pass of `num_tokens` tokens plus logits for `num_logit_rows` rows.

    `kv_heads` and the result are per tensor-parallel rank. Per token, the residual stream and its normed copy (2 x hidden) stay alive while a layer runs; the MLP adds
    the fused gate/up output, the activation and the product (gated: 5 x intermediate; plain GELU:
    3 x intermediate), attention the fused qkv output, rotated/normed q and k, the attention output (4 x q
    + 2 x kv). The peak is the larger phase. The logits step keeps the final hidden states plus float32 logits
    and their softmax. With `fused` (the fused CPU layer ops, llmrt/model/layers/fused.py) rotary works in place
    (no rotated copies of q and k).
    Measured against the engine's own tracking on CPU: within ~10% (tests/test_memory_plan).
    """
    c = hf_config
    hidden = c.get("hidden_size") or c["n_embd"]
    heads = c.get("num_attention_heads") or c["n_head"]
    gated = "n_embd" not in c  # the GPT-2 family has a plain MLP
    fused = fused and gated  # the GPT-2 family has no rotary
    inter = c.get("intermediate_size") or c.get("n_inner") or 4 * hidden
    q = heads * head_dim // tp
    kv = kv_heads * head_dim
    inter //= tp
    mlp = 2 * hidden + (5 if gated else 3) * inter  # the fused SiLU runs only decode-sized steps, not the peak's
    attn = 2 * hidden + (q + 2 * kv) + (3 * q + kv if fused else 4 * q + 2 * kv)
    elem = torch.empty((), dtype=compute_dtype).element_size()
    layer_peak = num_tokens * max(mlp, attn) * elem
    logits_peak = num_tokens * hidden * elem + num_logit_rows * (c["vocab_size"] // tp) * 4 * 2
    return max(layer_peak, logits_peak)


def plan_memory(hf_config: dict[str, Any], *, memory_bytes: int, dtype: torch.dtype,
                kv_dtype: Optional[torch.dtype] = None, tp: int = 1, block_size: int = 16,
                max_num_batched_tokens: int = 2048, max_num_seqs: int = 64, max_model_len: Optional[int] = None,
                utilization: float = 1.0, contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
                quantization: Optional[str] = None, quant_group_size: int = 32,
                kv_cache_dtype: str = "auto", pp: int = 1, fused: bool = False,
                lm_head_quantization: str = "auto", dense_weight_copy: str = "auto") -> MemoryPlan:
    """The per-device memory split for a model config on a device of `memory_bytes`, without any weights.
    With `pp` pipeline stages every stage's rank-0 shard is built on the meta device as the engine builds it (its
    layers; the embedding on the first stage, the norm and LM head on the last): weights are the heaviest
    stage's, KV per token counts one stage's layers, and the blocks are what that stage leaves (the engine takes
    the smallest block count over the ranks). `fused`: the activations of the fused CPU layer ops (smaller; the
    default plans for torch's ops, an upper bound). `dense_weight_copy`: as --dense-weight-copy, whether packed
    fp32/bf16 layers also keep their dense weights (decided against `memory_bytes` as the engine decides it)."""

    from llmrt.attention.kv_quant import kv_bytes_per_token
    from llmrt.hardware import compute_dtype
    from llmrt.model.loader import build_model
    from llmrt.model.quantization import get_quantization_config, resolve_lm_head

    from llmrt.distributed.parallel_state import building_shard

    arch = (hf_config.get("architectures") or [""])[0]
    from llmrt.model.quantization.gptq_awq import checkpoint_quantization

    quantization = quantization or checkpoint_quantization(hf_config)  # a GPTQ/AWQ config.json plans as such
    lm_head = resolve_lm_head(lm_head_quantization, quantization)
    quant = get_quantization_config(quantization, {"group_size": quant_group_size, "lm_head": lm_head,
                                                   "checkpoint": hf_config.get("quantization_config")})
    from llmrt.distributed.pipeline import building_stage

    weights, dense, spec = 0, 0, None
    for stage in range(pp):
        # rank 0's shard of each stage: split layers at 1/tp, norms (and few KV heads) replicated
        with building_shard(0, tp), building_stage(stage, pp):
            # computing as a CPU engine here would (the packed layouts below assume this machine's CPU too)
            model = build_model(hf_config, arch, dtype, compute_dtype(torch.device("cpu"), dtype), "meta", quant)
        stage_weights, stage_dense = _planned_weight_bytes(model, quant, dense_weight_copy, memory_bytes)
        if stage_weights > weights:
            weights, dense = stage_weights, stage_dense
        spec = spec or model.kv_cache_spec()
    assert spec is not None
    per_token = kv_bytes_per_token(spec, kv_dtype or dtype, kv_cache_dtype)
    limit = max_model_len or context_limit(hf_config)
    tokens = min(max_num_batched_tokens, limit)
    activation = estimate_activation_peak(hf_config, tokens, min(max_num_seqs, tokens), dtype,
                                          spec.num_kv_heads, spec.head_dim, tp, fused)
    budget = kv_budget_bytes(memory_bytes, utilization, weights, activation)
    blocks = num_kv_blocks(budget, per_token, block_size)
    fmt = str(kv_dtype or dtype).replace("torch.", "") if kv_cache_dtype == "auto" else \
        f"{kv_cache_dtype} + float32 scale per token and head"
    return MemoryPlan(weights, activation, per_token, block_size, blocks, contexts, kv_format=fmt,
                      dense_copy_bytes=dense)


def _planned_weight_bytes(model: torch.nn.Module, quant: Any, dense_weight_copy: str = "auto",
                          memory_bytes: int = 0) -> tuple[int, int]:
    """(bytes, of which dense copies): parameter bytes, with every quantized Linear's weight counted in its quantized size, and, where llmrt's CPU
    kernels load on this machine, every fp32/bf16 Linear in their packed layout (as a CPU engine here holds it),
    plus its dense weights where `dense_weight_copy` keeps them beside the packed ones."""
    from llmrt.model.layers.linear import Linear, UnquantizedLinearMethod, dense_copy_layers

    from llmrt.kernels import kernels
    from llmrt.kernels.packed import keep_dense_copy, packed_bytes

    layers, extra = dense_copy_layers(model)
    keep = bool(layers) and kernels() is not None and keep_dense_copy(dense_weight_copy, extra, memory_bytes)

    total = parameter_bytes(model)
    uses: dict[int, int] = {}  # a weight shared with another module (a tied LM head's) stays counted
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    for m in model.modules():
        if isinstance(m, Linear) and type(m.method) is not UnquantizedLinearMethod and m.quant_config is not None:
            held = sum(p.numel() * p.element_size() for n, p in m.named_parameters(recurse=False)
                       if n != "bias" and uses[id(p)] == 1)
            total += m.quant_config.weight_bytes(m.out_features, m.in_features) - held
        elif isinstance(m, Linear) and kernels() is not None and m.weight.dtype in (torch.float32, torch.bfloat16):
            # Packed for llmrt's CPU kernels (llmrt/kernels/packed.py); a tied LM head's copy comes on top.
            fmt = "fp32" if m.weight.dtype == torch.float32 else "bf16"
            total += packed_bytes(fmt, m.out_features, m.in_features) - (
                m.weight.numel() * m.weight.element_size() if uses[id(m.weight)] == 1 and not keep else 0)
    return total, extra if keep else 0
