"""The `cpu_paged` backend: decodes read K/V blocks where they lie in the paged cache (a small C++ kernel), instead
of gathering every sequence's blocks into a padded copy per layer per step as the `torch` backend does.

The kernel (csrc/paged_decode.cpp) also stores the step's new K/V rows at their slots: a decode-only step's
attention is one call per layer (`paged_decode_write`), other steps store with `cache_write` and run each prefill
span through a fused causal attention kernel (csrc/prefill_attention.cpp; torch's SDPA for head dims it does not
take). int8/fp8 KV caches and CUDA keep `torch`'s code throughout. The kernel is
compiled once per source, ISA flags (the capability table's `kernel_isa`) and torch version into
`$LLMRT_CACHE_DIR/attention` (default ~/.cache/llmrt/attention; llmrt/kernels/build.py, shared with the linear
kernels) and later processes only load the .so. Where it cannot be built (no compiler,
LLMRT_ATTENTION_KERNEL=0) the backend is not offered and `auto` picks `torch`.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import torch

from llmrt.attention.base import register_attention_backend
from llmrt.attention.kv_quant import is_quantized
from llmrt.attention.torch_sdpa import TorchAttentionBackend, TorchAttentionMetadata
from llmrt.hardware import cpu_flags, kernel_isa
from llmrt.kernels import ISA_FLAGS
from llmrt.kernels.build import load_or_compile

if TYPE_CHECKING:
    from llmrt.model.layers.attention import Attention

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
PREFILL_SOURCE = Path(__file__).parent / "csrc" / "prefill_attention.cpp"
VEC_LANES = Path(__file__).parents[1] / "kernels" / "csrc" / "vec_lanes.h"  # SOURCE includes it: in the build key
LANE_SUM = Path(__file__).parents[1] / "kernels" / "csrc" / "lane_sum.h"  # attention_common.h includes it
COMMON = Path(__file__).parent / "csrc" / "attention_common.h"  # both sources include it
# No -ffast-math: results must not depend on how many sequences share a step (the vector path's sums are in a
# fixed order; the reference loop's `omp simd` reductions vectorize under -fopenmp alone).
_CFLAGS = ["-O3", "-fopenmp"]
_FLOAT = (torch.float32, torch.bfloat16)


def _cflags() -> list[str]:
    return _CFLAGS + ISA_FLAGS.get(kernel_isa() or "", [])


@dataclass(frozen=True)
class AttentionKernels:
    """The loaded ops (torch.ops.llmrt_attn): decode, decode after storing the new K/V, and the store alone."""

    decode: Callable[..., torch.Tensor]  # (q, k_cache, v_cache, tables, lens, scale, window) -> out
    decode_write: Callable[..., torch.Tensor]  # (q, k, v, slots, k_cache, v_cache, tables, lens, scale, window)
    cache_write: Callable[..., None]  # (k, v, slots, k_cache, v_cache)
    prefill_attention: Callable[..., torch.Tensor]  # (q, k, v, scale, window) -> out, one causal span
    prefill_supports: Callable[[int], bool]  # whether prefill_attention takes this head dim in this build
    set_bf16dot: Callable[[bool], bool]  # bf16 scores (decode K pass, prefill) by vdpbf16ps on or off; returns before


@functools.lru_cache(maxsize=None)
def load_kernel() -> Optional[AttentionKernels]:
    """The attention ops, loaded from the cache or compiled into it; None where they cannot be."""
    if os.environ.get("LLMRT_ATTENTION_KERNEL", "1").lower() in ("0", "off"):
        return None
    try:
        b = load_or_compile("attention", "llmrt_paged_decode", [SOURCE, PREFILL_SOURCE], _cflags(),
                           [VEC_LANES, LANE_SUM, COMMON])
    except Exception as e:  # no compiler or ninja: the torch backend still works
        logger.warning("cpu_paged attention kernel unavailable (%s: %s); using the torch backend",
                       type(e).__name__, (str(e).strip().splitlines() or [""])[-1])
        return None
    logger.info("cpu_paged attention kernel %s in %.2f s (%s)", "loaded from cache" if b.how == "cached"
                else "compiled", b.seconds, b.path)
    ns = torch.ops.llmrt_attn
    kernels = AttentionKernels(ns.paged_decode.default, ns.paged_decode_write.default, ns.cache_write.default,
                               ns.prefill_attention.default, ns.prefill_supports.default, ns.set_bf16dot.default)
    # vdpbf16ps for bf16 scores (decode and prefill) where the capability table says the CPU has it (AVX-512 build)
    kernels.set_bf16dot(kernel_isa() == "avx512" and "avx512_bf16" in cpu_flags())
    return kernels


def _heads_contiguous(q: torch.Tensor) -> torch.Tensor:
    """q as the kernel reads it: each token's heads contiguous (tokens may be strided, as views into qkv are)."""
    return q if q.stride(-1) == 1 and q.stride(1) == q.shape[2] else q.contiguous()


