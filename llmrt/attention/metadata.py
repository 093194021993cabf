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
    """Pad the block tables into one tensor and compute every new token's cache slot (one batched op). A step
    with one new token per sequence computes the slots from the lists and makes every array one view of a single
    tensor: one conversion and one device copy a decode step instead of four.

    `positions` (on the host) holds each new token's position, sequence by sequence.
    """
    n = len(query_lens)
    width = max((len(t) for t in block_tables), default=0)
    padded = [b for t in block_tables for b in (t + [0] * (width - len(t)) if len(t) < width else t)]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    if qsl[-1] == n:  # one new token per sequence (decodes): every array from the lists in one tensor and copy
        slots = [t[(s - 1) // block_size] * block_size + (s - 1) % block_size for t, s in zip(block_tables, seq_lens)]
        flat = torch.tensor([*qsl, *seq_lens, *slots, *padded], dtype=torch.long).to(device)
        return CommonAttentionMetadata(
            query_start_loc=flat[:n + 1], seq_lens=flat[n + 1:2 * n + 1], block_tables=flat[3 * n + 1:].view(n, width),
            slot_mapping=flat[2 * n + 1:3 * n + 1], num_decodes=num_decodes, block_size=block_size,
            query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens))
    tables = torch.tensor(padded, dtype=torch.long).view(n, width)
    seq_of_token = torch.repeat_interleave(torch.arange(n), torch.tensor(query_lens, dtype=torch.long))
    slot_mapping = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.long, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
        block_tables=tables.to(device), slot_mapping=slot_mapping.to(device), num_decodes=num_decodes,
        block_size=block_size, query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens))
