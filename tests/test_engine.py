"""The engine end to end through the offline API: embedded model, batching, preemption, n>1, bad input."""
from __future__ import annotations

import random

import pytest
import torch

from llmrt import LLM, SamplingParams
from llmrt.errors import ContextLengthExceededError, InvalidRequestError, UnsupportedError

STORY = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


@pytest.fixture(scope="module")
def story_llm() -> LLM:
    return LLM(dtype="float32", block_size=4, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def llama(checkpoints) -> LLM:
    return LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4, max_num_batched_tokens=64)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 50))] for _ in range(n)]


def _all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def test_embedded_model_tells_the_story(story_llm):
    out = story_llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0))[0]
    assert ("Once upon a time" + out.outputs[0].text).startswith(STORY)


def test_embedded_model_matches_hf_transformers(story_llm, embedded_model_dir):
    from transformers import AutoModelForCausalLM

    ids = story_llm.get_tokenizer().encode("Once upon a time")
    out = story_llm.generate([ids], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    ref = hf.generate(torch.tensor([ids]), max_new_tokens=100, do_sample=False)[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == ref


def test_output_shape_and_metrics(story_llm):
    out = story_llm.generate(["Hello", [1, 403, 407]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.prompt for o in out] == ["Hello", None]
    assert out[1].prompt_token_ids == [1, 403, 407]
    for o in out:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and len(c.token_ids) == 8 and isinstance(c.text, str)
        m = o.metrics
        assert m.num_prompt_tokens == len(o.prompt_token_ids) and m.num_output_tokens == 8
        assert 0 <= m.queue_time <= m.ttft <= m.e2e and m.tpot > 0 and not m.preempted


def test_chat_uses_the_template(story_llm):
    out = story_llm.chat([{"role": "user", "content": "Once upon a time"}], SamplingParams(max_tokens=12, temperature=0))
    ids = story_llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Once upon a time"}])
    assert out[0].prompt_token_ids == ids and out[0].outputs[0].token_ids


def test_greedy_is_batch_invariant(llama):
    target = [5, 17, 300, 42, 9, 11]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llama.generate([target], params)[0].outputs[0].token_ids
    crowd = llama.generate(_prompts(7, 3) + [target] + _prompts(8, 4), params)
    assert crowd[7].outputs[0].token_ids == alone


def test_seeded_sampling_is_batch_invariant(llama):
    target = [5, 17, 300, 42, 9, 11]
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llama.generate([target], params)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=0.7, seed=i, ignore_eos=True) for i in range(15)]
    crowd = llama.generate(_prompts(15, 5) + [target], others + [params])
    assert crowd[-1].outputs[0].token_ids == alone
    again = llama.generate([target], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1235, ignore_eos=True))
    assert again[0].outputs[0].token_ids != alone  # the seed matters


def test_preemption_keeps_outputs_and_frees_blocks(checkpoints):
    prompts = _prompts(6, 7)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    roomy = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4)
    ref = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    # 24 blocks of 4 tokens: each request needs up to 20 blocks, so they cannot all run at once.
    tight = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4, num_gpu_blocks_override=24,
                max_num_batched_tokens=32)
    outs = tight.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert any(o.metrics.preempted for o in outs)
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert _all_blocks_free(tight)


def test_n_samples_share_the_prompt_and_differ(llama):
    prompt = list(range(10, 30))
    out = llama.generate([prompt], SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llama.generate([prompt], SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    greedy = llama.generate([prompt], SamplingParams(n=2, max_tokens=16, temperature=0, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert _all_blocks_free(llama)


def test_fork_shares_prompt_blocks(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4)
    llm.engine.add_request("x", list(range(10, 30)), SamplingParams(n=4, max_tokens=5, temperature=1.0, ignore_eos=True))
    llm.engine.step()  # prefill 20 tokens = 5 full blocks, then fork into 4 samples
    seqs = llm.engine.scheduler.requests["x"].sequences
    assert len(seqs) == 4 and all(s.block_ids[:5] == seqs[0].block_ids[:5] for s in seqs)
    assert llm.engine.block_manager.num_blocks - llm.engine.block_manager.num_free_blocks == 5
    llm.engine.abort_request("x")
    assert _all_blocks_free(llm)


def test_stop_strings_tokens_and_min_tokens(story_llm):
    full = story_llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0))[0].outputs[0]
    out = story_llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0, stop=["Lily"]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "Lily"
    assert c.text == full.text[: full.text.index("Lily")]
    kept = story_llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0, stop=["Lily"],
                                                                 include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text.endswith("Lily")
    tok = full.token_ids[3]
    by_id = story_llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tok]))[0]
    assert by_id.outputs[0].token_ids == full.token_ids[:4] and by_id.outputs[0].stop_reason == tok
    late = story_llm.generate("Once upon a time", SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[tok],
                                                                 min_tokens=5))[0].outputs[0]
    assert len(late.token_ids) > 4
    assert _all_blocks_free(story_llm)


