"""Speculative decoding under sampling and around the KV cache: every sampling option applies to the target
and the draft alike, a seed reproduces a request's tokens, the KV a span leaves behind (prefix-cached blocks,
forked samples' blocks) holds accepted tokens only, EOS ends an accepted run, and streams carry runs."""
from __future__ import annotations

import asyncio
import json
import random
import shutil

import pytest

from llmrt import LLM, SamplingParams
from llmrt.config import EngineConfig
from llmrt.engine.async_llm import AsyncLLM

ALWAYS = dict(speculative_max_batch_tokens=4096)  # every step speculates
NGRAM = {"method": "ngram", "num_tokens": 3, "ngram_min": 1, **ALWAYS}


def _llm(path, **options) -> LLM:
    return LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8, **options)


def _repetitive(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(1, 6))] + [rng.randrange(3, 40) for _ in range(4)] * 4
            for _ in range(n)]


def _spec_counts(llm: LLM) -> tuple[int, int]:
    st = llm.engine.stats()
    return sum(st.spec_proposed_by_position), sum(st.spec_accepted_by_position)


OPTIONS = [dict(temperature=0.4), dict(temperature=0.4, top_k=8), dict(temperature=0.4, top_p=0.8),
           dict(temperature=0.4, min_p=0.2), dict(temperature=0.4, repetition_penalty=1.2),
           dict(temperature=0.4, presence_penalty=0.4, frequency_penalty=0.2),
           dict(temperature=0.4, logit_bias={7: 4.0, 9: 3.0}), dict(temperature=1.0, top_k=3, top_p=0.9)]
STORY = "Lily had a red ball. She liked to play with it in the park. Lily had a red ball. She liked to"


def test_seeded_samples_equal_without_speculation():
    """N-gram proposals are a point mass: verifying one draws the target's token exactly as the sampler
    would, so a seeded request gets the same tokens with and without speculation, whatever the batch.
    (The embedded model, a trained one, copies its context, so proposals are often right at 0.4.)"""
    params = [SamplingParams(max_tokens=40, ignore_eos=True, seed=100 + i, **o) for i, o in enumerate(OPTIONS)]
    ref = [o.outputs[0].token_ids for o in LLM(dtype="float32").generate([STORY] * len(params), params)]
    spec = LLM(dtype="float32", speculative=NGRAM)
    assert [o.outputs[0].token_ids for o in spec.generate([STORY] * len(params), params)] == ref
    proposed, accepted = _spec_counts(spec)
    assert accepted > 20 and proposed - accepted > 20  # both outcomes of verification happened often
    # Alone (other proposal counts per step) the same requests give the same tokens again.
    assert [spec.generate(STORY, q)[0].outputs[0].token_ids for q in params[:3]] == ref[:3]


def test_a_draft_equal_to_the_target_accepts_under_every_sampling_option(checkpoints):
    """p and q go through the same processors, temperature, top-k/p and min-p: with the target as its own
    draft p == q, so min(1, p/q) accepts (all but float noise). A seed reproduces the run in a fresh engine
    (with a draft under sampling the tokens depend on the proposal counts, which follow the schedule)."""
    path = checkpoints["qwen2"]
    prompts = _repetitive(len(OPTIONS), seed=6)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, seed=7 + i, **o) for i, o in enumerate(OPTIONS)]
    spec = {"method": "draft", "model": str(path), "num_tokens": 4, **ALWAYS}
    llm = _llm(path, speculative=spec)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    proposed, accepted = _spec_counts(llm)
    assert proposed > 100 and accepted >= 0.98 * proposed, (accepted, proposed)
    assert [o.outputs[0].token_ids for o in _llm(path, speculative=spec).generate(prompts, params)] == first