@register_attention_backend
class CpuPagedAttentionBackend(TorchAttentionBackend):
    """CPU decodes straight from the paged cache, K/V stores in the same call; prefills as the `torch` backend."""

    name = "cpu_paged"
    device_types = ("cpu",)
    priority = 10
    replayable = True

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return device.type == "cpu" and load_kernel() is not None

    def forward(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchAttentionMetadata) -> torch.Tensor:
        k_cache = layer.k_cache
        plain = k_cache.dtype in _FLOAT and k.dtype in _FLOAT and v.dtype == k.dtype and k.stride(-1) == 1 \
            and v.stride(-1) == 1
        if plain and meta.num_decodes and not meta.prefills and q.dtype in _FLOAT:
            # A decode-only step: store and attend in one call, no copies (the kernel reads q, k and v where the
            # qkv projection left them and widens bf16 / rounds the bf16 output itself).
            return load_kernel().decode_write(
                _heads_contiguous(q), k, v, meta.slot_mapping, k_cache, layer.v_cache, meta.decode_block_tables,
                meta.decode_context_lens, layer.scale, layer.sliding_window or 0)
        return super().forward(layer, q, k, v, meta)

    def graph_inputs(self, meta: TorchAttentionMetadata, kv_cache_dtype: torch.dtype,
                     compute_dtype: torch.dtype) -> Optional[list[torch.Tensor]]:
        """A decode-only step of float q over float caches is one `decode_write` a layer, given the slots, tables
        and lengths (the tables' width may change from step to step: the kernel reads their stride)."""
        if not meta.num_decodes or meta.prefills or kv_cache_dtype not in _FLOAT or compute_dtype not in _FLOAT:
            return None
        return [meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens]

    def _write(self, layer: "Attention", k: torch.Tensor, v: torch.Tensor, meta: TorchAttentionMetadata,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache = layer.k_cache
        if k_cache.dtype in _FLOAT and k.dtype in _FLOAT and v.dtype == k.dtype and k.stride(-1) == 1 \
                and v.stride(-1) == 1:
            load_kernel().cache_write(k, v, meta.slot_mapping, k_cache, layer.v_cache)
            return k, v
        return super()._write(layer, k, v, meta, dtype)

    @staticmethod
    def _prefill(layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: Optional[torch.Tensor]) -> torch.Tensor:
        """A prefill span's causal attention by the fused kernel (`prefill_attention`), else torch's SDPA."""
        out = prefill_attention(q, k, v, layer.scale, layer.sliding_window or 0)
        return out if out is not None else TorchAttentionBackend._prefill(layer, q, k, v, mask)

    def _decode(self, layer: "Attention", q: torch.Tensor, meta: TorchAttentionMetadata,  # type: ignore[override]
                block_size: int) -> torch.Tensor:
        k_cache, v_cache = layer.k_cache, layer.v_cache
        if is_quantized(k_cache) or k_cache.dtype not in _FLOAT:
            return TorchAttentionBackend._decode(layer, q, meta, block_size)
        decode = load_kernel().decode
        window = layer.sliding_window or 0
        if q.dtype not in _FLOAT:
            q32 = q.float().contiguous()
            return decode(q32, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, layer.scale,
                          window).to(q.dtype)
        return decode(_heads_contiguous(q), k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                      layer.scale, window)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int) -> Optional[torch.Tensor]:
    """Causal attention of a span's n queries q [n, H, D] (the last n positions) over its context k, v [ctx, KVH, D]
    by csrc/prefill_attention.cpp, or None where that kernel does not apply (a head dim or dtype it does not
    take, LLMRT_PREFILL_ATTENTION=0): the caller then uses torch's SDPA.

    torch's CPU flash SDPA ran the 64-512 token spans of a batched prefill at 30-80 GFLOP/s on 2 cores, and two
    float32 bmms around a softmax at 30-55; the fused kernel keeps a tile of query rows' scores, running softmax
    and outputs in registers, block by block of keys (float32 throughout, the output rounded once; bf16 scores by
    vdpbf16ps where set_bf16dot is on: 0.88x the time, products exact in float32).
    """
    kernel = prefill_kernel(q.shape[-1])
    if kernel is None or q.dtype not in _FLOAT or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    q, k, v = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous() for t in (q, k, v))
    return kernel(q, k, v, scale, window)


@functools.lru_cache(maxsize=None)
def prefill_kernel(head_dim: int) -> Optional[Callable[..., torch.Tensor]]:
    """The fused prefill op for this head dim, or None (no kernel, a head dim it does not take in this build, or
    LLMRT_PREFILL_ATTENTION=0): decided once, not per span and layer."""
    kernels = load_kernel()
    if kernels is None or os.environ.get("LLMRT_PREFILL_ATTENTION", "1").lower() in ("0", "off"):
        return None
    return kernels.prefill_attention if kernels.prefill_supports(head_dim) else None
