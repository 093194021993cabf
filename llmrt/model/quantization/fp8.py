"""Weight-only fp8 (e4m3, one scale per output channel) through torch._scaled_mm: CUDA sm_89+ only.

Untested: no such GPU was available when this was written. hardware.check_formats refuses fp8 at configuration
time on every other device, so this method is only ever built where the capability table says it runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from llmrt.model.layers.linear import UnquantizedLinearMethod
from llmrt.model.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from llmrt.model.layers.linear import Linear

_E4M3_MAX = 448.0


class Fp8LinearMethod(UnquantizedLinearMethod):
    """Loads `weight`, then keeps e4m3 weights (transposed, as _scaled_mm's second operand wants) and scales."""

    def process_weights_after_loading(self, layer: "Linear") -> None:
        w = layer.weight.data.float()
        scale = (w.abs().amax(dim=1) / _E4M3_MAX).clamp(min=1e-12)
        q = (w / scale[:, None]).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
        del layer.weight
        layer.qweight = nn.Parameter(q.t(), requires_grad=False)  # [K, N], column-major
        layer.weight_scale = nn.Parameter(scale[None, :], requires_grad=False)  # [1, N] row-wise scaling

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        # Dynamic per-token activation scales; row-wise scaling needs bf16 output.
        xf = x.float()
        x_scale = (xf.abs().amax(dim=1, keepdim=True) / _E4M3_MAX).clamp(min=1e-12)
        xq = (xf / x_scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, layer.qweight, scale_a=x_scale, scale_b=layer.weight_scale,
                             out_dtype=torch.bfloat16)
        y = y.to(x.dtype)
        return y + layer.bias.to(x.dtype) if layer.bias is not None else y


class Fp8Config(QuantizationConfig):
    """--quantization fp8."""

    name = "fp8"

    def linear_method(self, layer: "Linear") -> Fp8LinearMethod:
        return Fp8LinearMethod()

    def weight_bytes(self, out_features: int, in_features: int) -> int:
        return out_features * in_features + out_features * 4