def test_prefix_cached_blocks_hold_only_accepted_tokens(checkpoints):
    """An unrelated draft gets most proposals rejected; the blocks its runs leave in the prefix cache are
    then read by requests that continue those texts (without speculation), and give the reference tokens."""
    path, other = checkpoints["mistral"], checkpoints["llama2"]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = _repetitive(4, seed=8)
    llm = _llm(path, speculative={"method": "draft", "model": str(other), "num_tokens": 4, **ALWAYS})
    first = llm.generate(prompts, greedy)
    proposed, accepted = _spec_counts(llm)
    assert proposed - accepted > 40
    longer = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in first]
    hits = llm.engine.block_manager.prefix_cache_hit_tokens
    off = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, speculative=False)
    got = [o.outputs[0].token_ids for o in llm.generate(longer, off)]
    # Most of each longer prompt (its generated part included) came from blocks computed while speculating.
    assert llm.engine.block_manager.prefix_cache_hit_tokens - hits >= sum(len(p) - 8 for p in longer)
    ref = [o.outputs[0].token_ids for o in _llm(path, enable_prefix_caching=False).generate(longer, off)]
    assert got == ref


def test_forked_samples_with_draft_lookahead_keep_their_own_kv(checkpoints):
    """n > 1 samples fork after a chunked prefill whose sequence holds a draft's lookahead blocks; each sample's
    logprobs (the target's, from its KV) equal those of its text scored from scratch."""
    path = checkpoints["llama3"]
    prompt = _repetitive(1, seed=10)[0] + list(range(40, 60))  # longer than one 32-token step: chunked
    llm = _llm(path, speculative={"method": "draft", "model": str(path), "num_tokens": 4, **ALWAYS})
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=5, logprobs=0,
                                                ignore_eos=True))[0]
    assert len({tuple(s.token_ids) for s in out.outputs}) == 3 and _spec_counts(llm)[1] > 0
    scorer = _llm(path)
    for s in out.outputs:
        scored = scorer.generate([prompt + list(s.token_ids)], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        want = [d[t] for d, t in zip(scored.prompt_logprobs[len(prompt):], s.token_ids)]
        got = [d[t] for d, t in zip(s.logprobs, s.token_ids)]
        assert max(abs(a - b) for a, b in zip(want, got)) < 1e-3


def test_eos_inside_an_accepted_run(checkpoints, tmp_path):
    """The model's EOS id, met inside a run of accepted proposals, ends the sample at that token."""
    src = checkpoints["llama3"]
    prompt = _repetitive(1, seed=12)[0]
    greedy = SamplingParams(max_tokens=40, temperature=0)
    ref = _llm(src).generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0]
    eos = ref.token_ids[17]
    path = tmp_path / "eos"
    shutil.copytree(src, path)
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.is_file():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = eos
            f.write_text(json.dumps(cfg))
    want = ref.token_ids[:ref.token_ids.index(eos) + 1]
    for spec in ({"method": "draft", "model": str(path), "num_tokens": 8, **ALWAYS}, NGRAM):
        llm = _llm(path, speculative=spec)
        o = llm.generate([prompt], greedy)[0].outputs[0]
        assert o.token_ids == want and o.finish_reason == "stop", spec
        assert _spec_counts(llm)[1] > 0


@pytest.mark.slow
def test_stream_carries_accepted_runs_and_stops_inside_them():
    """Through the engine-core process: a delta may hold several tokens; the stream ends as offline does,
    also at a stop string inside a run."""
    story = "Lily had a red ball. Lily had a red ball. Lily had a red ball. Lily had a"
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    ref = LLM(dtype="float32").generate(story, greedy)[0].outputs[0]
    stop = ref.text[30:36]
    stopped = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, stop=[stop])

    async def main():
        config = EngineConfig.create(None, dtype="float32", speculative={"method": "ngram", "num_tokens": 4})
        eng = AsyncLLM(config)
        await eng.start()
        try:
            sizes, last = [], None
            async for out in eng.generate(story, greedy, "a"):
                sizes.append(len(out.outputs[0].token_ids))
                last = out
            assert last.outputs[0].token_ids == ref.token_ids and last.outputs[0].text == ref.text
            assert max(b - a for a, b in zip([0] + sizes, sizes)) > 1  # a delta with an accepted run
            async for out in eng.generate(story, stopped, "b"):
                last = out
            assert last.outputs[0].text == ref.text[:ref.text.index(stop)]
            assert last.outputs[0].finish_reason == "stop"
        finally:
            await eng.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=120))
