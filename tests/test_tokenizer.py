"""Tokenizer loading, chat templates and the incremental detokenizer, on real tokenizers (fixtures/tokenizers)."""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import sentencepiece as spm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import llmrt
from llmrt.errors import InvalidRequestError, ModelLoadError, UnsupportedError
from llmrt.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
VECTORS = FIXTURES / "llamacpp-vectors"
PATHS = {name: FIXTURES / name for name in ("gpt2", "llama2", "llama3", "mistral", "phi3")}
PATHS["stories260K"] = Path(llmrt.__file__).parent / "data" / "stories260K"
NAMES = list(PATHS)

TEXTS = [
    "Hello world",
    "你好，世界！这是一个测试。",
    "日本語のテキストと漢字",
    "Emoji: 🎉🚀 and a family 👩‍👩‍👧 done.",
    "Crème brûlée à la façon de Zoë, naïve café",
    "Ελληνικά και русский текст",
    "  leading spaces\n\tand tabs  ",
    "def f(x):\n    return x ** 2  # code\n",
    "한국어 문장입니다",
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


@pytest.fixture(scope="session")
def load():
    """Loads each tokenizer once per session (Llama 3 is converted from tiktoken ranks on load, a few seconds)."""
    cache: dict[str, Tokenizer] = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = load_tokenizer(str(PATHS[name]))
        return cache[name]

    return get


# ---------------------------------------------------------------------------------------------- loading

def read_vectors(name: str) -> list[tuple[str, list[int]]]:
    inputs = (VECTORS / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = (VECTORS / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(inputs) == len(outputs) == 47
    return [(text, [int(x) for x in ids.split()]) for text, ids in zip(inputs, outputs)]


@pytest.mark.parametrize("name,vectors", [("gpt2", "gpt-2"), ("llama2", "llama-spm"), ("phi3", "phi-3")])
def test_llamacpp_vectors(load, name, vectors):
    tok = load(name)
    wrong = [(t, ids, tok.encode(t, add_special_tokens=False)) for t, ids in read_vectors(vectors)
             if tok.encode(t, add_special_tokens=False) != ids]
    assert wrong == []


@pytest.mark.parametrize("name", ["llama2", "mistral"])
def test_sentencepiece_models_match_sentencepiece(load, name):
    tok = load(name)
    sp = spm.SentencePieceProcessor(model_file=str(PATHS[name] / "tokenizer.model"))
    texts = [t for t, _ in read_vectors("llama-spm")] + TEXTS + [" Hello", "   x", "\n\nHi", "a  b   c"]
    assert [tok.encode(t, add_special_tokens=False) for t in texts] == [sp.encode(t) for t in texts]
    assert tok.encode("Hello world") == [sp.bos_id()] + sp.encode("Hello world")


@pytest.mark.parametrize("name,plain,bos,eos,vocab", [
    ("gpt2", [15496, 995], None, 50256, 50257),
    ("llama2", [15043, 3186], 1, 2, 32000),
    ("llama3", [9906, 1917], 128000, 128009, 128256),
    ("mistral", [22557, 1526], 1, 2, 32000),
    ("phi3", [15043, 3186], 1, 32000, 32064),
])
def test_hello_world(load, name, plain, bos, eos, vocab):
    tok = load(name)
    assert tok.encode("Hello world", add_special_tokens=False) == plain
    assert tok.encode("Hello world") == ([bos] if bos is not None else []) + plain
    assert tok.count_tokens("Hello world") == len(tok.encode("Hello world"))
    assert tok.eos_token_id == eos and tok.vocab_size == vocab
    if bos is not None:
        assert tok.bos_token_id == bos


def test_llama3_special_tokens(load):
    tok = load("llama3")
    text = "<|begin_of_text|><|start_header_id|>user<|end_header_id|><|eot_id|><|reserved_special_token_250|>"
    assert tok.encode(text, add_special_tokens=False) == [128000, 128006, 882, 128007, 128009, 128255]
    assert tok.decode([128000, 9906, 128009]) == "Hello"
    assert tok.decode([128000, 9906, 128009], skip_special_tokens=False) == "<|begin_of_text|>Hello<|eot_id|>"


def test_stories260k(load):
    tok = load("stories260K")
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (512, 1, 2)
    assert len(tok.byte_token_ids) == 256
    assert all(tok.hf.convert_ids_to_tokens(i) == f"<0x{b:02X}>" for i, b in tok.byte_values.items())
    ids = tok.encode("Once upon a time")
    assert ids[0] == 1 and tok.decode(ids) == "Once upon a time"


@pytest.mark.parametrize("name", NAMES)
def test_round_trip(load, name):
    tok = load(name)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_load_errors(tmp_path):
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(tmp_path))  # no tokenizer files at all
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(tmp_path))


def test_load_bare_vocab_and_merges(tmp_path):
    for f in ("vocab.json", "merges.txt"):
        shutil.copy(PATHS["gpt2"] / f, tmp_path / f)
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("Hello world") == [15496, 995] and tok.eos_token_id == 50256


# ---------------------------------------------------------------------------------------------- chat

def test_chat_llama3(load):
    tok = load("llama3")
    text = tok.render_chat(CONVERSATION)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert tok.apply_chat_template(CONVERSATION) == [
        128000, 128006, 9125, 128007, 271, 2675, 527, 51637, 13, 128009,
        128006, 882, 128007, 271, 13347, 1070, 128009,
        128006, 78191, 128007, 271, 9906, 0, 128009,
        128006, 882, 128007, 271, 1383, 68, 128009,
        128006, 78191, 128007, 271,
    ]
    assert tok.render_chat(CONVERSATION, add_generation_prompt=False).endswith("Bye<|eot_id|>")


def test_chat_mistral(load):
    tok = load("mistral")
    assert tok.render_chat(CONVERSATION) == "<s>[INST] You are terse.\n\nHi there [/INST] Hello!</s>[INST] Bye [/INST]"
    ids = tok.apply_chat_template(CONVERSATION)
    assert ids[:4] == [1, 733, 16289, 28793]  # <s>[INST]: one BOS, from the template
    assert ids[-4:] == [733, 28748, 16289, 28793]  # [/INST]
    assert ids.count(1) == 1 and ids.count(2) == 1
    assert ids == [
        1, 733, 16289, 28793, 995, 460, 3636, 331, 28723, 13, 13, 23809, 736, 733, 28748, 16289, 28793,
        22557, 28808, 2, 733, 16289, 28793, 2463, 28706, 733, 28748, 16289, 28793,
    ]


def test_chat_phi3(load):
    tok = load("phi3")
    assert tok.render_chat(CONVERSATION) == (
        "<s><|system|>\nYou are terse.<|end|>\n<|user|>\nHi there<|end|>\n"
        "<|assistant|>\nHello!<|end|>\n<|user|>\nBye<|end|>\n<|assistant|>\n"
    )
    assert tok.apply_chat_template(CONVERSATION) == [
        1, 32006, 29871, 13, 3492, 526, 1935, 344, 29889, 32007, 29871, 13,
        32010, 29871, 13, 18567, 727, 32007, 29871, 13,
        32001, 29871, 13, 10994, 29991, 32007, 29871, 13,
        32010, 29871, 13, 2059, 29872, 32007, 29871, 13,
        32001, 29871, 13,
    ]


def test_chat_content_parts_tools_and_tool_role(load):
    tok = load("llama3")
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert "user<|end_header_id|>\n\none\ntwo<|eot_id|>" in tok.render_chat(parts)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert '"name": "get_weather"' in tok.render_chat(parts, tools=tools)
    calls = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    ]
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>" in tok.render_chat(calls)


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    ["not a dict"],
    [{"content": "no role"}],
    [{"role": "robot", "content": "hi"}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": None}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text", "text": 3}]}],
])
def test_bad_messages(load, messages):
    with pytest.raises(InvalidRequestError) as e:
        load("phi3").apply_chat_template(messages)
    assert e.value.param == "messages"


