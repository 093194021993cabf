"""The `batch_invariant` backend (`--deterministic`): every query row's attention has one fixed reduction order.

Torch SDPA picks its query/key split sizes from the shapes of the call, and the portable backend calls it
once per prefill span and once for all decodes, so a token's attention output depends on how many other
queries share its call, on the chunk its prompt was split into and on whether its prefix came from the cache.
Here every query row is computed the same way whatever the step holds: its keys are read from the paged
cache one block (`block_size` keys) at a time, in block order, and combined by an online softmax in float32;
each block is one batched matmul of shape [G, head_dim] x [head_dim, block_size] per (row, KV head), where G
is the number of query heads per KV head. Rows are independent batch entries of those matmuls, so the batch
around a row changes nothing in its arithmetic. Slower than SDPA (keys are gathered per row), exact instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from llmrt.attention.base import AttentionBackend, register_attention_backend
from llmrt.attention.metadata import CommonAttentionMetadata

if TYPE_CHECKING:
    from llmrt.model.layers.attention import Attention


@dataclass
class _Tile:
    """The rows that read key block number j of their sequence: their indices, block ids and valid keys."""

    rows: torch.Tensor  # [a] indices into the step's tokens
    blocks: torch.Tensor  # [a] cache block id each row reads
    valid: torch.Tensor  # [a, block_size] bool: key position visible to the row


@dataclass
class BatchInvariantMetadata:
    """Each new token's sequence, position and block table; tiles built on first use, shared by all layers."""

    slot_mapping: torch.Tensor
    positions: torch.Tensor  # [tokens] position of each new token
    tables: torch.Tensor  # [tokens, max_blocks] the block table of each token's sequence
    block_size: int
    _tiles: dict = field(default_factory=dict, repr=False)

    def tiles(self, window: Optional[int]) -> list[_Tile]:
        """Per key block j (in order), the rows that see at least one key of it."""
        if window not in self._tiles:
            bs, pos = self.block_size, self.positions
            k_off = torch.arange(bs, device=pos.device)
            first = (pos - window + 1).clamp(min=0) // bs if window is not None else torch.zeros_like(pos)
            last = pos // bs
            tiles = []
            for j in range(int(first.min()) if pos.numel() else 0, int(last.max()) + 1 if pos.numel() else 0):
                rows = ((first <= j) & (last >= j)).nonzero().squeeze(1)
                kpos = j * bs + k_off
                valid = kpos[None, :] <= pos[rows, None]
                if window is not None:
                    valid &= kpos[None, :] > pos[rows, None] - window
                tiles.append(_Tile(rows, self.tables[rows, j], valid))
            self._tiles[window] = tiles
        return self._tiles[window]


@register_attention_backend
class BatchInvariantAttentionBackend(AttentionBackend):
    """Exact, batch-invariant paged attention: per row, key block by key block, online softmax (see module doc)."""

    name = "batch_invariant"
    device_types = ("cpu", "cuda")
    priority = -1  # never picked by `auto`: `--deterministic` selects it

    def build_metadata(self, common: CommonAttentionMetadata) -> BatchInvariantMetadata:
        qsl, lens = common.query_start_loc_cpu, common.seq_lens_cpu
        seq_of_token, positions = [], []
        for i in range(common.num_seqs):
            n = qsl[i + 1] - qsl[i]
            seq_of_token += [i] * n
            positions += range(lens[i] - n, lens[i])
        dev = common.block_tables.device
        seq = torch.tensor(seq_of_token, dtype=torch.long, device=dev)
        return BatchInvariantMetadata(common.slot_mapping, torch.tensor(positions, dtype=torch.long, device=dev),
                                      common.block_tables[seq], common.block_size)

    def forward(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: BatchInvariantMetadata) -> torch.Tensor:
        k_cache, v_cache = layer.k_cache, layer.v_cache
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        k_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        n, group = q.shape[0], layer.num_heads // kv_heads
        # Keys always come from the cache (in its dtype), also for a fresh prompt: a prefix-cache hit reads them
        # the same way. Query heads h*G..h*G+G-1 share KV head h (HF's GQA layout).
        qf = q.float().view(n, kv_heads, group, dim)
        m = torch.full((n, kv_heads, group), float("-inf"), device=q.device)
        l = torch.zeros((n, kv_heads, group), device=q.device)
        acc = torch.zeros((n, kv_heads, group, dim), device=q.device)
        for tile in meta.tiles(layer.sliding_window):
            r = tile.rows
            kt = k_cache.index_select(0, tile.blocks).float().permute(0, 2, 3, 1)  # [a, kv_heads, dim, bs]
            vt = v_cache.index_select(0, tile.blocks).float().permute(0, 2, 1, 3)  # [a, kv_heads, bs, dim]
            s = torch.matmul(qf[r], kt) * layer.scale  # [a, kv_heads, G, bs]
            s.masked_fill_(~tile.valid[:, None, None, :], float("-inf"))
            m_old = m[r]
            m_new = torch.maximum(m_old, s.amax(-1))
            alpha = torch.exp(m_old - m_new)
            p = torch.exp(s - m_new[..., None])
            l[r] = l[r] * alpha + p.sum(-1)
            acc[r] = acc[r] * alpha[..., None] + torch.matmul(p, vt)
            m[r] = m_new
        return (acc / l[..., None]).view(n, layer.num_heads, dim).to(q.dtype)
