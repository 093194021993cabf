"""Speculative decoding keeps the target's outputs: token for token under greedy decoding, and in
distribution (statistically) under sampling; it composes with batching, preemption, prefix caching, n > 1,
structured output and stop conditions."""
from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
import torch

from conftest import ARCH_CONFIGS, build_checkpoint, repeating_prompts
from llmrt import LLM, SamplingParams, StructuredOutputs
from llmrt.errors import InvalidRequestError, UnsupportedError
from llmrt.spec_decode import rejection

ARCHS = list(ARCH_CONFIGS)
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=0)


_prompts = repeating_prompts


def _generate(path, prompts, params=GREEDY, **options):
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=8, **options)
    outs = llm.generate(prompts, params)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()
    return [o.outputs[0] for o in outs], llm


# A step budget large enough that every step speculates (the default rule turns it off in big batches).
ALWAYS = dict(speculative_max_batch_tokens=4096)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_outputs_equal_without_speculation(arch, checkpoints):
    prompts = _prompts(6, seed=11)
    ref, _ = _generate(checkpoints[arch], prompts)
    other = "llama2" if arch != "llama2" else "qwen2"  # an unrelated random draft with the same vocabulary
    for spec in ({"method": "ngram", "num_tokens": 3, "ngram_min": 1},
                 {"method": "draft", "model": str(checkpoints[arch]), "num_tokens": 4},
                 {"method": "draft", "model": str(checkpoints[other]), "num_tokens": 2}):
        outs, llm = _generate(checkpoints[arch], prompts, speculative={**spec, **ALWAYS})
        for r, o in zip(ref, outs):
            assert o.token_ids == r.token_ids, (arch, spec)
            # Logprobs are the target's own.
            lr = [d[t] for d, t in zip(r.logprobs, r.token_ids)]
            lo = [d[t] for d, t in zip(o.logprobs, o.token_ids)]
            assert max(abs(a - b) for a, b in zip(lr, lo)) < 1e-4
        st = llm.engine.stats()
        proposed, accepted = sum(st.spec_proposed_by_position), sum(st.spec_accepted_by_position)
        assert proposed > 0
        if spec.get("model") == str(checkpoints[arch]):
            assert accepted == proposed  # a draft equal to the target accepts everything
        if spec.get("model") == str(checkpoints[other]):
            assert accepted < proposed / 2


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_with_preemption_prefix_caching_and_n(mode, checkpoints):
    path = checkpoints["llama3"]
    shared = [7, 8, 9, 10, 11, 12, 13, 14] * 2
    prompts = [shared + p for p in _prompts(6, seed=5)]
    ref, _ = _generate(path, prompts)
    for spec in ({"method": "ngram", "num_tokens": 3, "ngram_min": 1}, {"method": "draft", "model": str(path)}):
        outs, llm = _generate(path, prompts, speculative={**spec, **ALWAYS}, num_gpu_blocks_override=40,
                              preemption_mode=mode)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        st = llm.engine.stats()
        assert st.num_preemptions > 0 and st.prefix_cache_hit_tokens > 0 and sum(st.spec_accepted_by_position) > 0
    # n > 1 samples fork, then each speculates on its own; greedy samples are all equal to the reference.
    outs = LLM(str(path), dtype="float32", block_size=4, speculative={"method": "draft", "model": str(path), **ALWAYS}
               ).generate(prompts[:2], SamplingParams(n=3, max_tokens=20, temperature=0, ignore_eos=True))
    for o, r in zip(outs, ref):
        assert all(s.token_ids == r.token_ids[:20] for s in o.outputs)


