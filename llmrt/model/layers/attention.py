"""Paged attention, portable torch backend: K/V live in fixed-size blocks read through block tables."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillSpan:
    """One sequence's run of new tokens in the flat batch (a whole prompt, a prompt chunk or a recompute)."""

    start: int  # first token of the span in the flat batch
    length: int  # number of new tokens
    context_len: int  # tokens visible to the span's last query, new ones included
    block_table: torch.Tensor  # [num_blocks] block ids holding positions [0, context_len)

    @property
    def has_prior_context(self) -> bool:
        """True when earlier tokens of the sequence are already in the cache (chunked prefill, recompute)."""
        return self.context_len > self.length


@dataclass
class AttentionMetadata:
    """Everything attention needs about one flat batch; built once per step, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block * block_size + offset) of each new token
    num_decodes: int  # tokens [0, num_decodes) are single-token decodes, one per sequence
    decode_block_tables: Optional[torch.Tensor]  # [num_decodes, max_blocks], padded with block 0
    decode_context_lens: Optional[torch.Tensor]  # [num_decodes]
    prefills: list[PrefillSpan]
    _masks: dict = field(default_factory=dict, repr=False)

    def decode_mask(self, block_size: int, window: Optional[int]) -> torch.Tensor:
        """[num_decodes, 1, 1, L] bool: which padded key positions each decode may attend to."""
        key = ("decode", window)
        if key not in self._masks:
            lens = self.decode_context_lens
            pos = torch.arange(self.decode_block_tables.shape[1] * block_size, device=lens.device)
            mask = pos[None, :] < lens[:, None]
            if window is not None:
                mask &= pos[None, :] > (lens[:, None] - 1 - window)
            self._masks[key] = mask[:, None, None, :]
        return self._masks[key]

    def prefill_mask(self, index: int, window: Optional[int]) -> Optional[torch.Tensor]:
        """[length, context_len] bool causal mask aligned to the span's end; None when is_causal suffices."""
        span = self.prefills[index]
        if not span.has_prior_context and window is None:
            return None
        key = ("prefill", index, window)
        if key not in self._masks:
            device = span.block_table.device
            q_pos = torch.arange(span.context_len - span.length, span.context_len, device=device)
            k_pos = torch.arange(span.context_len, device=device)
            mask = k_pos[None, :] <= q_pos[:, None]
            if window is not None:
                mask &= k_pos[None, :] > (q_pos[:, None] - window)
            self._masks[key] = mask
        return self._masks[key]


class Attention(nn.Module):
    """Multi-head attention with GQA over a paged KV cache; q/k/v arrive flat as [tokens, heads, head_dim]."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: Optional[int] = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.gqa = num_heads != num_kv_heads
        # Bound by the model runner once the cache is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache: Optional[torch.Tensor] = None
        self.v_cache: Optional[torch.Tensor] = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = self.k_cache, self.v_cache
        block_size = k_cache.shape[1]
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))

        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            out[:d] = self._decode(q[:d], meta, block_size)
        for i, span in enumerate(meta.prefills):
            rows = slice(span.start, span.start + span.length)
            if span.has_prior_context:
                idx = span.block_table
                ks = k_cache.index_select(0, idx).view(-1, self.num_kv_heads, self.head_dim)[: span.context_len]
                vs = v_cache.index_select(0, idx).view(-1, self.num_kv_heads, self.head_dim)[: span.context_len]
            else:
                ks, vs = k[rows], v[rows]
            out[rows] = self._prefill(q[rows], ks.to(q.dtype), vs.to(q.dtype), meta.prefill_mask(i, self.sliding_window))
        return out

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, tokens, head_dim]
        o = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                           is_causal=mask is None, scale=self.scale, enable_gqa=self.gqa)
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, block_size: int) -> torch.Tensor:
        tables = meta.decode_block_tables
        n, span = tables.shape[0], tables.shape[1] * block_size
        flat = tables.view(-1)
        # index_select copies whole blocks; advanced indexing (cache[tables]) is several times slower on CPU.
        k = self.k_cache.index_select(0, flat).view(n, span, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_cache.index_select(0, flat).view(n, span, self.num_kv_heads, self.head_dim).transpose(1, 2)
        mask = meta.decode_mask(block_size, self.sliding_window)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           scale=self.scale, enable_gqa=self.gqa)
        return o.squeeze(2)
