"""Linear layers: plain and fused (several HF projections stored as one matmul)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class _UpcastWorkspace:
    """One reusable buffer for weights whose storage dtype is narrower than the compute dtype.

    Layers run one after another, so one buffer serves them all; reusing it avoids page-faulting a fresh
    allocation of every weight on every step.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def cast(self, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`w` converted to `dtype`, in the shared buffer (valid until the next call)."""
        key = (w.device, dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < w.numel():
            buf = torch.empty(w.numel(), dtype=dtype, device=w.device)
            self._bufs[key] = buf
        out = buf[: w.numel()].view(w.shape)
        out.copy_(w)
        return out


UPCAST = _UpcastWorkspace()


class Linear(nn.Module):
    """y = x W^T + b, where W may be several HF projections stacked along the output dim."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 compute_dtype: Optional[torch.dtype] = None, native_max_rows: int = 0):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self.compute_dtype = compute_dtype
        self.native_max_rows = native_max_rows  # see hardware.native_half_max_rows

    def shard_slice(self, shard: int) -> slice:
        """Rows of the fused weight that belong to HF projection number `shard`."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight, self.bias
        if self.compute_dtype is not None and w.dtype != self.compute_dtype:
            if x.shape[0] <= self.native_max_rows:
                return F.linear(x.to(w.dtype), w, b).to(self.compute_dtype)
            w = UPCAST.cast(w, self.compute_dtype)
            b = b.to(self.compute_dtype) if b is not None else None
        return F.linear(x, w, b)
