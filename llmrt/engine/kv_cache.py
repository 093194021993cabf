"""BlockManager: fixed-size KV blocks with reference counts, a prefix cache over full blocks, and LRU eviction.

A full block is named by a hash chained over its parent's hash, an extra key (anything else that changes the
KV, e.g. a model or adapter id) and its own tokens. The hash is SHA-256, so two different prefixes never share
a name in practice (no collision of SHA-256 is known). A block nobody holds keeps its KV and its name until a
fresh block is needed; then the least recently freed such block is evicted.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from typing import Optional, Protocol, Sequence as Seq


class BlockHolder(Protocol):
    """What the BlockManager needs of a sequence for allocation."""

    num_computed_tokens: int
    block_ids: list[int]


class CachingSequence(BlockHolder, Protocol):
    """What prefix caching needs besides: the tokens and the per-sequence hash bookkeeping."""

    token_ids: list[int]
    block_hashes: list[bytes]  # hashes of the full blocks of token_ids, computed lazily
    num_cached_blocks: int  # leading blocks already registered in the cache (or found there)


def hash_block(parent: Optional[bytes], tokens: Seq[int], extra_key: bytes = b"") -> bytes:
    """SHA-256 over the parent block's hash, the extra key and the block's token ids."""
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(len(extra_key).to_bytes(4, "little"))
    h.update(extra_key)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    """Hands out KV blocks to sequences; a block shared by forks is copied before it is written (COW)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 extra_key: bytes = b""):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_key = extra_key
        self.ref_counts = [0] * num_blocks
        # Free blocks without a cached name, most recently freed first: reusing those keeps a step's KV writes on
        # memory already touched (a block never written costs page faults on its first write: 2.7 of W2's 123 ms
        # to first token when every request got untouched blocks); untouched ones come after, in id order.
        self._fresh: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free named blocks, least recently freed first
        self.block_hash: list[Optional[bytes]] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash -> block holding that KV
        # Cumulative prompt tokens looked up in the prefix cache and found there (metrics).
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (named ones included: they are evicted when needed)."""
        return len(self._fresh) + len(self._evictable)

    @property
    def free_block_ids(self) -> list[int]:
        """Every block no sequence holds."""
        return list(self._fresh) + list(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq: BlockHolder, num_new_tokens: int) -> int:
        """Fresh blocks `allocate(seq, num_new_tokens)` would take."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_ids)
        return max(needed, 0) + (1 if self._needs_copy(seq) else 0)

    def can_allocate(self, seq: BlockHolder, num_new_tokens: int, reserve: int = 0) -> bool:
        """Whether the free pool covers the next `num_new_tokens` tokens of `seq` and leaves `reserve` blocks."""
        return self.num_blocks_needed(seq, num_new_tokens) + reserve <= self.num_free_blocks

    def allocate(self, seq: BlockHolder, num_new_tokens: int) -> list[tuple[int, int]]:
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

    def take_fresh(self, n: int) -> list[int]:
        """Take `n` blocks for KV that arrives from elsewhere (swap-in); the caller checked the room."""
        if n > self.num_free_blocks:
            raise RuntimeError("take_fresh() called without room")
        return [self._take() for _ in range(n)]

    def fork(self, parent: BlockHolder, child: BlockHolder) -> None:
        """Let `child` share the blocks of `parent` that hold its computed tokens."""
        # Not blocks allocated ahead (a draft model's lookahead slots): copy-on-write covers only the block a
        # span starts in, so a shared block further on would take both samples' writes.
        child.block_ids = parent.block_ids[:self.blocks_for(parent.num_computed_tokens)]
        for b in child.block_ids:
            self.ref_counts[b] += 1
        if hasattr(parent, "block_hashes") and hasattr(child, "block_hashes"):
            child.block_hashes = list(parent.block_hashes)
            child.num_cached_blocks = parent.num_cached_blocks

    def free(self, seq: BlockHolder) -> None:
        """Drop `seq`'s hold on its blocks; blocks nobody holds return to the pool (named ones stay cached)."""
        # Last block first: the tail of a prefix is then evicted before its head.
        for b in reversed(seq.block_ids):
            if self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._fresh.appendleft(b)
        seq.block_ids = []
        if hasattr(seq, "num_cached_blocks"):
            seq.num_cached_blocks = 0

    # -- prefix cache ----------------------------------------------------------------------------------
    def match_prefix(self, seq: CachingSequence) -> list[int]:
        """Cached blocks holding `seq`'s leading full blocks; never the block of its last token (it must be
        computed so that there is a row to sample from). Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        usable = (len(seq.token_ids) - 1) // self.block_size
        hashes = self._block_hashes(seq, usable)
        found: list[int] = []
        for h in hashes[:usable]:
            b = self.cached.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def num_free_taken_by(self, blocks: list[int]) -> int:
        """How many of these cached blocks are free now (taking them shrinks the free pool)."""
        return sum(1 for b in blocks if self.ref_counts[b] == 0)

    def take_prefix(self, seq: CachingSequence, blocks: list[int]) -> None:
        """Give a sequence with no blocks the cached `blocks` as its first blocks, computed already."""
        if seq.block_ids:
            raise RuntimeError("take_prefix() on a sequence that holds blocks")
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1
        seq.block_ids = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_cached_blocks = len(blocks)

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count one request's prompt lookup (for the hit-rate counters)."""
        self.prefix_cache_queried_tokens += num_queried
        self.prefix_cache_hit_tokens += num_hit

    def cache_full_blocks(self, seq: CachingSequence) -> None:
        """Name the blocks `seq` has filled and computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if full <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            b, h = seq.block_ids[i], hashes[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.block_hash[b] = h
                self.cached[h] = b
            # Otherwise the same KV is cached in another block already (computed twice concurrently): keep one.
        seq.num_cached_blocks = full

    def _block_hashes(self, seq: CachingSequence, count: int) -> list[bytes]:
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < count:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs],
                                     self.extra_key))
        return hashes

    # -- internals -------------------------------------------------------------------------------------
    def _needs_copy(self, seq: BlockHolder) -> bool:
        # Only the block the next token lands in can be written; full blocks are never written again.
        i = seq.num_computed_tokens // self.block_size
        return i < len(seq.block_ids) and self.ref_counts[seq.block_ids[i]] > 1

    def _take(self) -> int:
        if self._fresh:
            b = self._fresh.popleft()
        else:  # evict the least recently freed cached block
            b, _ = self._evictable.popitem(last=False)
            del self.cached[self.block_hash[b]]
            self.block_hash[b] = None
            self.num_evictions += 1
        self.ref_counts[b] = 1
        return b


class HostBlockPool:
    """Block ids of the host-memory swap space (the runner owns the tensors)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Host blocks not holding a swapped-out sequence."""
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """Take `n` host blocks; the caller checked the room."""
        return [self._free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        """Return host blocks to the pool."""
        self._free.extend(blocks)
