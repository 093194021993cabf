"""Linear layers: plain and fused (several HF projections stored as one matmul), computed by a LinearMethod."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.model.layers.weights import copy_checked, set_weight_loader

if TYPE_CHECKING:
    from llmrt.model.quantization.base import QuantizationConfig


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


class LinearMethod:
    """How a Linear stores its weights and multiplies by them (unquantized, int8, int4, fp8, ...)."""

    def create_weights(self, layer: "Linear", in_features: int, out_features: int, bias: bool) -> None:
        """Register the layer's parameters, each with its weight_loader."""
        raise NotImplementedError

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """y = x W^T + b with the layer's parameters."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Repack or quantize once every tensor is loaded (nothing for unquantized weights)."""


class UnquantizedLinearMethod(LinearMethod):
    """Weights in the model dtype. On CPUs that emulate bf16/fp16 matmuls, computes in the compute dtype
    through one reused upcast buffer, except for steps of at most `native_max_rows` rows (memory-bound)."""

    def create_weights(self, layer: "Linear", in_features: int, out_features: int, bias: bool) -> None:
        layer.weight = set_weight_loader(nn.Parameter(torch.empty(out_features, in_features), requires_grad=False),
                                         layer.weight_loader)
        layer.bias = None
        if bias:
            layer.bias = set_weight_loader(nn.Parameter(torch.empty(out_features), requires_grad=False),
                                           layer.weight_loader)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        w, b = layer.weight, layer.bias
        if layer.compute_dtype is not None and w.dtype != layer.compute_dtype:
            if x.shape[0] <= layer.native_max_rows:
                return F.linear(x.to(w.dtype), w, b).to(layer.compute_dtype)
            w = UPCAST.cast(w, layer.compute_dtype)
            b = b.to(layer.compute_dtype) if b is not None else None
        return F.linear(x, w, b)


class Linear(nn.Module):
    """y = x W^T + b, where W may be several HF projections stacked along the output dim."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 compute_dtype: Optional[torch.dtype] = None, quant_config: Optional["QuantizationConfig"] = None):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.compute_dtype = compute_dtype
        self.native_max_rows = 0  # see hardware.native_half_max_rows; set by the loader for the device
        self.row_tile = 0  # > 0: --deterministic, matmuls on fixed-size row tiles (model/layers/batch_invariant.py)
        self.method: LinearMethod = quant_config.linear_method(self) if quant_config else UnquantizedLinearMethod()
        self.method.create_weights(self, in_features, self.out_features, bias)

    def shard_slice(self, shard: int) -> slice:
        """Rows of the fused weight that belong to HF projection number `shard`."""
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        """Copy a checkpoint tensor into `param`: whole, or into the rows of projection `shard_id`."""
        target = param.data if shard_id is None else param.data[self.shard_slice(shard_id)]
        copy_checked(target, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_tile:
            from llmrt.model.layers.batch_invariant import tiled_apply

            return tiled_apply(self, x, self.row_tile)
        return self.method.apply(self, x)
