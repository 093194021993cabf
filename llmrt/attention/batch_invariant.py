"""The `batch_invariant` backend (`--deterministic`): every query row's attention has one fixed reduction order.

Torch SDPA picks its query/key split sizes from the shapes of the call, and the portable backend calls it
once per prefill span and once for all decodes, so a token's attention output depends on how many other
queries share its call, on the chunk its prompt was split into and on whether its prefix came from the cache.
Here keys and values are always read from the paged cache one block (`block_size` keys) at a time, in block
order, and combined by an online softmax in float32. Each block is multiplied with the queries as
`K_block [block_size, head_dim] x Q^T [head_dim, rows]` and `V_block^T [head_dim + 1, block_size] x P
[block_size, rows]` (the extra row of ones gives the softmax denominator from the same GEMM): the reduction
sizes (head_dim, block_size) and the row count M are fixed, and only the number of query columns varies,
which BLAS does not let change a column's result (measured: tests/test_determinism.py). A sequence's rows
are one group of columns; all one-token spans (decodes) form one batched group.
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
class _Group:
    """Sequences whose query rows are computed together: [S, N] flat row indices and their positions."""

    rows: torch.Tensor  # [S, N] indices into the step's tokens
    positions: torch.Tensor  # [S, N]
    tables: torch.Tensor  # [S, max_blocks]
    tiles: dict = field(default_factory=dict, repr=False)  # window -> [(block ids [S], valid [S, bs, N])]

    def key_tiles(self, window: Optional[int], block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per key block j in order: each sequence's block id and which (key, row) pairs are visible."""
        if window not in self.tiles:
            pos = self.positions
            first = int(((pos - window + 1).clamp(min=0) // block_size).min()) if window is not None else 0
            k_off = torch.arange(block_size, device=pos.device)
            tiles = []
            for j in range(first, int(pos.max()) // block_size + 1):
                kpos = (j * block_size + k_off)[None, :, None]
                valid = kpos <= pos[:, None, :]
                if window is not None:
                    valid &= kpos > pos[:, None, :] - window
                tiles.append((self.tables[:, j], valid))
            self.tiles[window] = tiles
        return self.tiles[window]


@dataclass
class BatchInvariantMetadata:
    """The step's row groups (all decodes together, each longer span alone); tiles shared by all layers."""

    slot_mapping: torch.Tensor
    groups: list[_Group]
    block_size: int


@register_attention_backend
class BatchInvariantAttentionBackend(AttentionBackend):
    """Exact, batch-invariant paged attention: key block by key block, online softmax (see the module doc)."""

    name = "batch_invariant"
    device_types = ("cpu", "cuda")
    priority = -1  # never picked by `auto`: `--deterministic` selects it

    def build_metadata(self, common: CommonAttentionMetadata) -> BatchInvariantMetadata:
        qsl, lens = common.query_start_loc_cpu, common.seq_lens_cpu
        dev = common.block_tables.device
        singles = [i for i in range(common.num_seqs) if qsl[i + 1] - qsl[i] == 1]
        groups = []
        if singles:
            idx = torch.tensor(singles, dtype=torch.long, device=dev)
            groups.append(_Group(torch.tensor([[qsl[i]] for i in singles], device=dev),
                                 torch.tensor([[lens[i] - 1] for i in singles], device=dev),
                                 common.block_tables[idx]))
        for i in range(common.num_seqs):
            n = qsl[i + 1] - qsl[i]
            if n > 1:
                groups.append(_Group(torch.arange(qsl[i], qsl[i + 1], device=dev)[None, :],
                                     torch.arange(lens[i] - n, lens[i], device=dev)[None, :],
                                     common.block_tables[i:i + 1]))
        return BatchInvariantMetadata(common.slot_mapping, groups, common.block_size)

    def forward(self, layer: "Attention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: BatchInvariantMetadata) -> torch.Tensor:
        k_cache, v_cache = layer.k_cache, layer.v_cache
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        k_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        for group in meta.groups:
            out[group.rows.reshape(-1)] = self._group(layer, q, group, meta.block_size)
        return out

    @staticmethod
    def _group(layer: "Attention", q: torch.Tensor, group: _Group, block_size: int) -> torch.Tensor:
        kv_heads, dim = layer.num_kv_heads, layer.head_dim
        g = layer.num_heads // kv_heads  # query heads h*g .. h*g+g-1 share KV head h (HF's GQA layout)
        S, N = group.rows.shape
        # Columns are (row, query head within the group): [S, kv_heads, dim, N * g].
        qt = q[group.rows.reshape(-1)].float().view(S, N, kv_heads, g, dim).permute(0, 2, 4, 1, 3)
        qt = qt.reshape(S, kv_heads, dim, N * g)
        acc = torch.zeros((S, kv_heads, dim + 1, N * g), device=q.device)  # the last row: softmax denominator
        m = torch.full((S, kv_heads, 1, N * g), float("-inf"), device=q.device)
        ones = torch.ones((S, kv_heads, 1, block_size), device=q.device)
        for blocks, valid in group.key_tiles(layer.sliding_window, block_size):
            kb = layer.k_cache.index_select(0, blocks).float().permute(0, 2, 1, 3)  # [S, kv_heads, bs, dim]
            vb = layer.v_cache.index_select(0, blocks).float().permute(0, 2, 3, 1)  # [S, kv_heads, dim, bs]
            s = torch.matmul(kb, qt) * layer.scale  # [S, kv_heads, bs, N * g]
            mask = valid[:, None, :, :, None].expand(S, 1, block_size, N, g).reshape(S, 1, block_size, N * g)
            s.masked_fill_(~mask, float("-inf"))
            m_new = torch.maximum(m, s.amax(2, keepdim=True))
            # A column with no visible key yet keeps m = -inf; 0 stands in so that exp() gives 0, not NaN, and a
            # block with no visible key for a column leaves that column exactly as it was.
            m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - m_safe)
            acc = acc * torch.exp(m - m_safe) + torch.matmul(torch.cat([vb, ones], dim=2), p)
            m = m_new
        o = (acc[:, :, :dim] / acc[:, :, dim:]).view(S, kv_heads, dim, N, g).permute(0, 3, 1, 4, 2)
        return o.reshape(S * N, layer.num_heads, dim).to(q.dtype)
