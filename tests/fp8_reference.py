"""A CPU emulation of torch._scaled_mm for e4m3 inputs: the oracle the fp8 method is checked against on CUDA,
and the way its accuracy is measured on machines without fp8 matmuls."""
from __future__ import annotations

import torch


def emulated_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       out_dtype: torch.dtype = torch.float32, **_: object) -> torch.Tensor:
    """(a @ b) * scale_a * scale_b in float32, then `out_dtype`: e4m3 values times e4m3 values are exact in
    float32, so this differs from the tensor cores only in summation order (and the output's rounding)."""
    return ((a.float() @ b.float()) * scale_a.float() * scale_b.float()).to(out_dtype)
