"""GGUF 4-bit tensors (Q4_0, Q4_1, Q4_K) kept as int4: their integers unchanged, a scale and zero per 32 values.

The GGUF reader hands such a tensor over as `Int4Rows`; any other type arrives dequantized and is quantized
here with quantize_int4 (a second rounding: Q5_K/Q6_K/Q8_0/F16 rows of a Q4_K_M file lose their extra bits).
Each projection of a fused layer (q/k/v, gate/up) fills its own rows, so a file mixing types per projection
loads as one int4 layer. Only with group size 32, the block size of those types.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.model.layers.weights import copy_checked, set_weight_loader
from llmrt.model.quantization.int4 import Int4Config, Int4LinearMethod, quantize_int4

if TYPE_CHECKING:
    from llmrt.model.layers.linear import Linear

GGUF_GROUP = 32


@dataclass
class Int4Rows:
    """Weights already in int4 form (group size 32): q uint8 [N, K], scale and zero float32 [N, K/32]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Int4Rows":
        """The same rows reordered by `fn` (e.g. llama.cpp's q/k permutation undone)."""
        return Int4Rows(fn(self.q), fn(self.scale), fn(self.zero))


class GgufInt4Method(Int4LinearMethod):
    """Collects int4 rows per projection (exact for 4-bit GGUF types, quantized here otherwise), then hands
    them to the int4 method's storage."""

    def __init__(self) -> None:
        super().__init__(GGUF_GROUP)

    def create_weights(self, layer: "Linear", in_features: int, out_features: int, bias: bool) -> None:
        k = in_features + (-in_features % GGUF_GROUP)  # padded with zero weights, as Int4LinearMethod does
        layer.weight = set_weight_loader(
            nn.Parameter(torch.zeros(out_features, k, dtype=torch.uint8), requires_grad=False), self._loader(layer))
        for name in ("gguf_scale", "gguf_zero"):
            p = nn.Parameter(torch.zeros(out_features, k // GGUF_GROUP), requires_grad=False)
            p.checkpoint_optional = True  # filled by the weight's loader, not by a tensor of its own
            setattr(layer, name, p)
        self.create_bias(layer, out_features, bias)

    @staticmethod
    def _loader(layer: "Linear"):
        def load(param: nn.Parameter, loaded: "Int4Rows | torch.Tensor", shard_id: Optional[int] = None) -> None:
            rows = slice(None) if shard_id is None else layer.shard_slice(shard_id)
            if not isinstance(loaded, Int4Rows):
                w = loaded.float()
                if w.dim() != 2 or w.shape[1] != layer.in_features:
                    raise ValueError(f"has shape {tuple(w.shape)} but the model expects {layer.in_features} inputs")
                q, scale, zero = quantize_int4(F.pad(w, (0, param.shape[1] - w.shape[1])), GGUF_GROUP)
                loaded = Int4Rows(q, scale, zero)
            copy_checked(param.data[rows], loaded.q)
            copy_checked(layer.gguf_scale.data[rows], loaded.scale)
            copy_checked(layer.gguf_zero.data[rows], loaded.zero)
        return load

    def process_weights_after_loading(self, layer: "Linear") -> None:
        q, scale, zero = layer.weight.data.to(torch.int32), layer.gguf_scale.data, layer.gguf_zero.data
        del layer.weight, layer.gguf_scale, layer.gguf_zero
        self.store_quantized(layer, q, scale, zero)


class GgufInt4Config(Int4Config):
    """--quantization int4 (group size 32) on a GGUF file: its 4-bit tensors keep their integers."""

    def __init__(self, lm_head: str = "int8") -> None:
        super().__init__(GGUF_GROUP, lm_head)

    def linear_method(self, layer: "Linear") -> GgufInt4Method:
        return GgufInt4Method()
