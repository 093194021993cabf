"""The KV cache's storage format: the model dtype, or 8-bit values with one float32 scale per token and head.

An 8-bit block row is [head_dim values | 4 bytes of the float32 scale], so the scales live in the same block
tensors as the values: block copies (copy-on-write), swap to host and back, and prefix-cache reuse all carry
them with no code of their own. The values are int8 (symmetric, scale = max|x| / 127; the cache tensor's dtype
is int8) or fp8 e4m3 (scale = max|x| / 448; stored as uint8 bytes, because index_copy_ and cat do not take
float8 tensors on every device, and viewed as float8_e4m3fn to convert). Attention dequantizes what it reads.
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
_STORAGE = {"int8": torch.int8, "fp8": torch.uint8}  # the cache tensor's dtype says which format it holds
_E4M3_MAX = 448.0


def kv_storage(head_dim: int, model_dtype: torch.dtype, kv_cache_dtype: str) -> tuple[torch.dtype, int]:
    """(element dtype, stored last dim) of one token-head row of the cache."""
    if kv_cache_dtype == "auto":
        return model_dtype, head_dim
    if kv_cache_dtype in _STORAGE:
        if head_dim % _SCALE_BYTES:
            raise UnsupportedError(f"--kv-cache-dtype {kv_cache_dtype} needs a head_dim divisible by 4 (this "
                                   f"model's is {head_dim}); use --kv-cache-dtype auto", param="kv_cache_dtype")
        return _STORAGE[kv_cache_dtype], head_dim + _SCALE_BYTES
    raise UnsupportedError(f"kv_cache_dtype {kv_cache_dtype!r} is not built; use auto, int8 or fp8",
                           param="kv_cache_dtype")


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
    """True for an 8-bit cache (int8 or fp8 values + scales in each row)."""
    return cache.dtype in (torch.int8, torch.uint8)


def quantize_kv(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """[tokens, heads, dim] float -> [tokens, heads, dim + 4] rows of `storage` (the cache's dtype: int8, or
    uint8 holding fp8 e4m3), one scale per token and head."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    if storage == torch.int8:
        scale = (amax / 127.0).clamp(min=1e-8)
        q = torch.round(xf / scale).clamp(-127, 127).to(torch.int8)
    else:
        scale = (amax / _E4M3_MAX).clamp(min=1e-8)
        q = (xf / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([q, scale.view(q.dtype)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., heads, dim + 4] 8-bit rows -> [..., heads, dim] in `dtype`."""
    dim = rows.shape[-1] - _SCALE_BYTES
    scale = rows[..., dim:].contiguous().view(torch.float32)
    values = rows[..., :dim]
    if rows.dtype == torch.uint8:
        values = values.contiguous().view(torch.float8_e4m3fn)
    return (values.to(torch.float32) * scale).to(dtype)
