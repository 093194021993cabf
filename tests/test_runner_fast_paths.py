"""The sampler's greedy fast path (argmax without the per-step metadata) gives the full sampler's tokens."""
from __future__ import annotations

import random

from llmrt import LLM, SamplingParams
from llmrt.model.layers.sampler import argmax_only


def test_plain_greedy_skips_the_sampler_and_gives_its_tokens(checkpoints, monkeypatch):
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(2, 30))] for _ in range(5)]
    llm = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4, max_num_seqs=8)
    sampler_calls = []
    original = llm.engine.executor.worker.model_runner.sampler.forward
    monkeypatch.setattr(llm.engine.executor.worker.model_runner.sampler, "forward",
                        lambda *a, **k: sampler_calls.append(1) or original(*a, **k))
    fast = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert not sampler_calls  # the fast path ran
    # logprobs=0 needs the sampler (logprobs of the sampled token); the tokens must not change.
    slow = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
    assert sampler_calls
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in slow]


def test_what_keeps_the_sampler():
    assert argmax_only(SamplingParams(temperature=0), 0, False)
    for kw in ({"logprobs": 1}, {"logit_bias": {5: 1.0}}, {"repetition_penalty": 1.2}, {"presence_penalty": 0.5},
               {"frequency_penalty": 0.5}, {"min_tokens": 3}):
        assert not argmax_only(SamplingParams(temperature=0, **kw), 0, False), kw
    assert argmax_only(SamplingParams(temperature=0, min_tokens=3), 3, False)  # min_tokens reached: no block
    assert not argmax_only(SamplingParams(temperature=0), 0, True)  # a grammar
    assert not argmax_only(SamplingParams(temperature=0.7), 0, False)
