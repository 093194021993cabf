"""The KV cache's storage format: the model dtype, or int8 with one float32 scale per token and head.

An int8 block row is [head_dim int8 values | 4 bytes of the float32 scale], so the scales live in the same
block tensors as the values: block copies (copy-on-write), swap to host and back, and prefix-cache reuse all
carry them with no code of their own.
"""
from __future__ import annotations

import math
import mmap
from typing import TYPE_CHECKING

import torch

from llmrt.errors import UnsupportedError

if TYPE_CHECKING:
    from llmrt.model.models.base import KVCacheSpec

_SCALE_BYTES = 4


def kv_storage(head_dim: int, model_dtype: torch.dtype, kv_cache_dtype: str) -> tuple[torch.dtype, int]:
    """(element dtype, stored last dim) of one token-head row of the cache."""
    if kv_cache_dtype == "auto":
        return model_dtype, head_dim
    if kv_cache_dtype == "int8":
        if head_dim % _SCALE_BYTES:
            raise UnsupportedError(f"--kv-cache-dtype int8 needs a head_dim divisible by 4 (this model's is "
                                   f"{head_dim}); use --kv-cache-dtype auto", param="kv_cache_dtype")
        return torch.int8, head_dim + _SCALE_BYTES
    raise UnsupportedError(f"kv_cache_dtype {kv_cache_dtype!r} is not built; use auto or int8", param="kv_cache_dtype")


def kv_bytes_per_token(spec: "KVCacheSpec", model_dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """K and V bytes of one token over all layers, scales included."""
    dtype, dim = kv_storage(spec.head_dim, model_dtype, kv_cache_dtype)
    return 2 * spec.num_layers * spec.num_kv_heads * dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv(spec: "KVCacheSpec", num_blocks: int, block_size: int, model_dtype: torch.dtype,
                kv_cache_dtype: str, device: torch.device, host: bool = False,
                pin: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) of [num_blocks, block_size, kv_heads, stored dim]: zeroed on the device (padded reads
    touch unwritten slots, and 0 * NaN would poison outputs); uninitialised in a host swap pool."""
    dtype, dim = kv_storage(spec.head_dim, model_dtype, kv_cache_dtype)
    shape = (num_blocks, block_size, spec.num_kv_heads, dim)
    if host:
        make = lambda: torch.empty(shape, dtype=dtype, pin_memory=pin)  # noqa: E731
    elif device.type == "cpu":
        make = lambda: _zeroed_on_touch(shape, dtype)  # noqa: E731
    else:
        make = lambda: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
    return [(make(), make()) for _ in range(spec.num_layers)]


def _zeroed_on_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in anonymous memory: the OS gives zero pages on first touch, so start-up pays no memset
    of the whole cache (2 GiB by default: seconds) and blocks never used never take memory."""
    count = math.prod(shape)
    buf = mmap.mmap(-1, max(1, count * torch.empty((), dtype=dtype).element_size()))
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)  # the tensor keeps `buf` alive


def is_quantized(cache: torch.Tensor) -> bool:
    """True for an int8 cache (values + scales in each row)."""
    return cache.dtype == torch.int8


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, dim] float -> [tokens, heads, dim + 4] int8 rows, symmetric per token and head."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-8)
    q = torch.round(xf / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., heads, dim + 4] int8 rows -> [..., heads, dim] in `dtype`."""
    dim = rows.shape[-1] - _SCALE_BYTES
    scale = rows[..., dim:].contiguous().view(torch.float32)
    return (rows[..., :dim].to(torch.float32) * scale).to(dtype)