def test_template_rejections_are_invalid_requests(load):
    with pytest.raises(InvalidRequestError, match="alternate") as e:
        load("mistral").render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert e.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="tool"):
        load("phi3").render_chat([{"role": "tool", "content": "x"}])


def test_no_chat_template(load):
    tok = load("gpt2")
    assert not tok.has_chat_template
    with pytest.raises(UnsupportedError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert e.value.param == "messages" and "chat template" in e.value.message


def test_chat_template_override(load, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    tok = load_tokenizer(str(PATHS["gpt2"]), chat_template=str(path))
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n"
    tok = Tokenizer(load("gpt2").hf, chat_template="{{ messages[0]['content'] }}!")
    assert tok.apply_chat_template([{"role": "user", "content": "Hello"}]) == tok.encode("Hello!")
    assert not load("gpt2").has_chat_template  # the override did not leak into the shared HF tokenizer
    with pytest.raises(ModelLoadError):
        load_tokenizer(str(PATHS["gpt2"]), chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ModelLoadError):
        Tokenizer(tok.hf, chat_template="{% for %}").render_chat([{"role": "user", "content": "y"}])


# ---------------------------------------------------------------------------------------------- detokenizer

def context_decode(tok: Tokenizer, prompt: list[int], out: list[int], skip: bool) -> str | None:
    """What `out` decodes to after `prompt`, or None where the prompt's text is not a prefix of the whole."""
    whole, head = tok.decode(prompt + out, skip), tok.decode(prompt, skip)
    return whole[len(head):] if whole.startswith(head) else None


def check_stream(tok: Tokenizer, prompt: list[int], out: list[int], chunks: list[int], skip: bool) -> None:
    """Streams `out` in `chunks`-sized steps and checks every delta against the context decode."""
    want = context_decode(tok, prompt, out, skip)
    if want is None:
        return  # e.g. a prompt ending inside a character that the output completes
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    emitted, pos = "", 0
    for size in chunks:
        delta = detok.step(out[pos:pos + size])
        pos += size
        emitted += delta
        now = context_decode(tok, prompt, out[:pos], skip)
        if now is None:
            continue  # a byte run open at the prompt's end, which these tokens make invalid for now
        # Everything emitted is in the decode at this point and stays there: no partial character
        # (a U+FFFD the full text lacks) ever goes out.
        assert now.startswith(emitted), (out[:pos], emitted, now)
        assert want.startswith(emitted), (out[:pos], emitted, want)
        # And nothing is held back without a reason: an unfinished character or an open byte run.
        decodable = [i for i in prompt + out[:pos] if not (skip and i in tok.special_ids)]
        if not now.endswith("\ufffd") and not (decodable and decodable[-1] in tok.byte_token_ids):
            assert emitted == now, (out[:pos], emitted, now)
    assert pos == len(out)
    emitted += detok.flush()
    assert emitted == want == detok.output_text
    assert detok.token_ids == out


def random_ids(tok: Tokenizer, rng: random.Random) -> list[int]:
    """Token ids of mixed provenance: real text cut at random places, byte tokens, specials, or pure noise."""
    kind = rng.random()
    if kind < 0.25:
        return [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(30))]
    if kind < 0.35 and tok.byte_token_ids:
        return [rng.choice(sorted(tok.byte_token_ids)) for _ in range(rng.randrange(12))]
    ids: list[int] = []
    for _ in range(rng.randrange(1, 4)):
        piece = tok.encode(rng.choice(TEXTS), add_special_tokens=False)
        a = rng.randrange(len(piece) + 1)
        ids += piece[a:rng.randrange(a, len(piece) + 1)]
        if rng.random() < 0.2:
            ids.append(rng.choice(sorted(tok.special_ids)))
    return ids


def random_chunks(n: int, rng: random.Random) -> list[int]:
    chunks = []
    while n > 0:
        chunks.append(min(n, 1 if rng.random() < 0.5 else rng.randrange(1, 6)))
        n -= chunks[-1]
    return chunks


@pytest.mark.parametrize("name", NAMES)
def test_detokenizer_random_streams(load, name):
    tok = load(name)
    rng = random.Random(f"detok-{name}")
    for _ in range(150):
        prompt = tok.encode(rng.choice(TEXTS)) if rng.random() < 0.6 else random_ids(tok, rng)
        out = random_ids(tok, rng)
        skip = rng.random() < 0.7
        check_stream(tok, prompt, out, [1] * len(out), skip)
        check_stream(tok, prompt, out, random_chunks(len(out), rng), skip)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(NAMES), skip=st.booleans())