def test_stops_inside_an_accepted_run(checkpoints):
    """Stop token ids, max_tokens and stop strings that fall inside a run of accepted proposals end the
    sample at exactly the token (or text) the run without speculation ends at."""
    path = checkpoints["llama3"]
    prompts = _prompts(4, seed=9)
    ref, _ = _generate(path, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    spec = {"method": "draft", "model": str(path), "num_tokens": 8, **ALWAYS}  # everything accepted: long runs
    for r, prompt in zip(ref, prompts):
        stop_id = r.token_ids[13]
        first = r.token_ids.index(stop_id)
        params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]),
                  SamplingParams(max_tokens=11, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[r.text[20:26]])]
        outs, _ = _generate(path, [prompt] * 3, params, speculative=spec)
        assert outs[0].token_ids == r.token_ids[:first + 1] and outs[0].finish_reason == "stop"
        assert outs[1].token_ids == r.token_ids[:11] and outs[1].finish_reason == "length"
        assert outs[2].text == r.text[:r.text.index(r.text[20:26])] and outs[2].finish_reason == "stop"


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_structured_output_with_speculation(method, tmp_path_factory):
    """100 distinct samples under a JSON schema, with proposals the grammar often refuses (the matcher is
    advanced through them and rolled back every step): every one validates."""
    path = build_checkpoint("llama3", tmp_path_factory.mktemp("spec-structured") / "llama3", max_position_embeddings=512)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "n"], "additionalProperties": False}
    spec = {"method": "draft", "model": str(path), "num_tokens": 4} if method == "draft" else \
        {"method": "ngram", "num_tokens": 4, "ngram_min": 1}
    llm = LLM(str(path), dtype="float32", max_num_seqs=100, speculative={**spec, **ALWAYS})
    outs = llm.generate(["{"] * 100, [SamplingParams(max_tokens=128, temperature=1.0, seed=s,
                                                     structured=StructuredOutputs(json=schema)) for s in range(100)])
    texts = [o.outputs[0].text for o in outs]
    assert len(set(texts)) > 50 and all(o.outputs[0].finish_reason == "stop" for o in outs)
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    st = llm.engine.stats()
    proposed, accepted = sum(st.spec_proposed_by_position), sum(st.spec_accepted_by_position)
    assert 0 < accepted < proposed


def test_opt_out_and_bad_configurations(checkpoints):
    path = checkpoints["llama3"]
    outs, llm = _generate(path, _prompts(2, seed=1), SamplingParams(max_tokens=20, temperature=0, speculative=False),
                          speculative={"method": "ngram", "ngram_min": 1, **ALWAYS})
    assert sum(llm.engine.stats().spec_proposed_by_position) == 0
    with pytest.raises(UnsupportedError, match="speculative method 'eagle' is not supported"):
        LLM(str(path), speculative={"method": "eagle"})
    with pytest.raises(InvalidRequestError, match="needs a speculative_model"):
        LLM(str(path), speculative={"method": "draft"})
    small = build_checkpoint("llama2", path.parent / "vocab-256", vocab_size=256)
    with pytest.raises(UnsupportedError, match="vocabulary has 256 tokens, the target's 512"):
        LLM(str(path), speculative={"method": "draft", "model": str(small)})


