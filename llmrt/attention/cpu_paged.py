"""The `cpu_paged` backend: decodes read K/V blocks where they lie in the paged cache (a small C++ kernel), instead
of gathering every sequence's blocks into a padded copy per layer per step as the `torch` backend does.

Prefill spans, int8 KV caches and anything the kernel does not cover go through the `torch` backend's code. The
kernel (csrc/paged_decode.cpp) is compiled once per source and torch version into `$LLMRT_CACHE_DIR/attention`
(default ~/.cache/llmrt/attention) and later processes only load the .so. Where it cannot be built (no compiler,
LLMRT_ATTENTION_KERNEL=0) the backend is not offered and `auto` picks `torch`.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from llmrt.attention.base import register_attention_backend
from llmrt.attention.kv_quant import is_quantized
from llmrt.attention.torch_sdpa import TorchAttentionBackend, TorchAttentionMetadata
from llmrt.hardware import cpu_flags

if TYPE_CHECKING:
    from llmrt.model.layers.attention import Attention

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_CFLAGS = ["-O3", "-fopenmp", "-ffast-math"]


def _build_dir() -> Path:
    base = os.environ.get("LLMRT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "llmrt")
    isa = ["-mavx2", "-mfma"] if {"avx2", "fma"} <= cpu_flags() else []
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(_CFLAGS + isa).encode())
    h.update(torch.__version__.encode())
    return Path(base) / "attention" / f"paged-{h.hexdigest()[:16]}"


@functools.lru_cache(maxsize=None)
def load_kernel() -> Optional[object]:
    """torch.ops.llmrt_attn.paged_decode, loaded from the cache or compiled into it; None where it cannot be."""
    if os.environ.get("LLMRT_ATTENTION_KERNEL", "1").lower() in ("0", "off"):
        return None
    d = _build_dir()
    done = d / "ok"
    t = time.perf_counter()
    try:
        if not done.is_file():
            from torch.utils import cpp_extension  # imported only to compile: it pulls in setuptools

            d.mkdir(parents=True, exist_ok=True)
            isa = ["-mavx2", "-mfma"] if {"avx2", "fma"} <= cpu_flags() else []
            cpp_extension.load(name="llmrt_paged_decode", sources=[str(SOURCE)], extra_cflags=_CFLAGS + isa,
                               extra_ldflags=["-fopenmp"], build_directory=str(d), is_python_module=False)
            done.write_text(str(max(d.glob("llmrt_paged_decode*.so"), key=lambda p: p.stat().st_mtime)))
        else:
            torch.ops.load_library(done.read_text().strip())
    except Exception as e:  # no compiler or ninja: the torch backend still works
        logger.warning("cpu_paged attention kernel unavailable (%s: %s); using the torch backend",
                       type(e).__name__, (str(e).strip().splitlines() or [""])[-1])
        return None
    logger.info("cpu_paged attention kernel ready in %.2f s (%s)", time.perf_counter() - t, d)
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
        out = kernel(q.float().contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                     layer.scale, window)
        return out.to(q.dtype)