def test_detokenizer_property(load, data, name, skip):
    tok = load(name)
    pool = sorted(tok.byte_token_ids | tok.special_ids) or [0]
    token = st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(pool),
        st.sampled_from(tok.encode("".join(TEXTS), add_special_tokens=False)),
    )
    prompt = data.draw(st.one_of(st.sampled_from(TEXTS).map(tok.encode), st.lists(token, max_size=8)))
    out = data.draw(st.lists(token, max_size=40))
    sizes = data.draw(st.lists(st.integers(1, 6), min_size=len(out), max_size=len(out)))
    chunks, left = [], len(out)
    for size in sizes:
        if left == 0:
            break
        chunks.append(min(size, left))
        left -= chunks[-1]
    check_stream(tok, prompt, out, chunks, skip)


def test_detokenizer_keeps_the_space_of_the_first_word(load):
    tok = load("llama2")
    detok = IncrementalDetokenizer(tok, tok.encode("Hello"))
    assert detok.step(tok.encode(" world", add_special_tokens=False)[-1:]) == " world"
    assert IncrementalDetokenizer(tok, []).step([3186]) == "world"  # as decode([3186]) says


def test_detokenizer_holds_byte_fallback_characters(load):
    tok = load("llama2")
    ni = [tok.hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "你".encode()]  # not a llama2 piece
    detok = IncrementalDetokenizer(tok, tok.encode("Say"))
    assert [detok.step([i]) for i in ni] == ["", "", ""]  # the run of byte tokens is still open
    assert detok.step([tok.hf.convert_tokens_to_ids("!")]) == "你!"
    detok = IncrementalDetokenizer(tok, tok.encode("Say"))
    assert [detok.step([i]) for i in ni] + [detok.flush()] == ["", "", "", "你"]


