"""Rotary position embeddings (rotate-half layout), with linear and llama3 frequency scaling."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from llmrt.errors import UnsupportedError
from llmrt.model.layers.fused import ops_for


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Rope settings from either the transformers 5 `rope_parameters` or older `rope_theta`/`rope_scaling`."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _inv_freq(rot_dim: int, params: dict[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim))
    kind = params["rope_type"]
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedError(f"rope_scaling type {kind!r} is not supported; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to flat [tokens, heads, head_dim] q and k at the given positions."""

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]):
        super().__init__()
        self.head_dim = head_dim
        inv = _inv_freq(head_dim, params)
        # float32 throughout, as the HF reference computes it, so positions far out round the same way.
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv.float())
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.fused = True  # the fused CPU kernel where it loads (llmrt/model/layers/fused.py)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated to their positions; the fused kernel rotates them in place (same values)."""
        ops = ops_for(q, self.fused)
        if ops is not None and k.dtype == q.dtype and q.stride(-1) == 1 and k.stride(-1) == 1 \
                and positions.dtype == torch.long and positions.is_contiguous() and self.cos.dtype == torch.float32:
            ops.rotary_(q, k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(dtype)
