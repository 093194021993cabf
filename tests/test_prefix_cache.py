"""Prefix caching: hash chain naming, reuse, LRU eviction, and engine outputs equal to uncached runs."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from llmrt import LLM, SamplingParams
from llmrt.config import SCHEDULING_POLICIES
from llmrt.engine.kv_cache import BlockManager, hash_block

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@dataclass(eq=False)
class Seq:
    token_ids: list[int]
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0


def compute(bm: BlockManager, seq: Seq) -> None:
    """Admit `seq` the way the scheduler does: take its cached prefix, allocate the rest, 'compute' it all."""
    cached = bm.match_prefix(seq)
    if cached:
        bm.take_prefix(seq, cached)
    bm.allocate(seq, len(seq.token_ids) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(seq.token_ids)
    bm.cache_full_blocks(seq)


# -- naming ---------------------------------------------------------------------------------------------------
def test_block_names_chain_over_parent_tokens_and_extra_key():
    a = hash_block(None, [1, 2, 3, 4])
    assert len(a) == 32  # SHA-256: a collision would need a SHA-256 collision
    assert hash_block(None, [1, 2, 3, 4]) == a
    assert hash_block(None, [1, 2, 3, 5]) != a
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], b"lora-1") != a
    # Token ids are encoded at fixed width, so no two different id lists share a byte string.
    assert hash_block(None, [1, 23]) != hash_block(None, [12, 3])
    assert hash_block(None, [256]) != hash_block(None, [1, 0])


def test_same_tokens_after_a_different_prefix_are_not_reused():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    first = Seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, first)
    assert bm.match_prefix(Seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == first.block_ids[:2]
    assert bm.match_prefix(Seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []  # block 2 equal, but its parent differs


def test_the_last_token_is_always_computed():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    compute(bm, Seq(list(range(8))))
    assert len(bm.match_prefix(Seq(list(range(8))))) == 1  # the second block holds the last token
    assert len(bm.match_prefix(Seq(list(range(9))))) == 2


def test_free_cached_blocks_are_evicted_least_recently_used_and_only_when_needed():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    old, new = Seq([1, 2, 3, 4, 0]), Seq([5, 6, 7, 8, 0])  # two full blocks and a partial one each
    compute(bm, old)
    bm.free(old)
    compute(bm, new)  # fresh blocks are used before any named one is evicted
    bm.free(new)
    assert bm.num_evictions == 0 and bm.num_free_blocks == 6 and len(bm.cached) == 4  # freed, still named
    taker = Seq([])
    bm.allocate(taker, 6)  # three blocks: the two unnamed ones and the least recently freed named one
    assert bm.num_evictions == 1
    assert len(bm.match_prefix(Seq([5, 6, 7, 8, 9]))) == 2  # the newer prefix survives
    assert len(bm.match_prefix(Seq([1, 2, 3, 4, 9]))) == 1  # the older one lost its tail block first
    bm.free(taker)
    assert bm.num_free_blocks == 6


def test_taking_a_cached_block_keeps_ref_counts_and_copy_on_write():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = Seq([1, 2, 3, 4, 5, 6])
    compute(bm, a)
    b = Seq([1, 2, 3, 4, 5, 6, 7])
    compute(bm, b)
    assert b.block_ids[0] == a.block_ids[0] and bm.ref_counts[a.block_ids[0]] == 2
    assert b.block_ids[1] != a.block_ids[1]  # the partial block is never shared through the cache
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_disabled_cache_matches_nothing():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    compute(bm, Seq(list(range(12))))
    assert bm.match_prefix(Seq(list(range(12)))) == [] and not bm.cached


# -- through the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cached(checkpoints) -> LLM:
    return LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def uncached(checkpoints) -> LLM:
    return LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4, max_num_batched_tokens=64,
               enable_prefix_caching=False)


def _rand(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def test_second_request_computes_only_its_new_tokens(cached, uncached):
    prefix = _rand(12, 1)  # three full blocks of 4
    cached.generate([prefix + [7, 8]], GREEDY)
    bm = cached.engine.block_manager
    hits_before = bm.prefix_cache_hit_tokens
    second = prefix + [9, 10, 11]
    cached.engine.add_request("second", second, GREEDY)
    cached.engine.step()
    assert cached.engine.last_step_tokens == 3  # only the tokens after the cached prefix
    while cached.engine.has_unfinished_requests():
        cached.engine.step()
    assert bm.prefix_cache_hit_tokens - hits_before == 12
    out = cached.generate([second], GREEDY)[0]
    assert out.metrics.num_cached_tokens == 12
    assert out.outputs[0].token_ids == uncached.generate([second], GREEDY)[0].outputs[0].token_ids


def test_cached_outputs_equal_uncached_with_chunks_forks_and_prompt_logprobs(cached, uncached):
    system = _rand(40, 2)
    prompts = [system + _rand(5, 10 + i) for i in range(6)]
    params = [GREEDY, SamplingParams(max_tokens=8, temperature=0.9, seed=3, n=3, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2, ignore_eos=True)] * 2
    warm = cached.generate(prompts[:1], GREEDY)  # the shared prefix is cached from here on
    got = cached.generate(prompts, params)
    want = uncached.generate(prompts, params)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
    # Prompt 0 repeats the warm-up request: 11 of its 12 blocks are cached (not the last token's); others share 10.
    assert [o.metrics.num_cached_tokens for o in got] == [44, 40, 0, 40, 40, 0]
    # Prompt logprobs need every prompt position computed: such a request skips its cache hit.
    for o, w, p in zip(got, want, params):
        if p.prompt_logprobs is not None:
            assert o.metrics.num_cached_tokens == 0
            assert [sorted(d) if d else d for d in o.prompt_logprobs] == [sorted(d) if d else d for d in w.prompt_logprobs]
    assert warm[0].metrics.num_cached_tokens in (0, 40)


def test_eviction_under_pressure_keeps_outputs_correct(checkpoints, uncached):
    tight = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4, num_gpu_blocks_override=24,
                max_num_batched_tokens=64)
    families = [_rand(16, 100 + f) for f in range(4)]
    prompts = [families[i % 4] + _rand(3, 200 + i) for i in range(16)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in tight.generate(prompts[::-1], params)][::-1]
    want = [o.outputs[0].token_ids for o in uncached.generate(prompts, params)]
    assert got == want and again == want
    bm = tight.engine.block_manager
    assert bm.num_evictions > 0 and bm.prefix_cache_hit_tokens > 0
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("policy", SCHEDULING_POLICIES)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_outputs(checkpoints, uncached, policy, mode):
    tight = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4, num_gpu_blocks_override=24,
                max_num_batched_tokens=32, scheduling_policy=policy, preemption_mode=mode, swap_space=1 << 20)
    rng = random.Random(5)
    shared = _rand(8, 6)
    prompts = [(shared if i % 2 else []) + _rand(rng.randint(3, 20), 300 + i) for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = tight.generate(prompts, params, priority=[i % 3 for i in range(8)], user=[f"u{i % 2}" for i in range(8)])
    want = uncached.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    assert tight.engine.scheduler.num_preemptions_total > 0
    if mode == "swap":
        assert tight.engine.scheduler.num_swaps_out > 0
    bm = tight.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# -- properties -----------------------------------------------------------------------------------------------
from collections import Counter  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "free"]), st.integers(0, 50),
                              st.lists(st.integers(0, 2), min_size=1, max_size=9)), max_size=60),
       num_blocks=st.integers(4, 16), block_size=st.sampled_from([1, 2, 4]))
def test_random_cached_operations_keep_invariants(ops, num_blocks, block_size):
    """Tokens from a 3-letter alphabet make prefixes collide often; ref counts, names and the free pool stay
    consistent, and a block reached through the cache always holds the tokens its name says."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    content: dict[int, tuple] = {}  # block -> the tokens written into it (what its KV would be)
    live: list[Seq] = []

    def write(seq: Seq, start: int) -> None:
        for i in range(start // block_size, bm.blocks_for(len(seq.token_ids))):
            content[seq.block_ids[i]] = tuple(seq.token_ids[i * block_size:(i + 1) * block_size])

    for op, pick, tokens in ops:
        if op == "new" or not live:
            seq = Seq(list(tokens))
            cached = bm.match_prefix(seq)
            need = bm.blocks_for(len(seq.token_ids)) - len(cached) + bm.num_free_taken_by(cached)
            if need > bm.num_free_blocks:
                continue
            for i, b in enumerate(cached):  # what the cache hands out is what the prefix holds
                assert content[b] == tuple(seq.token_ids[i * block_size:(i + 1) * block_size])
            if cached:
                bm.take_prefix(seq, cached)
            start = seq.num_computed_tokens
            for src, dst in bm.allocate(seq, len(seq.token_ids) - start):
                content[dst] = content.get(src, ())
            write(seq, start)
            seq.num_computed_tokens = len(seq.token_ids)
            bm.cache_full_blocks(seq)
            live.append(seq)
        elif op == "grow":
            seq = live[pick % len(live)]
            if not bm.can_allocate(seq, len(tokens)):
                continue
            start = seq.num_computed_tokens
            for src, dst in bm.allocate(seq, len(tokens)):
                content[dst] = content[src]
            seq.token_ids += tokens
            write(seq, start)
            seq.num_computed_tokens = len(seq.token_ids)
            bm.cache_full_blocks(seq)
        elif op == "fork":
            parent = live[pick % len(live)]
            child = Seq(list(parent.token_ids), parent.num_computed_tokens)
            bm.fork(parent, child)
            live.append(child)
        else:
            bm.free(live.pop(pick % len(live)))
        holders = Counter(b for s in live for b in s.block_ids)
        free = bm.free_block_ids
        assert len(free) == len(set(free)) and len(free) == bm.num_free_blocks
        for b in range(num_blocks):
            assert bm.ref_counts[b] == holders.get(b, 0)
            assert (b in set(free)) == (holders.get(b, 0) == 0)
        for h, b in bm.cached.items():
            assert bm.block_hash[b] == h
        for s in live:
            for i in range(s.num_computed_tokens // block_size):  # full blocks hold their tokens
                assert content[s.block_ids[i]] == tuple(s.token_ids[i * block_size:(i + 1) * block_size])
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == num_blocks