def test_logprobs(story_llm):
    out = story_llm.generate("Once upon a time", SamplingParams(max_tokens=5, temperature=0, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)))


@pytest.mark.parametrize("prompt, params, error, param", [
    ("", SamplingParams(), InvalidRequestError, "prompt"),
    ([], SamplingParams(), InvalidRequestError, "prompt"),
    ([1, 2, 99999], SamplingParams(), InvalidRequestError, "prompt"),
    ([1, -3], SamplingParams(), InvalidRequestError, "prompt"),
    ("hi", None, InvalidRequestError, "max_tokens"),
    ("hi", None, InvalidRequestError, "top_p"),
    ("hi", SamplingParams(max_tokens=600), ContextLengthExceededError, "max_tokens"),
])
def test_bad_input_is_refused_and_engine_keeps_serving(story_llm, prompt, params, error, param):
    if params is None:
        with pytest.raises(error) as exc:
            SamplingParams(max_tokens=0) if param == "max_tokens" else SamplingParams(top_p=1.5)
    else:
        with pytest.raises(error) as exc:
            story_llm.generate([[1, 403, 407], prompt], params)  # the good prompt is not left behind
    assert exc.value.param == param
    assert _all_blocks_free(story_llm)
    out = story_llm.generate("Once upon a time", SamplingParams(max_tokens=20, temperature=0))[0]
    assert ("Once upon a time" + out.outputs[0].text).startswith(STORY[:40])


def test_context_error_says_the_numbers(story_llm):
    with pytest.raises(ContextLengthExceededError) as exc:
        story_llm.generate([[1] * 500], SamplingParams(max_tokens=100))
    assert "512" in exc.value.message and "500" in exc.value.message and "100" in exc.value.message


def test_bad_request_does_not_disturb_running_ones(story_llm):
    engine = story_llm.engine
    ids = story_llm.get_tokenizer().encode("Once upon a time")
    expected = story_llm.generate([ids], SamplingParams(max_tokens=30, temperature=0))[0].outputs[0].token_ids
    engine.add_request("good", ids, SamplingParams(max_tokens=30, temperature=0))
    got: list[int] = []
    for step in range(40):
        if step == 3:
            with pytest.raises(InvalidRequestError):
                engine.add_request("bad", [1, 10**6], SamplingParams())
        for o in engine.step():
            got += o.new_token_ids
        if not engine.has_unfinished_requests():
            break
    assert got == expected


def test_unknown_architecture_is_unsupported(tmp_path):
    import json
    import shutil

    from tests.conftest import EMBEDDED

    shutil.copytree(EMBEDDED, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="LlamaForCausalLM"):
        LLM(str(tmp_path / "m"))


def test_more_samples_than_batch_slots_is_refused(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), dtype="float32", max_num_seqs=2)
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate([[5, 6, 7]], SamplingParams(n=3, max_tokens=4))
    assert exc.value.param == "n"
    assert _all_blocks_free(llm)


def test_prompt_logprobs_match_hf_and_survive_chunking(checkpoints):
    from transformers import AutoModelForCausalLM

    prompt = list(range(20, 47))
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["llama3"], dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    # A 5-token budget splits the prompt into chunks, and a 1-token leftover chunk, with another request beside it.
    llm = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4, max_num_batched_tokens=5)
    outs = llm.generate([prompt, [7, 8]], [SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2),
                                           SamplingParams(max_tokens=3, temperature=0)])
    plp = outs[0].prompt_logprobs
    assert len(plp) == len(prompt) and plp[0] is None and outs[1].prompt_logprobs is None
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        assert entry[prompt[pos]] == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)
        top2 = ref[pos - 1].topk(2).indices.tolist()
        assert all(t in entry for t in top2)
