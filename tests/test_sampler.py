"""The batched sampler: greedy, processors, filters, seeded batch invariance, distributions, logprobs."""
from __future__ import annotations

import math

import pytest
import torch

from llmrt.errors import InvalidRequestError
from llmrt.model.layers.sampler import Sampler, SamplingMetadata
from llmrt.sampling_params import SamplingParams

sampler = Sampler()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # These tensors are tiny: intra-op threads only add wake-up latency (milliseconds on a busy box).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def meta_for(params, logits, prompts=None, outputs=None, generators=None):
    S, V = logits.shape
    return SamplingMetadata.build(
        params, prompts or [[] for _ in range(S)], outputs or [[] for _ in range(S)],
        generators or [None] * S, V, logits.device)


def sample(params, logits, **kw):
    return sampler(logits, meta_for(params, logits, **kw))


def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_and_input_untouched():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    before = logits.clone()
    out = sample([SamplingParams(temperature=0.0, logit_bias={3: 1.0}, repetition_penalty=1.3)] * 6, logits,
                 prompts=[[1, 2]] * 6)
    assert torch.equal(logits, before)
    plain = sample([SamplingParams(temperature=0.0)] * 6, logits)
    assert torch.equal(plain.sampled_token_ids, logits.argmax(-1))
    assert plain.sampled_token_ids.dtype == torch.int64 and plain.logprobs is None
    assert out.sampled_token_ids.shape == (6,)


def test_bf16_logits():
    torch.manual_seed(8)
    logits = torch.randn(3, 50).bfloat16()
    out = sample([SamplingParams(temperature=0.0), SamplingParams(top_k=5), SamplingParams()], logits)
    assert out.sampled_token_ids[0] == logits.float().argmax(-1)[0]


def reference_penalties(logits, params, prompts, outputs):
    out = logits.clone()
    for i, p in enumerate(params):
        for t in range(logits.shape[1]):
            x = out[i, t].item()
            if t in prompts[i] or t in outputs[i]:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            n = outputs[i].count(t)
            x -= p.presence_penalty * (n > 0) + p.frequency_penalty * n
            out[i, t] = x
    return out


def test_greedy_follows_penalized_logits():
    torch.manual_seed(1)
    V = 40
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.8),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=0.7),
        SamplingParams(temperature=0.0, repetition_penalty=0.6, presence_penalty=-0.5, frequency_penalty=0.9),
        SamplingParams(temperature=0.0),
    ]
    for step in range(40):
        # every other step all logits are negative, so the winner comes from the `logit * penalty` branch
        logits = torch.randn(len(params), V) * 2 - (8.0 if step % 2 else 0.0)
        prompts = [torch.randint(0, V, (8,)).tolist() for _ in params]
        outputs = [torch.randint(0, V, (int(torch.randint(0, 12, ())),)).tolist() for _ in params]
        ref = reference_penalties(logits, params, prompts, outputs)
        out = sample(params, logits, prompts=prompts, outputs=outputs)
        assert torch.equal(out.sampled_token_ids, ref.argmax(-1))


def test_penalties_change_the_winner():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]] * 3)
    out = sample([SamplingParams(temperature=0.0, repetition_penalty=2.0),  # 5/2 < 4
                  SamplingParams(temperature=0.0, frequency_penalty=0.6),  # 5 - 3*0.6 < 4
                  SamplingParams(temperature=0.0, presence_penalty=0.5)],  # 5 - 0.5 > 4
                 logits, prompts=[[0], [], []], outputs=[[], [0, 0, 0], [0, 0, 0]])
    assert out.sampled_token_ids.tolist() == [1, 1, 0]


def test_filters_that_reduce_to_greedy():
    torch.manual_seed(2)
    logits = torch.randn(32, 500) * 3
    greedy = logits.argmax(-1)
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0),
              SamplingParams(top_p=1e-6, top_k=40, temperature=1.5)):
        for _ in range(3):
            assert torch.equal(sample([p] * 32, logits).sampled_token_ids, greedy), p


