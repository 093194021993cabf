"""BlockManager properties: random allocate/fork/free never leak, double-free or share a block wrongly."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmrt.engine.kv_cache import BlockManager


@dataclass(eq=False)
class FakeSeq:
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)


def check_invariants(bm: BlockManager, live: list[FakeSeq]) -> None:
    holders = Counter(b for s in live for b in s.block_ids)
    free = list(bm.free_block_ids)
    assert len(free) == len(set(free)), "a block is in the free list twice"
    for b in range(bm.num_blocks):
        assert bm.ref_counts[b] == holders.get(b, 0), f"block {b}: ref {bm.ref_counts[b]} but {holders.get(b, 0)} holders"
        assert (b in set(free)) == (holders.get(b, 0) == 0)
    for s in live:
        assert len(s.block_ids) == len(set(s.block_ids)), "a sequence holds one block twice"
        assert len(s.block_ids) >= bm.blocks_for(s.num_computed_tokens)


ops = st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "free"]), st.integers(0, 50), st.integers(1, 20)),
               max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
def test_random_operations_keep_invariants(ops, num_blocks, block_size):
    bm = BlockManager(num_blocks, block_size)
    live: list[FakeSeq] = []
    for op, pick, n in ops:
        if op == "new" or not live:
            seq = FakeSeq()
            if bm.can_allocate(seq, n):
                bm.allocate(seq, n)
                seq.num_computed_tokens = n
                live.append(seq)
        elif op == "grow":
            seq = live[pick % len(live)]
            if bm.can_allocate(seq, n):
                before = list(seq.block_ids)
                copies = bm.allocate(seq, n)
                for src, dst in copies:  # a copy replaces exactly the shared block being written
                    assert src in before and dst not in before and dst in seq.block_ids
                seq.num_computed_tokens += n
        elif op == "fork":
            parent = live[pick % len(live)]
            child = FakeSeq(parent.num_computed_tokens)
            bm.fork(parent, child)
            live.append(child)
        else:
            seq = live.pop(pick % len(live))
            bm.free(seq)
        check_invariants(bm, live)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks


def test_write_into_shared_partial_block_copies_it():
    bm = BlockManager(8, 4)
    parent = FakeSeq()
    bm.allocate(parent, 6)  # blocks: one full, one with 2 of 4 slots used
    parent.num_computed_tokens = 6
    child = FakeSeq(6)
    bm.fork(parent, child)
    copies = bm.allocate(child, 1)
    assert copies == [(parent.block_ids[1], child.block_ids[1])]
    assert child.block_ids[0] == parent.block_ids[0]  # full block still shared
    assert bm.ref_counts[parent.block_ids[0]] == 2 and bm.ref_counts[parent.block_ids[1]] == 1
    assert bm.allocate(parent, 1) == []  # the parent now owns its partial block alone


def test_double_free_is_refused():
    bm = BlockManager(4, 4)
    seq = FakeSeq()
    bm.allocate(seq, 5)
    held = list(seq.block_ids)
    bm.free(seq)
    seq.block_ids = held
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(seq)


def test_allocate_without_room_raises():
    bm = BlockManager(2, 4)
    seq = FakeSeq()
    assert not bm.can_allocate(seq, 9)
    with pytest.raises(RuntimeError):
        bm.allocate(seq, 9)


def test_freed_blocks_are_reused_before_untouched_ones_in_their_order():
    # A block never written costs page faults on its first write: the most recently freed come first.
    bm = BlockManager(64, 4)
    a, b = FakeSeq(), FakeSeq()
    bm.allocate(a, 12)
    bm.allocate(b, 8)
    first = list(a.block_ids)
    assert first == [0, 1, 2] and b.block_ids == [3, 4]
    bm.free(a)
    c = FakeSeq()
    bm.allocate(c, 16)
    assert c.block_ids == first + [5]  # a's blocks in a's order, then the next untouched one
    check_invariants(bm, [b, c])