def test_detokenizer_byte_level_emoji(load):
    tok = load("gpt2")
    ids = tok.encode("Hi 🎉", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) == "Hi 🎉" and deltas[-1].endswith("🎉")
    assert not any("\ufffd" in d for d in deltas)


def test_detokenizer_flushes_invalid_bytes(load):
    gpt2 = load("gpt2")
    partial = gpt2.encode("🎉", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(gpt2, gpt2.encode("Hi"))
    assert [detok.step([i]) for i in partial] == [""] * len(partial)
    assert detok.flush() == "\ufffd" == detok.output_text
    llama = load("llama2")
    detok = IncrementalDetokenizer(llama, [])
    assert detok.step([llama.hf.convert_tokens_to_ids("<0xE4>")]) == ""
    assert detok.flush() == "\ufffd"


def test_detokenizer_special_tokens(load):
    tok = load("llama3")
    out = tok.encode("Hi there", add_special_tokens=False) + [128009]
    for skip, want in [(True, "Hi there"), (False, "Hi there<|eot_id|>")]:
        detok = IncrementalDetokenizer(tok, tok.apply_chat_template(CONVERSATION), skip_special_tokens=skip)
        assert "".join(detok.step([i]) for i in out) + detok.flush() == want


@pytest.mark.parametrize("name", ["llama2", "gpt2"])
def test_detokenizer_window_stays_small(load, name):
    """Each step decodes a bounded window, also through long byte runs and garbage."""
    tok = load(name)
    text = tok.encode("".join(TEXTS) * 20, add_special_tokens=False)
    # A stray continuation byte, or the first bytes of an emoji: U+FFFD whatever follows.
    emoji = tok.encode("🎉", add_special_tokens=False)
    noise = [tok.hf.convert_tokens_to_ids("<0x80>") if tok.byte_token_ids else emoji[0]]
    emoji_run = tok.encode("🎉" * 200, add_special_tokens=False)
    for out in (text, noise * 700 + text[:20], emoji_run + text[:5]):
        detok = IncrementalDetokenizer(tok, tok.encode("Start:"))
        biggest = 0
        for i in out:
            detok.step([i])
            biggest = max(biggest, len(detok._window))
        assert biggest <= 2 * 256 + 5
        assert detok.output_text + detok.flush() == context_decode(tok, tok.encode("Start:"), out, True)


def test_byte_token_logprob_names_need_no_transformers():
    """A logprob entry for a byte-fallback token names its byte from the Rust tokenizer alone: building the
    transformers tokenizer there (seconds, on the first such request) would stall the server."""
    from llmrt.server.logprobs import TokenTexts
    from llmrt.tokenizer import load_tokenizer

    tok = load_tokenizer(str(PATHS["stories260K"]))  # a fresh one: the session's may have built it already
    byte_80 = next(i for i, b in tok.byte_values.items() if b == 0x80)
    byte_41 = next(i for i, b in tok.byte_values.items() if b == 0x41)
    entries = TokenTexts(tok).entries(tok.encode("Once"), [byte_80], [{byte_80: -0.5, byte_41: -1.0}], 2)
    assert entries[0].text == "bytes:\\x80" and entries[0].alts[0][0] == "bytes:\\x80"
    assert tok._base._hf is None  # the transformers tokenizer was never built