def test_the_rule_stops_speculating_in_big_steps(checkpoints):
    """With the default bound (16 tokens), a batch of 32 decodes never speculates; one stream does."""
    path = checkpoints["llama3"]
    llm = LLM(str(path), dtype="float32", block_size=4, speculative={"method": "ngram", "ngram_min": 1})
    llm.generate(_prompts(32, seed=2), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert sum(llm.engine.stats().spec_proposed_by_position) == 0
    llm.generate(_prompts(1, seed=2), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert sum(llm.engine.stats().spec_proposed_by_position) > 0


# -- the output distribution -----------------------------------------------------------------------------------
VOCAB = 16
SAMPLES = 3000


def _chi2_p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity (cells with fewer than 10 pooled counts merged)."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    cells, rest = [], [0, 0]
    for k in keys:
        if a[k] + b[k] >= 10:
            cells.append((a[k], b[k]))
        else:
            rest[0] += a[k]
            rest[1] += b[k]
    if sum(rest):
        cells.append(tuple(rest))
    stat = 0.0
    for x, y in cells:
        tot = x + y
        ex, ey = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    df = max(len(cells) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


LENGTH = 8


def _samples(llm: LLM, prompt: list[int]) -> list[Counter]:
    """Per output position, how often each token was drawn; and how often each pair of the first two."""
    outs = llm.generate([prompt] * SAMPLES, [SamplingParams(max_tokens=LENGTH, temperature=1.0, seed=s,
                                                            ignore_eos=True) for s in range(SAMPLES)])
    tokens = [o.outputs[0].token_ids for o in outs]
    return [Counter(t[j] for t in tokens) for j in range(LENGTH)] + [Counter(tuple(t[1:3]) for t in tokens)]


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vocab")
    # The target is peaked; the draft nearly uniform, so its proposals are often wrong and a rule that
    # accepted them unchecked would show up as a shift towards uniform.
    target = build_checkpoint("llama2", root / "target", vocab_size=VOCAB, initializer_range=0.3)
    draft = build_checkpoint("llama2", root / "draft", seed=1, vocab_size=VOCAB, initializer_range=0.02)
    llm = LLM(str(target), dtype="float32", max_num_seqs=64)
    # The prompt is the target's own greedy text, so n-gram proposals (copies of it) are often right too.
    greedy = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    prompt = [1, 2, 3] + list(greedy[0].outputs[0].token_ids)
    return target, draft, prompt, _samples(llm, prompt)


def _spec_llm(target, spec) -> LLM:
    return LLM(str(target), dtype="float32", max_num_seqs=64, speculative={**spec, **ALWAYS})


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampling_distribution_is_the_targets(method, tiny_vocab):
    target, draft, prompt, base = tiny_vocab
    spec = {"method": "ngram", "ngram_min": 1, "num_tokens": 2} if method == "ngram" else \
        {"method": "draft", "model": str(draft), "num_tokens": 2}
    llm = _spec_llm(target, spec)
    got = _samples(llm, prompt)
    st = llm.engine.stats()
    accepted, proposed = sum(st.spec_accepted_by_position), sum(st.spec_proposed_by_position)
    # Speculation really took part, and both ways out of the rule (accepting, resampling) were taken often.
    assert accepted > SAMPLES / 10 and proposed - accepted > SAMPLES / 10
    for j, (b, g) in enumerate(zip(base, got)):  # each position's tokens, then the joint of tokens 2 and 3
        assert _chi2_p_value(b, g) > 1e-4, f"{method}: distribution {j} differs"


def _accept_all(target_probs, drafts, draft_probs, greedy, generator):
    """Bug: every proposal accepted unchecked (as if q were ~0 wherever it proposes)."""
    q = None if draft_probs is None else torch.full_like(draft_probs, 1e-9)
    return rejection.verify(target_probs, drafts, q, greedy, generator)


def _resample_from_target(target_probs, drafts, draft_probs, greedy, generator):
    """Bug: after a rejection, the replacement is drawn from p instead of norm(max(0, p - q))."""
    tokens, accepted = rejection.verify(target_probs, drafts, draft_probs, greedy, generator)
    if accepted < len(drafts):
        tokens[-1] = int(torch.multinomial(target_probs[accepted], 1, generator=generator).item())
    return tokens, accepted


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", [_accept_all, _resample_from_target])
def test_the_distribution_test_catches_a_wrong_acceptance_rule(wrong_rule, tiny_vocab, monkeypatch):
    """Two plausible bugs in the rule shift the distribution, and the same test sees each."""
    target, draft, prompt, base = tiny_vocab
    monkeypatch.setattr("llmrt.spec_decode.verify_step.verify", wrong_rule)
    got = _samples(_spec_llm(target, {"method": "draft", "model": str(draft), "num_tokens": 2}), prompt)
    assert min(_chi2_p_value(b, g) for b, g in zip(base, got)) < 1e-4
