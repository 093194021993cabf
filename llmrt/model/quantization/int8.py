"""Weight-only int8: symmetric, one scale per output channel, quantized at load from the checkpoint's weights."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.model.layers.linear import UPCAST, UnquantizedLinearMethod, pack_for_kernels, unpacked, use_kernel
from llmrt.model.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from llmrt.model.layers.linear import Linear

# Without llmrt's kernels (llmrt/kernels), steps of up to this many rows use torch's packed int8 kernel (bf16
# activations); larger ones dequantize to the compute dtype and run its GEMM. Measured on this repo's CPU
# (docs/quantization.md): the packed kernel is 1.4-1.9x faster than fp32 for one row and 1.4-2x slower at 64 rows.
PACKED_MAX_ROWS = 8


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scales [N]) with w ~= q * scale[:, None], rounding to nearest."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8LinearMethod(UnquantizedLinearMethod):
    """Loads `weight` in the model dtype, then keeps only int8 weights and per-channel scales. Small steps run
    llmrt's kernel where it is available (else torch's packed one); larger ones dequantize and run the GEMM."""

    def __init__(self, packed_max_rows: int):
        self.packed_max_rows = packed_max_rows

    def process_weights_after_loading(self, layer: "Linear") -> None:
        from llmrt.kernels import for_layer

        q, scale = quantize_int8(layer.weight.data)
        del layer.weight  # a tied LM head's embedding keeps its own reference
        layer.kernels, layer.kernel_max_rows = for_layer("int8", q)
        if layer.kernels is not None:  # llmrt's kernel: int8 rows widened in registers, fp32 accumulation
            pack_for_kernels(layer, q, scale)
            return
        layer.qweight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        # torch's packed kernel wants scales in its activation dtype (bf16)
        layer.weight_scale_bf16 = nn.Parameter(scale.bfloat16(), requires_grad=False)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        out_dtype = x.dtype
        b = layer.bias
        if layer.packed is not None:
            if use_kernel(layer, x):
                return layer.packed(x)
            w = unpacked(layer, x)
            return F.linear(x.to(w.dtype), w, b.to(w.dtype) if b is not None else None).to(out_dtype)
        # torch 2.13's kernel crashes on multi-row inputs whose K is not a multiple of 32 (seen with K=172).
        if (layer.kernels is None and x.device.type == "cpu" and x.shape[0] <= self.packed_max_rows
                and layer.in_features % 32 == 0):
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), layer.qweight, layer.weight_scale_bf16)
            y = y.to(out_dtype)
            return y + b.to(out_dtype) if b is not None else y
        w = UPCAST.cast(layer.qweight, out_dtype)
        w.mul_(layer.weight_scale.to(out_dtype)[:, None])
        return F.linear(x, w, b.to(out_dtype) if b is not None else None)


class Int8Config(QuantizationConfig):
    """--quantization int8."""

    name = "int8"

    def __init__(self, packed_max_rows: int = PACKED_MAX_ROWS, lm_head: str = "int8"):
        self.packed_max_rows = packed_max_rows
        self.lm_head = lm_head  # "int8" | "none" (resolved by quantization.resolve_lm_head)

    def linear_method(self, layer: "Linear") -> Int8LinearMethod:
        return Int8LinearMethod(self.packed_max_rows)

    def lm_head_config(self) -> "QuantizationConfig | None":
        return Int8Config(self.packed_max_rows, "none") if self.lm_head == "int8" else None

    def weight_bytes(self, out_features: int, in_features: int) -> int:
        from llmrt.kernels import kernels
        from llmrt.kernels.packed import packed_bytes

        if kernels() is not None:  # llmrt's layout: rows padded to 4s, inputs to 32s, fp32 scales
            return packed_bytes("int8", out_features, in_features)
        # int8 values and fp32 scales, plus bf16 copies of the scales for torch's packed kernel.
        return out_features * in_features + out_features * (4 + 2)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "Int8Config":
        return cls(int(options.get("packed_max_rows", PACKED_MAX_ROWS)), options.get("lm_head", "int8"))
