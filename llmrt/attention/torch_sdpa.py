"""The portable `torch` backend: torch SDPA over K/V gathered from the paged cache (CPU and CUDA alike)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from llmrt.attention.base import AttentionBackend, register_attention_backend
from llmrt.attention.kv_quant import dequantize_kv, is_quantized, quantize_kv
from llmrt.attention.metadata import CommonAttentionMetadata

if TYPE_CHECKING:
    from llmrt.model.layers.attention import Attention


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
class TorchAttentionMetadata:
    """Decodes as one padded batch, prefills as spans; masks built on first use and shared by all layers."""

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: Optional[torch.Tensor]  # [num_decodes, max decode blocks], contiguous
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


@register_attention_backend
class TorchAttentionBackend(AttentionBackend):
    """The reference backend: gathers each step's context blocks, then runs torch SDPA.

    Decodes run as one batched SDPA; prefill spans run one SDPA each, because torch has no variable-length
    SDPA on CPU and padding every span to the longest would cost quadratic work in the padding.
    """

    name = "torch"
    device_types = ("cpu", "cuda")
    priority = 0

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        bs, d = common.block_size, common.num_decodes
        tables = lens = None
        if d:
            width = -(-max(common.seq_lens_cpu[:d]) // bs)
            tables = common.block_tables[:d, :width].contiguous()
            lens = common.seq_lens[:d]
        spans = []
        qsl = common.query_start_loc_cpu
        for i in range(d, common.num_seqs):
            ctx = common.seq_lens_cpu[i]
            spans.append(PrefillSpan(qsl[i], qsl[i + 1] - qsl[i], ctx, common.block_tables[i, :-(-ctx // bs)]))
        return TorchAttentionMetadata(common.slot_mapping, d, tables, lens, spans)

    def forward(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchAttentionMetadata) -> torch.Tensor:
        k, v = self._write(layer, k, v, meta, q.dtype)
        return self._attend(layer, q, k, v, meta)

    def _write(self, layer: "Attention", k: torch.Tensor, v: torch.Tensor, meta: TorchAttentionMetadata,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's new K/V at their slots; returns the K/V (as `dtype`) fresh prefill spans attend to."""
        k_cache, v_cache = layer.k_cache, layer.v_cache
        heads, stored = layer.num_kv_heads, k_cache.shape[-1]
        if is_quantized(k_cache):
            kq, vq = quantize_kv(k, k_cache.dtype), quantize_kv(v, v_cache.dtype)
            k_cache.view(-1, heads, stored).index_copy_(0, meta.slot_mapping, kq)
            v_cache.view(-1, heads, stored).index_copy_(0, meta.slot_mapping, vq)
            if meta.prefills:
                # Fresh spans attend to the same rounded K/V a later read of the cache returns, so a prompt
                # computes the same whether it is prefilled whole, in chunks, or found in the prefix cache.
                k, v = dequantize_kv(kq, dtype), dequantize_kv(vq, dtype)
        else:
            k_cache.view(-1, heads, stored).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
            v_cache.view(-1, heads, stored).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        return k, v

    def _attend(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: TorchAttentionMetadata) -> torch.Tensor:
        """Attention outputs of the step, the new K/V already in the cache."""
        k_cache, v_cache = layer.k_cache, layer.v_cache
        heads, stored = layer.num_kv_heads, k_cache.shape[-1]
        block_size = k_cache.shape[1]
        d = meta.num_decodes
        if d and not meta.prefills:  # a decode-only step: the kernel's output is the whole result, no copy
            return self._decode(layer, q, meta, block_size)
        out = torch.empty_like(q)
        if d:
            out[:d] = self._decode(layer, q[:d], meta, block_size)
        for i, span in enumerate(meta.prefills):
            rows = slice(span.start, span.start + span.length)
            if span.has_prior_context:
                idx = span.block_table
                ks = _read(k_cache.index_select(0, idx).view(-1, heads, stored)[: span.context_len], q.dtype)
                vs = _read(v_cache.index_select(0, idx).view(-1, heads, stored)[: span.context_len], q.dtype)
            else:
                ks, vs = k[rows], v[rows]
            mask = meta.prefill_mask(i, layer.sliding_window)
            out[rows] = self._prefill(layer, q[rows], ks.to(q.dtype), vs.to(q.dtype), mask)
        return out

    @staticmethod
    def _prefill(layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: Optional[torch.Tensor]) -> torch.Tensor:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, tokens, head_dim]
        o = _sdpa(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, is_causal=mask is None,
                  scale=layer.scale, enable_gqa=layer.gqa)
        return o[0].transpose(0, 1)

    @staticmethod
    def _decode(layer: "Attention", q: torch.Tensor, meta: TorchAttentionMetadata, block_size: int) -> torch.Tensor:
        tables = meta.decode_block_tables
        n, span = tables.shape[0], tables.shape[1] * block_size
        flat = tables.view(-1)
        heads, stored = layer.num_kv_heads, layer.k_cache.shape[-1]
        # index_select copies whole blocks; advanced indexing (cache[tables]) is several times slower on CPU.
        k = _read(layer.k_cache.index_select(0, flat).view(n, span, heads, stored), q.dtype).transpose(1, 2)
        v = _read(layer.v_cache.index_select(0, flat).view(n, span, heads, stored), q.dtype).transpose(1, 2)
        mask = meta.decode_mask(block_size, layer.sliding_window)
        o = _sdpa(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=layer.scale,
                  enable_gqa=layer.gqa)
        return o.squeeze(2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """torch SDPA; on CUDA without cuDNN's backend, which builds an execution plan for every new shape: prefill
    spans of many lengths cost 6 ms of host time per call on the H200, 89% of a W1-like run's wall time, and
    cached decode shapes 0.14 ms (benchmarks/cuda-profile-NVIDIA-H200.txt); flash and memory-efficient attention
    take any length with no plan. The flag is switched around the call (0.26 us; torch's sdpa_kernel context
    takes 12.5 us, 24 times a step) and restored, so other code in the process keeps its choice."""
    if q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled():
        torch.backends.cuda.enable_cudnn_sdp(False)
        try:
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _read(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache rows as `dtype` K/V (dequantized when the cache is int8 or fp8)."""
    return dequantize_kv(rows, dtype) if is_quantized(rows) else rows