def test_min_p_keeps_only_tokens_above_the_floor():
    torch.manual_seed(9)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.14, 0.06]])).repeat(2000, 1)
    for p in (SamplingParams(min_p=0.25), SamplingParams(min_p=0.25, top_p=0.99)):  # floor 0.125: drops token 3
        counts = torch.bincount(sample([p] * 2000, logits).sampled_token_ids, minlength=4)
        assert counts[3] == 0 and (counts[:3] > 0).all()


def filtered_distribution(logits, temperature, top_k, top_p):
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    candidates = order[:top_k] if top_k else order
    total = sum(probs[t].item() for t in candidates)
    for t in candidates:
        if mass >= top_p:
            break
        kept.append(t)
        mass += probs[t].item() / total
    exact = torch.zeros_like(probs)
    exact[kept] = probs[kept] / probs[kept].sum()
    return exact


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 0.9), (0.7, 0, 0.9), (1.3, 0, 1.0), (0.8, 3, 1.0)])
def test_distribution_matches_filtered_softmax(temperature, top_k, top_p):
    torch.manual_seed(3)
    logits = torch.tensor([2.0, 1.6, 1.2, 1.0, 0.5, 0.3, -0.5, -1.0])
    exact = filtered_distribution(logits, temperature, top_k, top_p)
    n = 20_000
    tokens = sample([SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n,
                    logits.repeat(n, 1)).sampled_token_ids
    freq = torch.bincount(tokens, minlength=8).float() / n
    assert (freq[exact == 0] == 0).all()
    assert (freq - exact).abs().max() < 0.01, (freq, exact)


def test_top_p_nucleus_wider_than_the_probe():
    torch.manual_seed(10)
    V = 1000
    wide = -torch.arange(V, dtype=torch.float32) * 0.005  # slowly decaying: the 0.9 nucleus is ~600 tokens
    narrow = -torch.arange(V, dtype=torch.float32) * 0.5
    n = 4000
    logits = torch.stack([wide, narrow] * (n // 2))
    tokens = sample([SamplingParams(top_p=0.9)] * n, logits).sampled_token_ids
    for row, col in ((wide, tokens[0::2]), (narrow, tokens[1::2])):
        exact = filtered_distribution(row, 1.0, 0, 0.9)
        size = int((exact > 0).sum())
        assert col.max() < size  # nothing outside the nucleus
        # the far half of the nucleus gets its share (a probe-only path would cap at 256 tokens)
        far = (col >= size // 2).float().mean().item()
        assert abs(far - exact[size // 2:].sum().item()) < 0.05
    assert int((filtered_distribution(wide, 1.0, 0, 0.9) > 0).sum()) > 256


def test_seeded_row_distribution_over_steps():  # the per-row draw really is Exp(1)-race distributed
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]])
    g = gen(123)
    params = [SamplingParams(seed=123)]
    tokens = torch.tensor([sample(params, logits, generators=[g]).sampled_token_ids.item() for _ in range(4000)])
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert (freq - torch.softmax(logits[0], -1)).abs().max() < 0.03


SEEDED = [
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7),
    SamplingParams(temperature=2.0, top_k=20, seed=7),  # boundary ties often win at this temperature
    SamplingParams(temperature=1.0, top_p=0.8, seed=7, repetition_penalty=1.2),
    SamplingParams(temperature=2.0, top_p=0.95, seed=7),  # nucleus wider than the probe: full sort
    SamplingParams(temperature=1.2, min_p=0.02, seed=7, frequency_penalty=0.3),
    SamplingParams(temperature=0.9, seed=7),
]


@pytest.mark.parametrize("target", SEEDED, ids=["top_k_top_p", "top_k", "top_p", "top_p_wide", "min_p", "plain"])
def test_seeded_row_is_batch_invariant(target):
    V, steps = 1000, 50
    others = [
        SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=1), SamplingParams(temperature=1.5),
        SamplingParams(top_k=100, seed=2), SamplingParams(top_k=3), SamplingParams(top_p=0.5, temperature=0.3),
        SamplingParams(top_p=0.95, seed=3), SamplingParams(min_p=0.1), SamplingParams(temperature=0.0, seed=4),
        SamplingParams(top_k=500, top_p=0.7, temperature=2.0), SamplingParams(presence_penalty=1.0, seed=5),
        SamplingParams(temperature=1.1, top_k=7, min_p=0.05), SamplingParams(temperature=0.2, seed=6),
        SamplingParams(repetition_penalty=1.5), SamplingParams(top_p=0.3, top_k=50, seed=8),
        SamplingParams(temperature=1.7, seed=9),
    ]
    torch.manual_seed(4)
    # Coarsely rounded (low-precision logits, exaggerated): many exact ties at the top-k boundary,
    # which a topk() of another k may break differently.
    step_logits = [(torch.randn(1 + len(others), V) * 6).round() / 2 for _ in range(steps)]

    def run(batched):
        at = 8 if batched else 0  # the target's row: mid-batch, then alone
        params = others[:at] + [target] + others[at:] if batched else [target]
        gens = [gen(7) if p is target else gen(100 + i) if p.seed else None for i, p in enumerate(params)]
        prompts = [[1, 2, 3]] * len(params)
        outputs = [[] for _ in params]
        for logits in step_logits:  # the target always sees row 0's logits
            logits = torch.cat([logits[1:at + 1], logits[:1], logits[at + 1:]])[: len(params)]
            tokens = sample(params, logits, prompts=prompts, outputs=outputs, generators=gens).sampled_token_ids
            for out, t in zip(outputs, tokens.tolist()):
                out.append(t)
        return outputs[at]

    alone = run(batched=False)
    assert alone == run(batched=True)
    assert len(set(alone)) > 5  # it really sampled


def test_same_seed_same_stream_and_different_seeds_differ():
    torch.manual_seed(11)
    logits = torch.randn(1, 1000)
    p = [SamplingParams(seed=1)]

    def stream(seed):
        g = gen(seed)  # kept across steps, as the engine does
        return [sample(p, logits, generators=[g]).sampled_token_ids.item() for _ in range(20)]

    first = stream(1)
    assert first == stream(1) != stream(2)
    assert len(set(first)) > 1  # the generator advances from step to step


def test_min_tokens_blocks_stops_until_reached():
    V, eos, stop = 10, 9, 4
    logits = torch.zeros(1, V)
    logits[0, eos], logits[0, stop] = 10.0, 9.0
    p = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10, stop_token_ids=[stop], eos_token_ids=[eos])
    tokens = [sample([p], logits, outputs=[[0] * n]).sampled_token_ids.item() for n in range(5)]
    assert tokens[:3] == [0, 0, 0] and tokens[3:] == [eos, eos]
    # with ignore_eos, eos is no stop, so min_tokens leaves it alone (only stop ids are blocked)
    p_ignore = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10, stop_token_ids=[stop],
                              eos_token_ids=[eos], ignore_eos=True)
    assert sample([p_ignore], logits).sampled_token_ids.item() == eos
    logits[0, eos] = 0.0
    assert sample([p_ignore], logits).sampled_token_ids.item() == 0
    # random sampling never emits a blocked token either
    pr = SamplingParams(min_tokens=2, max_tokens=10, stop_token_ids=[stop], eos_token_ids=[eos])
    logits = torch.zeros(500, V)
    tokens = sample([pr] * 500, logits).sampled_token_ids
    assert not ((tokens == eos) | (tokens == stop)).any()


