"""BlockManager: fixed-size KV blocks with reference counts, shared between forked samples."""
from __future__ import annotations

from collections import deque

from llmrt.engine.request import Sequence


class BlockManager:
    """Hands out KV blocks to sequences; a block shared by forks is copied before it is written (COW)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        # Cumulative prompt tokens looked up in the prefix cache and found there (metrics).
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks `allocate(seq, num_new_tokens)` would take."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids)
        return max(needed, 0) + (1 if self._needs_copy(seq) else 0)

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the free pool covers the next `num_new_tokens` tokens of `seq`."""
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Give `seq` blocks for its next tokens; return (src, dst) block copies the runner must do first."""
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError("allocate() called without room; check can_allocate() first")
        copies: list[tuple[int, int]] = []
        if self._needs_copy(seq):
            i = seq.num_computed_tokens // self.block_size
            src, dst = seq.block_ids[i], self._take()
            self.ref_counts[src] -= 1
            seq.block_ids[i] = dst
            copies.append((src, dst))
        while len(seq.block_ids) < self.blocks_for(seq.num_computed_tokens + num_new_tokens):
            seq.block_ids.append(self._take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent`."""
        child.block_ids = list(parent.block_ids)
        for b in child.block_ids:
            self.ref_counts[b] += 1

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks; blocks nobody holds return to the pool."""
        for b in reversed(seq.block_ids):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_block_ids.append(b)
        seq.block_ids = []

    def _needs_copy(self, seq: Sequence) -> bool:
        # Only the block the next token lands in can be written; full blocks are never written again.
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_ids) and self.ref_counts[seq.block_ids[i]] > 1

    def _take(self) -> int:
        b = self.free_block_ids.popleft()
        self.ref_counts[b] = 1
        return b
