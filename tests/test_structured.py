"""Constrained decoding on random-weight models: their free output is noise, so validity comes from the grammar."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from conftest import build_checkpoint
from llmrt import LLM, SamplingParams, StructuredOutputs
from llmrt.errors import InvalidRequestError

SAMPLES = 100
MAX_TOKENS = 256

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {"type": "object", "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                "required": ["name", "age"], "additionalProperties": False},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        "required": ["user", "role"], "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
            "points": {"type": "array", "maxItems": 3, "items": {
                "type": "object", "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                                 "y": {"type": "integer", "minimum": -10, "maximum": 10}},
                "required": ["x", "y"], "additionalProperties": False}},
        },
        "required": ["tags", "points"], "additionalProperties": False,
    },
    "required_and_optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "ok": {"type": "boolean"},
            "level": {"enum": [1, 2, 3]},
            "note": {"type": "string", "maxLength": 6},
            "size": {"enum": ["S", "M", "L"]},
        },
        "required": ["id", "ok", "level"], "additionalProperties": False,
    },
}
ISO_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
CHOICES = ["positive", "negative", "neutral", "I don't know"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    # A 512-token context so that 256 generated tokens fit after the prompt.
    path = build_checkpoint("llama3", tmp_path_factory.mktemp("structured") / "llama3", max_position_embeddings=512)
    return LLM(str(path), dtype="float32", max_num_seqs=SAMPLES)


def _samples(llm: LLM, spec: StructuredOutputs, seed: int = 0) -> list:
    params = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=MAX_TOKENS, seed=seed, structured=spec)
    return llm.generate("Once upon a time", params)[0].outputs


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_samples_are_valid_and_finish(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    outs = _samples(llm, StructuredOutputs(json=schema))
    assert len(outs) == SAMPLES
    for o in outs:
        # Bounded strings, numbers and arrays: every sample ends by the grammar (EOS), within the token limit.
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), schema)
    assert len({o.text for o in outs}) > SAMPLES // 2  # sampled, not one forced string


def test_regex_samples_match(llm: LLM) -> None:
    outs = _samples(llm, StructuredOutputs(regex=ISO_DATE), seed=1)
    for o in outs:
        assert o.finish_reason == "stop"
        assert re.fullmatch(ISO_DATE, o.text), o.text


def test_choice_samples_are_choices(llm: LLM) -> None:
    outs = _samples(llm, StructuredOutputs(choice=CHOICES), seed=2)
    assert {o.text for o in outs} <= set(CHOICES)
    assert all(o.finish_reason == "stop" for o in outs)
    assert len({o.text for o in outs}) > 1


def test_ebnf_grammar_and_json_object(llm: LLM) -> None:
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    params = SamplingParams(n=20, temperature=1.0, max_tokens=64, seed=3, structured=StructuredOutputs(grammar=grammar))
    for o in llm.generate("Sum:", params)[0].outputs:
        if o.finish_reason == "stop":
            assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", o.text), o.text
    params = SamplingParams(n=20, temperature=1.0, max_tokens=64, seed=4,
                            structured=StructuredOutputs(json_object=True))
    outs = llm.generate("JSON:", params)[0].outputs
    for o in outs:
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.startswith("{")


def test_bad_grammars_are_refused_with_the_compiler_message(llm: LLM) -> None:
    for spec, words in [(dict(regex="(abc"), "parenthesis"), (dict(grammar="root ::= foo"), "foo"),
                        (dict(json={"type": "nope"}), "nope")]:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate("x", SamplingParams(max_tokens=4, structured=StructuredOutputs(**spec)))
        assert words in e.value.message and e.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError):
        StructuredOutputs(regex="a", choice=["b"])  # two constraints
    with pytest.raises(InvalidRequestError):
        SamplingParams(ignore_eos=True, structured=StructuredOutputs(regex="a"))
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # the engine still works


def test_mixed_batch_leaves_free_outputs_unchanged(llm: LLM) -> None:
    prompts = ["Once upon a time", "The cat", "Lily and Tom went"]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    constrained = SamplingParams(temperature=0, max_tokens=200, structured=StructuredOutputs(json=SCHEMAS["nested"]))
    mixed = llm.generate([prompts[0], "A", prompts[1], "B", prompts[2]],
                         [free, constrained, free, constrained, free])
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i in (1, 3):
        assert mixed[i].outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(mixed[i].outputs[0].text), SCHEMAS["nested"])


def test_seeds_stops_and_preemption_keep_the_grammar(tmp_path_factory) -> None:
    path = build_checkpoint("llama3", tmp_path_factory.mktemp("structured-small") / "llama3", seed=1)
    # Few KV blocks: 8 samples of ~60 tokens cannot all stay, so some are preempted and recomputed.
    llm = LLM(str(path), dtype="float32", num_gpu_blocks_override=20, block_size=8)
    schema = SCHEMAS["nested"]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=120, seed=7, structured=StructuredOutputs(json=schema))
    first = llm.generate("Hello there", params)[0]
    assert first.metrics.num_preemptions > 0
    for o in first.outputs:
        assert o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), schema)
    roomy = LLM(str(path), dtype="float32")
    again = roomy.generate("Hello there", params)[0]
    assert again.metrics.num_preemptions == 0
    assert [o.text for o in again.outputs] == [o.text for o in first.outputs]  # seeds: same samples
    # A stop string cuts the constrained text like any other.
    stopped = roomy.generate("Hello there", SamplingParams(
        n=8, temperature=1.0, max_tokens=120, seed=7, stop=['"role"'], structured=StructuredOutputs(json=schema)))
    assert [o.text for o in stopped[0].outputs] == [o.text.split('"role"')[0] for o in first.outputs]
