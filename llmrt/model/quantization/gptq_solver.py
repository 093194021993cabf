"""GPTQ (Frantar et al., 2022) for one linear layer, its round-to-nearest baseline, and AutoGPTQ's packing.

Weights are stored as w = s * (q - z) per group of `group_size` inputs, q in [0, 15], z an integer, s float16 (the
GPTQ checkpoint convention; `gptq_awq.py` serves it). GPTQ quantizes the input columns in order and spreads each
column's rounding error over the columns not yet quantized, weighted by the inverse of the input Hessian
H = sum x x^T, so that the layer's output error ||X (W - Wq)^T||^2 on the calibration inputs is small rather than
the weight error. No act-order (the loader refuses permuted groups).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmrt.errors import InvalidRequestError

MAXQ = 15  # 4-bit
CLIP_GRID = tuple(1.0 - 0.025 * i for i in range(11))  # shrinks of a group's range tried, down to 0.75


@dataclass(frozen=True)
class QuantSpec:
    """How a layer is quantized: 4-bit, `group_size` inputs per (scale, zero), symmetric (z = 8) or not."""

    group_size: int = 32
    sym: bool = True
    clip_search: bool = True  # per group, the range shrink with the least squared weight error (AutoGPTQ's mse)


def fake_quantize(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """s * (q - z) with q = clamp(round(w / s) + z, 0, 15); s and z broadcast against w."""
    return s * (torch.clamp(torch.round(w / s) + z, 0, MAXQ) - z)


def group_params(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(s float32 [N] holding float16 values, z float32 [N] integer) for the group `w` [N, g]."""
    lo0, hi0 = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
    best_err = torch.full_like(lo0, float("inf"))
    best_s, best_z = torch.ones_like(lo0), torch.zeros_like(lo0)
    for shrink in (CLIP_GRID if spec.clip_search else (1.0,)):
        lo, hi = lo0 * shrink, hi0 * shrink
        if spec.sym:
            s = torch.maximum(-lo, hi) * 2 / MAXQ
            z = torch.full_like(s, (MAXQ + 1) // 2)
        else:
            s = (hi - lo) / MAXQ
            z = torch.round(-lo / s.clamp(min=1e-10))
            # The checkpoint stores z - 1 in a nibble (AutoGPTQ's format), so z = 0 cannot be written: an all-
            # positive group takes z = 1 and a scale that reaches its maximum from there.
            low = z < 1
            s = torch.where(low, hi / (MAXQ - 1), s)
            z = z.clamp(1, MAXQ)
        s = s.clamp(min=1e-8).half().float()  # as stored
        err = ((fake_quantize(w, s[:, None], z[:, None]) - w) ** 2).sum(1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
    return best_s, best_z


def _check(w: torch.Tensor, spec: QuantSpec) -> None:
    if w.shape[1] % spec.group_size or spec.group_size % 8:
        raise InvalidRequestError(f"a layer with {w.shape[1]} inputs cannot be quantized in groups of "
                                  f"{spec.group_size}", param="group_size")


def rtn_quantize(w: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round to nearest: (q int32 [N, K], z int32 [N, G], s float16 [N, G])."""
    _check(w, spec)
    n, k = w.shape
    g = w.float().view(n, k // spec.group_size, spec.group_size)
    params = [group_params(g[:, i], spec) for i in range(g.shape[1])]
    s = torch.stack([p[0] for p in params], 1)
    z = torch.stack([p[1] for p in params], 1)
    q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, MAXQ)
    return q.view(n, k).int(), z.int(), s.half()


def inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, in float64; the damping grows tenfold
    (up to 100x) while H is not positive definite."""
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0  # an input that never fires: any value, its weights are zeroed
    for attempt in range(3):
        hd = h + torch.eye(h.shape[0], dtype=h.dtype, device=h.device) * damp * (10 ** attempt) * torch.diag(h).mean()
        chol, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
    raise InvalidRequestError("the calibration Hessian is not positive definite even with damping; use more "
                              "calibration samples", param="samples")


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, spec: QuantSpec, damp: float = 0.01,
                  block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ with error compensation: (q int32 [N, K], z int32 [N, G], s float16 [N, G]) for `w` [N, K] given
    the input Hessian `h` [K, K]."""
    _check(w, spec)
    n, k = w.shape
    gs = spec.group_size
    block = max(gs, block // gs * gs)  # whole groups per block: a group's params see its updated weights
    w = w.double().clone()
    h = h.to(w.device)
    w[:, torch.diag(h) == 0] = 0
    u = inverse_hessian_factor(h, damp)
    q = torch.zeros(n, k, dtype=torch.int32, device=w.device)
    s_all = torch.zeros(n, k // gs, dtype=torch.float64, device=w.device)
    z_all = torch.zeros_like(s_all)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1, u1 = w[:, b0:b1].clone(), u[b0:b1, b0:b1]
        err1 = torch.zeros_like(w1)
        for i in range(b1 - b0):
            col = b0 + i
            if col % gs == 0:
                s, z = group_params(w1[:, i:i + gs].float(), spec)
                s_all[:, col // gs], z_all[:, col // gs] = s.double(), z.double()
            s, z = s_all[:, col // gs], z_all[:, col // gs]
            qi = torch.clamp(torch.round(w1[:, i] / s) + z, 0, MAXQ)
            q[:, col] = qi.int()
            e = (w1[:, i] - s * (qi - z)) / u1[i, i]
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err1[:, i] = e
        w[:, b1:] -= err1 @ u[b0:b1, b1:]
    return q, z_all.int(), s_all.half()


def dequantize(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [N, K] weights of (q, z, s)."""
    return (q.float() - z.float().repeat_interleave(group_size, 1)) * s.float().repeat_interleave(group_size, 1)


def output_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> float:
    """sum over the inputs x behind `h` of ||(W - Wq) x||^2 = trace(D H D^T)."""
    d = (w.double() - wq.double())
    return float(((d @ h.double()) * d).sum())


def _pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values in [0, 15] -> int32 [...] with value i at bits 4i (two's complement for the top one)."""
    word = (nibbles.long() << (torch.arange(8, device=nibbles.device) * 4)).sum(-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).int()


def pack_gptq(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group_size: int, in_features: int
              ) -> dict[str, torch.Tensor]:
    """AutoGPTQ's layout (`checkpoint_format: gptq`): qweight int32 [K/8, N] packed along the inputs, qzeros
    int32 [G, N/8] holding z - 1, scales float16 [G, N], g_idx int32 [K]. `q` [N, G * group_size] may hold
    inputs padded to whole groups; a K or N not a multiple of 8 is padded to whole words (llmrt reads that, see
    gptq_awq.py; AutoGPTQ's format has no such layers)."""
    n = q.shape[0]
    kw = -(-in_features // 8) * 8
    groups = z.shape[1]
    if q.shape[1] < kw or groups * group_size < in_features:
        raise InvalidRequestError(f"{q.shape[1]} quantized inputs in {groups} groups do not cover {in_features}")
    nw = -(-n // 8) * 8
    zp = torch.nn.functional.pad(z.t() - 1, (0, nw - n))  # pad rows: z - 1 = 0
    return {"qweight": _pack_words(q[:, :kw].t().reshape(kw // 8, 8, n).transpose(1, 2)),
            "qzeros": _pack_words(zp.reshape(groups, nw // 8, 8)),
            "scales": s.t().contiguous().half(),
            "g_idx": (torch.arange(in_features, dtype=torch.int32) // group_size).int()}
