"""The `cpu_paged` backend: decodes read K/V blocks where they lie in the paged cache (a small C++ kernel), instead
of gathering every sequence's blocks into a padded copy per layer per step as the `torch` backend does.

The kernel (csrc/paged_decode.cpp) also stores the step's new K/V rows at their slots: a decode-only step's
attention is one call per layer (`paged_decode_write`), other steps store with `cache_write` and run prefill
spans through the `torch` backend's code. int8/fp8 KV caches and CUDA keep `torch`'s code throughout. The kernel is
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
PREFILL_SOURCE = Path(__file__).parent / "csrc" / "prefill_softmax.cpp"
VEC_LANES = Path(__file__).parents[1] / "kernels" / "csrc" / "vec_lanes.h"  # SOURCE includes it: in the build key
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
    prefill_softmax: Callable[..., torch.Tensor]  # (scores, n, q_offset, scale, window, dtype) -> probabilities
    set_bf16dot: Callable[[bool], bool]  # the bf16 K pass by vdpbf16ps on or off; returns the previous setting


@functools.lru_cache(maxsize=None)
def load_kernel() -> Optional[AttentionKernels]:
    """The attention ops, loaded from the cache or compiled into it; None where they cannot be."""
    if os.environ.get("LLMRT_ATTENTION_KERNEL", "1").lower() in ("0", "off"):
        return None
    try:
        b = load_or_compile("attention", "llmrt_paged_decode", [SOURCE, PREFILL_SOURCE], _cflags(), [VEC_LANES])
    except Exception as e:  # no compiler or ninja: the torch backend still works
        logger.warning("cpu_paged attention kernel unavailable (%s: %s); using the torch backend",
                       type(e).__name__, (str(e).strip().splitlines() or [""])[-1])
        return None
    logger.info("cpu_paged attention kernel %s in %.2f s (%s)", "loaded from cache" if b.how == "cached"
                else "compiled", b.seconds, b.path)
    ns = torch.ops.llmrt_attn
    kernels = AttentionKernels(ns.paged_decode.default, ns.paged_decode_write.default, ns.cache_write.default,
                               ns.prefill_softmax.default, ns.set_bf16dot.default)
    # vdpbf16ps for bf16 K passes where the capability table says the CPU has it (the AVX-512 build only)
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
        """A prefill span's attention as two batched matmuls around our causal softmax (`prefill_attention`)."""
        if q.dtype not in _FLOAT or os.environ.get("LLMRT_PREFILL_ATTENTION", "1").lower() in ("0", "off"):
            return TorchAttentionBackend._prefill(layer, q, k, v, mask)
        return prefill_attention(q, k, v, layer.scale, layer.sliding_window or 0)

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


# Query rows per matmul pair: bounds the float32 scores (query heads x rows x context x 4 bytes: 12 heads, 2048
# keys: 24 MiB) and skips the keys after a chunk's last query (all masked).
PREFILL_QUERY_CHUNK = 128


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """Causal attention of a span's n queries q [n, H, D] (the last n positions) over its context k, v [ctx, KVH, D].

    torch's CPU flash SDPA runs these spans at 30-80 GFLOP/s; this computes the scores of each KV head's group of
    query heads with one float32 bmm (bf16 inputs are exact in float32), masks, scales and normalizes them in one
    pass (csrc/prefill_softmax.cpp: masked probabilities are zeros), and multiplies by V with a second float32 bmm,
    rounding to the inputs' dtype once at the end (the error of torch's flash kernel, measured in tests). The
    squares above the diagonal cost matmul work, bounded by taking queries PREFILL_QUERY_CHUNK at a time, each
    chunk against the keys up to its last query.
    """
    n, heads, dim = q.shape
    ctx, kv_heads = k.shape[0], k.shape[1]
    group = heads // kv_heads
    offset = ctx - n
    softmax = load_kernel().prefill_softmax
    # [KVH, group * n, D]: a KV head's query heads one after another, so one bmm per KV head covers its group
    qg = q.view(n, kv_heads, group, dim).permute(1, 2, 0, 3)
    kt = k.permute(1, 2, 0)  # [KVH, D, ctx]
    vt = v.permute(1, 0, 2)  # [KVH, ctx, D]
    if q.dtype != torch.float32:
        # float32 probabilities and V too: bf16 probabilities were ~10% faster but 1.5x the error of torch's flash
        # kernel, and flipped a near-tie greedy token of W2 against vLLM and our own earlier output
        qg, kt, vt = qg.float(), kt.float(), vt.float()
    out = torch.empty(kv_heads, group, n, dim, dtype=q.dtype)
    for c0 in range(0, n, PREFILL_QUERY_CHUNK):
        c1 = min(n, c0 + PREFILL_QUERY_CHUNK)
        keys = offset + c1  # keys after the chunk's last query are masked for all its rows
        lo = max(0, offset + c0 + 1 - window) if window > 0 else 0
        m = c1 - c0
        s = torch.bmm(qg[:, :, c0:c1].reshape(kv_heads, group * m, dim), kt[:, :, lo:keys])
        p = softmax(s.view(kv_heads * group * m, keys - lo), m, offset + c0 - lo, scale, window, torch.float32)
        out[:, :, c0:c1] = torch.bmm(p.view(kv_heads, group * m, keys - lo), vt[:, lo:keys]).view(
            kv_heads, group, m, dim)
    return out.permute(2, 0, 1, 3).reshape(n, heads, dim)
