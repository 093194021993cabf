"""Weight fp8 (e4m3, one scale per output channel) through torch._scaled_mm: CUDA sm_89+ only.

Activations are quantized to e4m3 per token on the fly (dynamic scales), so a matmul runs on the fp8 tensor
cores. hardware.check_formats refuses fp8 at configuration time on every other device, so this method is only
ever built where the capability table says it runs.

Two ways to apply the scales, chosen at load by the device (`scaling_mode`):
- "rowwise" (sm_90, Hopper): _scaled_mm takes the per-token and per-channel scales itself and writes bf16;
- "tensorwise" (other sm_89+ parts, where torch's row-wise kernel is not built): _scaled_mm runs unscaled into
  float32 and the two scale vectors multiply the result, one fused elementwise op more.
_scaled_mm wants K and N multiples of 16: odd layers (stories260K's 172-wide MLP) are zero-padded at load, and
their inputs per call.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.model.layers.linear import UnquantizedLinearMethod
from llmrt.model.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from llmrt.model.layers.linear import Linear

E4M3_MAX = 448.0
_ALIGN = 16  # _scaled_mm: both dimensions of the second operand divisible by 16
SCALING_MODES = ("rowwise", "tensorwise")


def scaling_mode(device: torch.device) -> str:
    """How _scaled_mm applies scales on `device`: torch builds its row-wise fp8 kernel for sm_90 only."""
    return "rowwise" if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0) \
        else "tensorwise"


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], float32 scales [N]) with w ~= q * scale[:, None] (scale = max|row| / 448)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class Fp8LinearMethod(UnquantizedLinearMethod):
    """Loads `weight` in the model dtype, then keeps e4m3 weights (transposed: _scaled_mm's second operand is
    column-major) and per-channel float32 scales."""

    def __init__(self, mode: Optional[str] = None):
        if mode is not None and mode not in SCALING_MODES:
            raise ValueError(f"fp8 scaling mode {mode!r}: expected one of {SCALING_MODES}")
        self.mode = mode  # None: scaling_mode(device) at load
        self.one: Optional[torch.Tensor] = None  # tensor-wise mode's unit scale, made at load

    def process_weights_after_loading(self, layer: "Linear") -> None:
        w = layer.weight.data
        self.mode = self.mode or scaling_mode(w.device)
        n, k = w.shape
        np_, kp = _round_up(n), _round_up(k)
        if (np_, kp) != (n, k):
            w = F.pad(w, (0, kp - k, 0, np_ - n))
        q, scale = quantize_fp8(w)
        del layer.weight
        layer.qweight = nn.Parameter(q.t(), requires_grad=False)  # [Kp, Np], column-major
        layer.weight_scale = nn.Parameter(scale[None, :], requires_grad=False)  # [1, Np]
        # tensor-wise _scaled_mm takes its (unit) scales as tensors: one, made here rather than per call
        self.one = torch.ones((), dtype=torch.float32, device=w.device) if self.mode == "tensorwise" else None

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        padded_in = layer.qweight.shape[0]
        if padded_in != shape[-1]:
            x2 = F.pad(x2, (0, padded_in - shape[-1]))
        xq, x_scale = _quantize_rows(x2)
        if self.mode == "rowwise":  # scales applied in the kernel's epilogue; this mode writes bf16
            y = torch._scaled_mm(xq, layer.qweight, scale_a=x_scale, scale_b=layer.weight_scale,
                                 out_dtype=torch.bfloat16)
        else:
            y = torch._scaled_mm(xq, layer.qweight, scale_a=self.one, scale_b=self.one, out_dtype=torch.float32)
            y = y * x_scale * layer.weight_scale
        n = layer.out_features
        y = (y[:, :n] if y.shape[1] != n else y).to(x.dtype)
        if layer.bias is not None:
            y = y + layer.bias.to(x.dtype)
        return y.reshape(*shape[:-1], n)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [M, K], float32 [M, 1] scales): each token scaled to the e4m3 range on its own.

    Five kernels where the obvious version takes eight (the H200 runs this layer's small steps at the rate the
    host launches kernels): max|x| in one reduction, the scale in place, and no clamp of x / scale, which
    cannot pass 448 by more than a rounding step (e4m3 conversion makes NaN only from 464 on)."""
    scale = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True, dtype=torch.float32)
    scale.div_(E4M3_MAX).clamp_(min=1e-12)
    return (x / scale).to(torch.float8_e4m3fn), scale


class Fp8Config(QuantizationConfig):
    """--quantization fp8. The LM head stays in the model dtype (its logits feed sampling directly)."""

    name = "fp8"

    def __init__(self, mode: Optional[str] = None):
        self.mode = mode

    def linear_method(self, layer: "Linear") -> Fp8LinearMethod:
        return Fp8LinearMethod(self.mode)

    def weight_bytes(self, out_features: int, in_features: int) -> int:
        np_ = _round_up(out_features)
        return np_ * _round_up(in_features) + np_ * 4
