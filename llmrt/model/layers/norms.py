"""Normalization layers."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.model.layers.fused import ops_for


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like the HF reference."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.fused = True  # the fused CPU kernel where it loads (llmrt/model/layers/fused.py)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Normalize x (after adding residual, when given, and then also return the sum).

        With a residual, x and residual may be overwritten (the fused kernel updates both in place)."""
        ops = ops_for(x, self.fused)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1 and self.weight.dtype == x.dtype:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            if residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1:
                ops.add_rms_norm_(x, residual, self.weight, self.eps)
                return x, residual
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight.to(torch.float32) * y if dtype == torch.float32 else self.weight * y.to(dtype)
        y = y.to(dtype)
        return y if residual is None else (y, residual)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (GPT-2)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)
