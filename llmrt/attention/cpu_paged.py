"""The `cpu_paged` backend: decodes read K/V blocks where they lie in the paged cache (a small C++ kernel), instead
of gathering every sequence's blocks into a padded copy per layer per step as the `torch` backend does.

Prefill spans, int8 KV caches and anything the kernel does not cover go through the `torch` backend's code. The
kernel (csrc/paged_decode.cpp) is compiled once per source and torch version into `$LLMRT_CACHE_DIR/attention`
(default ~/.cache/llmrt/attention; llmrt/kernels/build.py, shared with the linear kernels) and later processes
only load the .so. Where it cannot be built (no compiler,
LLMRT_ATTENTION_KERNEL=0) the backend is not offered and `auto` picks `torch`.
"""
from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from llmrt.attention.base import register_attention_backend
from llmrt.attention.kv_quant import is_quantized
from llmrt.attention.torch_sdpa import TorchAttentionBackend, TorchAttentionMetadata
from llmrt.hardware import cpu_flags
from llmrt.kernels.build import load_or_compile

if TYPE_CHECKING:
    from llmrt.model.layers.attention import Attention

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
# No -ffast-math: results must not depend on how many sequences share a step (the vector path's sums are in a
# fixed order; the reference loop's `omp simd` reductions vectorize under -fopenmp alone).
_CFLAGS = ["-O3", "-fopenmp"]


def _cflags() -> list[str]:
    flags = cpu_flags()
    isa = ["-mavx2", "-mfma"] if {"avx2", "fma"} <= flags else []
    return _CFLAGS + isa + (["-mavx512f"] if isa and "avx512f" in flags else [])


@functools.lru_cache(maxsize=None)
def load_kernel() -> Optional[object]:
    """torch.ops.llmrt_attn.paged_decode, loaded from the cache or compiled into it; None where it cannot be."""
    if os.environ.get("LLMRT_ATTENTION_KERNEL", "1").lower() in ("0", "off"):
        return None
    try:
        b = load_or_compile("attention", "llmrt_paged_decode", [SOURCE], _cflags())
    except Exception as e:  # no compiler or ninja: the torch backend still works
        logger.warning("cpu_paged attention kernel unavailable (%s: %s); using the torch backend",
                       type(e).__name__, (str(e).strip().splitlines() or [""])[-1])
        return None
    logger.info("cpu_paged attention kernel %s in %.2f s (%s)", "loaded from cache" if b.how == "cached"
                else "compiled", b.seconds, b.path)
    return torch.ops.llmrt_attn.paged_decode.default


@register_attention_backend
class CpuPagedAttentionBackend(TorchAttentionBackend):
    """CPU decodes straight from the paged cache; everything else as the `torch` backend."""

    name = "cpu_paged"
    device_types = ("cpu",)
    priority = 10

    @classmethod
    def supports(cls, device: torch.device) -> bool:
        return device.type == "cpu" and load_kernel() is not None

    def _decode(self, layer: "Attention", q: torch.Tensor, meta: TorchAttentionMetadata,  # type: ignore[override]
                block_size: int) -> torch.Tensor:
        k_cache, v_cache = layer.k_cache, layer.v_cache
        if is_quantized(k_cache) or k_cache.dtype not in (torch.float32, torch.bfloat16):
            return TorchAttentionBackend._decode(layer, q, meta, block_size)
        kernel = load_kernel()
        window = layer.sliding_window or 0
        if q.dtype not in (torch.float32, torch.bfloat16):
            q32 = q.float().contiguous()
            return kernel(q32, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, layer.scale,
                          window).to(q.dtype)
        # No copies per layer per step: the kernel reads q where the qkv projection left it (tokens strided) and
        # widens bf16 queries / rounds bf16 outputs itself.
        if q.stride(-1) != 1 or q.stride(1) != q.shape[2]:
            q = q.contiguous()
        return kernel(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, layer.scale, window)
