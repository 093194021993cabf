"""The attention layer of every model: head layout, its slice of the paged KV cache, and the backend that computes."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from llmrt.attention.base import AttentionBackend


class Attention(nn.Module):
    """Multi-head attention with GQA over a paged KV cache; q/k/v arrive flat as [tokens, heads, head_dim].

    The model runner binds the cache tensors and the step's backend; the backend does the work, so models
    never change when a backend is added.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.gqa = num_heads != num_kv_heads
        # [num_blocks, block_size, kv_heads, head_dim] each, and the backend: bound by the model runner.
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None
        self.backend: Optional[AttentionBackend] = None

    def bind(self, k_cache: Optional[torch.Tensor], v_cache: Optional[torch.Tensor],
             backend: Optional[AttentionBackend]) -> None:
        """Attach this layer's cache tensors and the backend that reads them (None: detach)."""
        self.k_cache, self.v_cache, self.backend = k_cache, v_cache, backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: Any) -> torch.Tensor:
        return self.backend.forward(self, q, k, v, meta)