def test_logit_bias_forces_a_token():
    torch.manual_seed(5)
    logits = torch.randn(64, 300)
    params = [SamplingParams(logit_bias={17: 100.0}), SamplingParams(temperature=0.0, logit_bias={250: 100.0}),
              SamplingParams(top_k=10, top_p=0.9, logit_bias={5: 100.0, 6: -100.0})] * 21 + [SamplingParams()]
    tokens = sample(params, logits).sampled_token_ids.tolist()
    assert tokens[:63] == [17, 250, 5] * 21
    with pytest.raises(InvalidRequestError) as e:
        meta_for([SamplingParams(logit_bias={300: 1.0})], logits[:1])
    assert e.value.param == "logit_bias"
    with pytest.raises(ValueError):  # a prompt id past the logits would scatter into another row
        meta_for([SamplingParams(repetition_penalty=1.1)], logits[:1], prompts=[[300]])


def test_logprobs_are_raw_and_topk_sorted():
    torch.manual_seed(6)
    logits = torch.randn(5, 200) * 2
    params = [SamplingParams(logprobs=3, repetition_penalty=2.0, temperature=0.5),
              SamplingParams(logprobs=0, temperature=0.0, logit_bias={7: 50.0}),
              SamplingParams(),
              SamplingParams(logprobs=5, top_k=4, seed=1),
              SamplingParams(logprobs=1, presence_penalty=2.0)]
    out = sample(params, logits, prompts=[[1, 2, 3]] * 5, outputs=[[4, 4]] * 5,
                 generators=[None, None, None, gen(1), None])
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs.shape == out.logprob_token_ids.shape == (5, 6)
    assert out.logprobs.dtype == torch.float32 and out.logprob_token_ids.dtype == torch.int64
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(out.logprobs[:, 0], raw.gather(1, out.sampled_token_ids[:, None])[:, 0])
    assert out.sampled_token_ids[1] == 7  # the bias moved the token, but not its raw logprob
    top = raw.topk(5, -1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    assert torch.allclose(out.logprobs[:, 1:], top.values)
    assert (out.logprobs[:, 1:].diff(dim=-1) <= 0).all()
    only_zero = sample([SamplingParams(logprobs=0), SamplingParams()], logits[:2])
    assert only_zero.logprobs.shape == (2, 1)


def test_greedy_and_random_rows_mixed():
    torch.manual_seed(7)
    logits = torch.randn(8, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(8)]
    draws = torch.stack([sample(params, logits).sampled_token_ids for _ in range(200)])
    greedy = logits.argmax(-1)
    assert (draws[:, ::2] == greedy[::2]).all()
    for i in range(1, 8, 2):
        assert len(draws[:, i].unique()) > 10  # really random
    assert ((draws >= 0) & (draws < 50)).all()


def test_empty_batch_and_top_k_at_least_vocab():
    logits = torch.randn(0, 10)
    assert sample([], logits).sampled_token_ids.shape == (0,)
    logits = torch.randn(2, 10)
    out = sample([SamplingParams(top_k=10), SamplingParams(top_k=50)], logits)  # top_k >= V is "off"
    assert ((out.sampled_token_ids >= 0) & (out.sampled_token_ids < 10)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_matches_itself_and_greedy():
    dev = torch.device("cuda")
    logits = torch.randn(4, 1000, device=dev)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=20, seed=3), SamplingParams(top_p=0.9),
              SamplingParams(seed=3, logprobs=2, repetition_penalty=1.2)]

    def run():
        gens = [None, torch.Generator(dev).manual_seed(3), None, torch.Generator(dev).manual_seed(3)]
        return sample(params, logits, prompts=[[1]] * 4, generators=gens)

    a, b = run(), run()
    assert a.sampled_token_ids[0] == logits[0].argmax()
    assert torch.equal(a.sampled_token_ids[[1, 3]], b.sampled_token_ids[[1, 3]])
    assert a.logprobs.shape == (4, 3) and a.logprobs.device.type == "cuda"
    assert not math.isnan(a.logprobs.sum().item())
