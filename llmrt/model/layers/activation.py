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
# torch's vectorized silu and mul beat its exp polynomial per element. Larger fp32 steps keep torch's ops.
FUSED_SILU_MAX_ROWS = 16
# bf16 steps take the fused kernel at every size (so prefill and decode compute SiLU the same way): its results
# equal torch's but where its exp's ~1 ulp crosses a bf16 rounding boundary (26 of 84M values), and in the model
# (2 threads, prefill chunks of the 124.7M model, the two paths alternating in one process, 6 rounds; AVX-512-BF16
# EPYC, 2026-12-06) 256-token prefills took 136-146 ms against 139-143 with torch's ops above 16 rows and
# 2000-token ones 1276-1363 against 1309-1424: torch's silu writes a whole intermediate tensor that the mul reads
# back (alone, cache-warm, torch's ops are faster: 251 vs 301 us at 256 x 2048). In fp32 (results ~1 ulp apart
# from torch's) 2000-token prefills gained nothing (2074-2181 vs 2039-2167 ms), so fp32 keeps the limit.
FUSED_SILU_ALL_ROWS_DTYPES = (torch.bfloat16,)


class GatedActivation(nn.Module):
    """act(gate) * up of a gated MLP's fused [.., 2*I] gate_up; SiLU's in one fused CPU pass where it loads, for
    decode-sized steps (up to FUSED_SILU_MAX_ROWS rows) and for bf16 steps of any size."""

    def __init__(self, name: str):
        super().__init__()
        self.act = get_activation(name)
        self.fused = True  # the fused CPU kernel where it loads (llmrt/model/layers/fused.py)

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        takes_fused = gate_up.dim() == 2 and (gate_up.shape[0] <= FUSED_SILU_MAX_ROWS or
                                              gate_up.dtype in FUSED_SILU_ALL_ROWS_DTYPES)
        ops = ops_for(gate_up, self.fused) if self.act is F.silu and takes_fused else None
        if ops is not None and gate_up.stride(-1) == 1:
            return ops.silu_mul(gate_up)
        return gated(self.act, gate_up)
