"""Activations, including the fused gate*up of gated MLPs."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.errors import UnsupportedError
from llmrt.model.layers.fused import ops_for


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's 'gelu_new' (tanh approximation)."""
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh,
    "gelu_fast": gelu_tanh, "relu": F.relu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Look up an activation by its HF name."""
    if name not in ACTIVATIONS:
        raise UnsupportedError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def gated(act: Callable[[torch.Tensor], torch.Tensor], gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for a fused [.., 2*I] gate_up tensor."""
    d = gate_up.shape[-1] // 2
    return act(gate_up[..., :d]) * gate_up[..., d:]


# The fused SiLU-and-mul wins only where a call is overhead-bound: measured 1 thread (benchmarks/fused-ops-micro.json,
# 124.7M shapes, load ~8), 1 row 4.6 vs 7.6 us (fp32), but 64 rows 241 vs 208 us (fp32) and 645 vs 361 us (bf16):
# torch's vectorized silu and mul beat its exp polynomial per element. Larger steps keep torch's ops.
FUSED_SILU_MAX_ROWS = 16


class GatedActivation(nn.Module):
    """act(gate) * up of a gated MLP's fused [.., 2*I] gate_up; SiLU's in one fused CPU pass for decode-sized steps
    (up to FUSED_SILU_MAX_ROWS rows) where it loads."""

    def __init__(self, name: str):
        super().__init__()
        self.act = get_activation(name)
        self.fused = True  # the fused CPU kernel where it loads (llmrt/model/layers/fused.py)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        small = gate_up.dim() == 2 and gate_up.shape[0] <= FUSED_SILU_MAX_ROWS
        ops = ops_for(gate_up, self.fused) if self.act is F.silu and small else None
        if ops is not None and gate_up.stride(-1) == 1:
            return ops.silu_mul(gate_up)
        return gated(self.act, gate_up)
