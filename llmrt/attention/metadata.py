"""The flat per-step arrays every attention kernel reads, built once per step by the model runner."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CommonAttentionMetadata:
    """One step's batch as flat arrays (vLLM/FlashInfer layout); backends derive their own metadata from it.

    Sequences are ordered decodes first: sequences [0, num_decodes) have exactly one new token each.
    """

    query_start_loc: torch.Tensor  # [num_seqs + 1] cumulative query lengths (int64, on the device)
    seq_lens: torch.Tensor  # [num_seqs] tokens in context after this step, new ones included
    block_tables: torch.Tensor  # [num_seqs, max_blocks] block ids, padded with block 0
    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block * block_size + offset) of each new token
    num_decodes: int
    block_size: int
    query_start_loc_cpu: list[int]  # host copies, so backends can size things without a device sync
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        """Sequences in the step."""
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        """New tokens in the step."""
        return self.query_start_loc_cpu[-1]

    @property
    def max_query_len(self) -> int:
        """The longest span of new tokens."""
        q = self.query_start_loc_cpu
        return max((q[i + 1] - q[i] for i in range(len(q) - 1)), default=0)

    @property
    def max_seq_len(self) -> int:
        """The longest context."""
        return max(self.seq_lens_cpu, default=0)


def build_common_metadata(block_tables: list[list[int]], query_lens: list[int], seq_lens: list[int],
                          positions: torch.Tensor, num_decodes: int, block_size: int,
                          device: torch.device) -> CommonAttentionMetadata:
    """Pad the block tables into one tensor and compute every new token's cache slot in one batched op.

    `positions` (on the host) holds each new token's position, sequence by sequence.
    """
    width = max((len(t) for t in block_tables), default=0)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long).view(-1, width)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens, dtype=torch.long))
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.long, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
        block_tables=tables.to(device), slot_mapping=slots.to(device), num_decodes=num_decodes,
        block_size=block_size, query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens))


def build_decode_metadata(block_tables: list[list[int]], seq_lens: list[int], block_size: int,
                          device: torch.device) -> tuple[CommonAttentionMetadata, torch.Tensor]:
    """`build_common_metadata` for a step of decodes only (one new token per sequence, at position len - 1), and
    the positions: computed from the lists directly, without the general path's batched index ops (its result)."""
    n = len(seq_lens)
    width = max((len(t) for t in block_tables), default=0)
    positions = [s - 1 for s in seq_lens]
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(block_tables, positions)]
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long, device=device)
    qsl = list(range(n + 1))
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(n + 1, dtype=torch.long, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device), block_tables=tables.view(n, width),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device), num_decodes=n, block_size=block_size,
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens))
    return common, torch.tensor(positions, dtype=torch.long, device=device)
