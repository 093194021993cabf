"""Batch-invariant linear layers for `--deterministic`: every matmul sees the same number of rows.

BLAS libraries choose kernels, blockings and split-K by the shape of the call: on an AVX-512 CPU with MKL,
row 0 of a float32 `F.linear` differs in the last bits between 1, 2-15 and 16+ rows. Running every call on
fixed tiles of ROW_TILE rows (the last one zero-padded) gives each row the same GEMM shape, hence the same
reduction order, whatever else is in the step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import nn

    from llmrt.model.layers.linear import Linear

ROW_TILE = 32  # rows per matmul call in deterministic mode (a decode step of one sequence pays for 32)


def tiled_apply(layer: "Linear", x: torch.Tensor, tile: int) -> torch.Tensor:
    """layer.method.apply on `tile`-row slices of x (the last one padded with zero rows), concatenated."""
    rows = x.shape[0]
    pad = -rows % tile
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    outs = [layer.method.apply(layer, x[i:i + tile]) for i in range(0, rows + pad, tile)]
    return torch.cat(outs)[:rows]


def make_batch_invariant(model: "nn.Module", tile: int = ROW_TILE) -> int:
    """Switch every Linear of `model` to fixed-size row tiles, and its norms, rotary and activations to torch's
    ops (the fused CPU kernels are row-independent too, but torch's ops are the deterministic reference);
    how many Linears were switched."""
    from llmrt.model.layers.fused import set_fused
    from llmrt.model.layers.linear import Linear

    set_fused(model, False)
    count = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.row_tile = tile
            count += 1
    return count
