"""Token (and learned position) embeddings; the token table may be split by vocabulary over tensor-parallel ranks."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from llmrt.distributed.parallel_state import communicator, tp_shard
from llmrt.model.layers.linear import OutputShard
from llmrt.model.layers.weights import (CheckpointTensor, as_checkpoint_tensor, copy_checked, reads_slices,
                                        set_weight_loader)


def vocab_shard(num_embeddings: int) -> OutputShard:
    """This rank's rows of a vocabulary split into equal blocks of ceil(V / ranks) (the last one zero-padded)."""
    tp = tp_shard()
    per = -(-num_embeddings // tp.size)
    start = min(tp.rank * per, num_embeddings)
    return OutputShard(start, min(num_embeddings, start + per) - start, per)


class Embedding(nn.Module):
    """A lookup table; its weight may double as the tied LM head.

    With `vocab_parallel` and several ranks, each rank holds `vocab_shard` rows: ids outside them look up
    zeros, and one all-reduce sums the ranks' rows into the full embedding.
    """

    def __init__(self, num_embeddings: int, dim: int, compute_dtype: torch.dtype, vocab_parallel: bool = False):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.sharded = vocab_parallel and tp_shard().size > 1
        self.shard = vocab_shard(num_embeddings) if self.sharded else OutputShard(0, num_embeddings, num_embeddings)
        self.weight = set_weight_loader(nn.Parameter(torch.empty(self.shard.size, dim), requires_grad=False),
                                        self.weight_loader)
        self.compute_dtype = compute_dtype
        self.comm = communicator() if self.sharded else None

    @reads_slices
    def weight_loader(self, param: nn.Parameter, loaded: "torch.Tensor | CheckpointTensor",
                      shard_id: Optional[int] = None) -> None:
        """Copy this rank's rows of the checkpoint's table (zeros in the padding rows)."""
        loaded = as_checkpoint_tensor(loaded)
        if shard_id is not None or loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"has shape {tuple(loaded.shape)} but the model expects {self.num_embeddings} rows")
        s = self.shard
        copy_checked(param.data[:s.length], loaded.narrow(0, s.start, s.length))
        param.data[s.length:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return F.embedding(ids, self.weight).to(self.compute_dtype)
        s = self.shard
        inside = (ids >= s.start) & (ids < s.start + s.length)
        x = F.embedding(torch.where(inside, ids - s.start, 0), self.weight).to(self.compute_dtype)
        x.masked_fill_(~inside.unsqueeze(-1), 0)
        return self.comm.all_reduce(x) if self.comm is not None else x
