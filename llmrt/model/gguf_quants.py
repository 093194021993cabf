"""Our dequantizers of GGUF block types (torch, vectorised over blocks): Q8_0, Q4_0, Q4_K, Q5_K, Q6_K; and the
4-bit types (Q4_0, Q4_1, Q4_K) as int4 rows, unchanged integers with a scale and zero per 32 values.

Layouts are llama.cpp's (ggml-quants.c); tests check them bit for bit against `gguf.quants.dequantize`.
Input: the raw bytes as uint8 [..., n_blocks * block_bytes]; output float32 [..., n_blocks * block_values].
"""
from __future__ import annotations

from typing import Callable

import torch

QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian -> float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _blocks(raw: torch.Tensor, size: int) -> torch.Tensor:
    return raw.reshape(-1, size)


def dequant_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Blocks of 32: f16 d, int8 q[32]; w = d * q."""
    b = _blocks(raw, 34)
    return (_f16(b[:, :2])[:, None] * b[:, 2:].view(torch.int8).float()).reshape(-1)


def dequant_q4_0(raw: torch.Tensor) -> torch.Tensor:
    """Blocks of 32: f16 d, 16 bytes of nibbles (low: values 0-15, high: 16-31); w = d * (q - 8)."""
    b = _blocks(raw, 18)
    qs = b[:, 2:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=1).float() - 8
    return (_f16(b[:, :2])[:, None] * q).reshape(-1)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) pairs packed in 12 bytes -> two [blocks, 8] tensors."""
    s = s.to(torch.int32)
    lo_sc, lo_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    hi_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], 1).float(), torch.cat([lo_m, hi_m], 1).float()


def dequant_q4_k(raw: torch.Tensor) -> torch.Tensor:
    """Super-blocks of 256: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles in 4 chunks of 64."""
    b = _blocks(raw, 144)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32).float()  # sub-block 2j: low, 2j+1: high
    return (d[:, None, None] * sc[..., None] * q - (dmin[:, None] * mn)[..., None]).reshape(-1)


def dequant_q5_k(raw: torch.Tensor) -> torch.Tensor:
    """Like Q4_K plus a fifth bit per value from 32 bytes of qh (bit 2j: low nibbles of chunk j, 2j+1: high)."""
    b = _blocks(raw, 176)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48].to(torch.int32)
    qs = b[:, 48:].reshape(-1, 4, 32).to(torch.int32)
    bits = torch.stack([(qh >> i) & 1 for i in range(8)], dim=1)  # [blocks, 8, 32]
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32) + 16 * bits
    return (d[:, None, None] * sc[..., None] * q.float() - (dmin[:, None] * mn)[..., None]).reshape(-1)


def dequant_q6_k(raw: torch.Tensor) -> torch.Tensor:
    """Super-blocks of 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d."""
    b = _blocks(raw, 210)
    ql = b[:, :128].reshape(-1, 2, 64).to(torch.int32)
    qh = b[:, 128:192].reshape(-1, 2, 32).to(torch.int32)
    sc = b[:, 192:208].view(torch.int8).float().reshape(-1, 2, 8)
    d = _f16(b[:, 208:210])
    q1 = (ql[..., :32] & 0xF) | ((qh & 3) << 4)
    q2 = (ql[..., 32:] & 0xF) | (((qh >> 2) & 3) << 4)
    q3 = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    q = torch.stack([q1, q2, q3, q4], dim=2).float() - 32  # [blocks, half, 4 groups of 32, 32]
    # value l of group g in a half uses scale index 2g + l // 16
    scale = sc.reshape(-1, 2, 4, 2)[..., None].expand(-1, 2, 4, 2, 16).reshape(-1, 2, 4, 32)
    return (d[:, None, None, None] * scale * q).reshape(-1)


def int4_q4_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 as (q uint8 [blocks, 32], scale [blocks], zero [blocks]) with w = (q - 8) * scale + zero: zero is 0."""
    b = _blocks(raw, 18)
    qs = b[:, 2:]
    d = _f16(b[:, :2])
    return torch.cat([qs & 0xF, qs >> 4], dim=1), d, torch.zeros_like(d)


def int4_q4_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 (blocks of 32: f16 d, f16 m, 16 bytes of nibbles; w = d * q + m) as int4 rows: zero = m + 8 d."""
    b = _blocks(raw, 20)
    qs = b[:, 4:]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return torch.cat([qs & 0xF, qs >> 4], dim=1), d, m + 8 * d


def int4_q4_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K as int4 rows of its 8 sub-blocks of 32 per super-block: scale = d * sc, zero = 8 d sc - dmin * m."""
    b = _blocks(raw, 144)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 32)
    scale = (d[:, None] * sc).reshape(-1)
    return q, scale, 8 * scale - (dmin[:, None] * mn).reshape(-1)


# GGUF types whose integers our int4 method keeps as they are (group size 32).
INT4_ROWS: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {
    "Q4_0": int4_q4_0, "Q4_1": int4_q4_1, "Q4_K": int4_q4_k,
}

DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": dequant_q8_0, "Q4_0": dequant_q4_0, "Q4_K": dequant_q4_k, "Q5_K": dequant_q5_k, "Q6_K": dequant_q6_k,
}
