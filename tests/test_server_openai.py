"""The official OpenAI SDK against a real `llmrt serve` process: a random tiny Llama 3 and the embedded model."""
from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
import pytest

from llmrt.config import DEFAULT_MODEL_DIR
from llmrt.tokenizer import load_tokenizer
from server_utils import all_blocks_free, run_server, wait_until

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
MESSAGES = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module", params=["llama3", "embedded"])
def server(request, checkpoints):
    model_dir = checkpoints["llama3"] if request.param == "llama3" else None
    with run_server(model_dir, "--enable-debug-endpoints") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=60, max_retries=0)
        yield SimpleNamespace(base=base, client=client, model=client.models.list().data[0].id,
                              tokenizer=load_tokenizer(str(model_dir or DEFAULT_MODEL_DIR)), kind=request.param,
                              model_dir=model_dir)


@pytest.fixture(scope="module")
def offline(server):
    """Greedy reference outputs from the offline engine on the same checkpoint."""
    from llmrt import LLM, SamplingParams

    llm = LLM(str(server.model_dir) if server.model_dir else None)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    chat_ids = llm.get_tokenizer().apply_chat_template(MESSAGES)
    completion, chat = llm.generate([PROMPT, chat_ids], params)
    return SimpleNamespace(completion=completion.outputs[0], chat=chat.outputs[0])


def test_models_list(server):
    models = server.client.models.list().data
    assert len(models) == 1
    assert models[0].id == ("stories260K" if server.kind == "embedded" else "llama3")


def test_completion_matches_offline_engine_and_counts_usage(server, offline):
    r = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == server.model
    (choice,) = r.choices
    assert choice.text == offline.completion.text and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(server.tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_chat_matches_offline_engine_and_counts_usage(server, offline):
    r = server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_completion_tokens=24,
                                              temperature=0, extra_body={"ignore_eos": True})
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == offline.chat.text
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(server.tokenizer.apply_chat_template(MESSAGES))
    assert r.usage.completion_tokens == 24


def test_streams_add_up_to_the_non_streamed_text(server, offline):
    stream = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == offline.completion.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24

    stream = server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=24,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline.chat.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage = chunks[-1].usage
    assert usage.prompt_tokens == len(server.tokenizer.apply_chat_template(MESSAGES))
    assert usage.completion_tokens == 24


def test_n_choices(server):
    r = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0,
                                         seed=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 16
    r = server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=8, n=2, seed=3,
                                              extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1] and r.usage.completion_tokens == 16
    stream = server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=8, n=2,
                                                   seed=3, stream=True, extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {c.index: c.message.content for c in r.choices}  # same seed, same samples


def _joined(tokens: list[str]) -> str:
    """Token texts put back together ("bytes:\\xNN" is one byte of a character)."""
    out = b""
    for t in tokens:
        out += bytes([int(t[8:], 16)]) if t.startswith("bytes:\\x") else t.encode()
    return out.decode("utf-8", errors="replace")


def test_logprobs(server):
    r = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                         logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    if server.kind == "embedded":  # a real model writes whole characters
        assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(logprob)
        assert top[token] == pytest.approx(logprob)

    r = server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and _joined([t.token for t in content]) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.logprob <= 0 and _joined([t.token]).encode() == bytes(t.bytes) or len(t.bytes) == 1


def _ids(names) -> list[int]:
    """The ids of `token_id:<id>` names (vLLM's return_tokens_as_token_ids rendering); fails on any other name."""
    assert all(n.startswith("token_id:") and n[9:].isdigit() for n in names), names
    return [int(n[9:]) for n in names]


def test_return_tokens_as_token_ids(server, offline):
    """vLLM's extension, as regress asks for it: every token named `token_id:<id>`, streamed or not, completions
    and chat, echoed prompt included; `text_offset` is as without it and a chat token's `bytes` are its text's."""
    ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    want = list(offline.completion.token_ids[:6])
    r = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                         logprobs=2, extra_body=ids)
    lp = r.choices[0].logprobs
    assert _ids(lp.tokens) == want
    for name, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        _ids(top)
        assert top[name] == pytest.approx(logprob) and 1 <= len(top) <= 3
    plain = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                             logprobs=2, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert (lp.text_offset, lp.token_logprobs) == (plain.text_offset, plain.token_logprobs)
    stream = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0,
                                              logprobs=2, stream=True, extra_body=ids)
    assert _ids([t for c in stream if c.choices and c.choices[0].logprobs
                 for t in c.choices[0].logprobs.tokens]) == want
    prompt_ids = server.tokenizer.encode(PROMPT)
    echo = server.client.completions.create(model=server.model, prompt=prompt_ids, max_tokens=1, temperature=0,
                                            echo=True, logprobs=1, extra_body=ids).choices[0].logprobs
    assert _ids(echo.tokens) == prompt_ids + want[:1]

    want = list(offline.chat.token_ids[:6])
    r = server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body=ids)
    content = r.choices[0].logprobs.content
    assert _ids([t.token for t in content]) == want
    assert all(len(_ids([a.token for a in t.top_logprobs])) == 3 for t in content)
    assert b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace") == r.choices[0].message.content
    stream = server.client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6,
                                                   temperature=0, logprobs=True, stream=True, extra_body=ids)
    assert _ids([t.token for c in stream if c.choices and c.choices[0].logprobs
                 for t in c.choices[0].logprobs.content]) == want
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=1, logprobs=1,
                                         extra_body={"return_tokens_as_token_ids": "yes"})
    assert e.value.code == "invalid_request" and e.value.param == "return_tokens_as_token_ids"


def test_stop_strings(server, offline):
    text = offline.completion.text
    stop = text[6:9]  # somewhere inside the greedy text
    cut = text[:text.index(stop)]
    r = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                         stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    stream = server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0,
                                              stop=[stop, "@@@@"], stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(server):
    def sample(seed):
        return server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                                seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in range(5)}) > 1  # the seed matters


def test_sdk_sees_the_error_taxonomy(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client.completions.create(model="nope", prompt=PROMPT)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.chat.completions.create(model=server.model, messages=MESSAGES, temperature=5)
    assert e.value.code == "invalid_request" and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=server.model, prompt=PROMPT, max_tokens=100000)
    assert e.value.code == "context_length_exceeded"
    assert e.value.body["message"]


def test_tokenize_routes_and_version(server):
    r = httpx.post(f"{server.base}/tokenize", json={"prompt": PROMPT}, timeout=10).json()
    assert r["tokens"] == server.tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    r = httpx.post(f"{server.base}/detokenize", json={"tokens": r["tokens"]}, timeout=10).json()
    assert r["prompt"] == PROMPT
    assert httpx.get(f"{server.base}/version", timeout=10).json()["version"]
    assert wait_until(lambda: all_blocks_free(server.base))


def test_echo_with_logprobs_scores_the_prompt(server):
    """What lm-eval's loglikelihood does: echo the prompt with logprobs and read the prompt tokens' scores."""
    from llmrt import LLM, SamplingParams

    ids = server.tokenizer.encode(PROMPT)
    ref = LLM(str(server.model_dir) if server.model_dir else None).generate(
        [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0].prompt_logprobs
    r = server.client.completions.create(model=server.model, prompt=ids, max_tokens=1, temperature=0, echo=True,
                                         logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert lp.token_logprobs[pos] == pytest.approx(ref[pos][ids[pos]], abs=1e-5)
        assert lp.top_logprobs[pos]  # the top alternative is there
    assert r.choices[0].text.startswith(server.tokenizer.decode(ids))
