"""Pipeline parallelism through the offline API: PP=2 (two processes, gloo) against one rank on the same weights."""
from __future__ import annotations

import json

import pytest

from llmrt import LLM
from llmrt.config import EngineConfig
from llmrt.engine.step import StepInput
from llmrt.errors import UnsupportedError
from llmrt.sampling_params import SamplingParams
from llmrt.worker.pipeline_step import num_micro_batches, split_micro_batches
from tests.conftest import build_checkpoint
from tests.test_parallel import CASES, GREEDY, OPTS, PROMPTS, _assert_same
from tests.test_parallel import _generate as tp_generate


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The TP tests' five architectures (random weights; Qwen2 with one KV head)."""
    root = tmp_path_factory.mktemp("pp")
    return {name: build_checkpoint(name, root / name, **over) for name, over in CASES.items()}


def _generate(model, pp: int, prompts=PROMPTS, params=GREEDY, tp: int = 1, **kw):
    return tp_generate(model, tp, prompts, params, pipeline_parallel_size=pp, **kw)


@pytest.mark.slow
def test_each_stage_holds_its_layers_and_the_end_stages_the_rest(models):
    """Measured per-rank parameter bytes: stage 0 the embedding and layer 0; stage 1 layer 1, the final norm and
    the LM head, which for tied embeddings is its own copy of the table. Each rank's KV holds its one layer."""
    for arch in ("llama3", "gpt2"):
        one = LLM(str(models[arch]), **OPTS)
        model = one.engine.executor.worker.model_runner.model
        sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}  # tied: counted once
        # Where packed layers keep a dense copy (--dense-weight-copy), the last stage's head, no longer sharing
        # the embedding, holds its table twice: packed and dense.
        tables = 2 if any(getattr(m, "keep_dense", False) for m in model.modules()) else 1
        one.shutdown()
        if arch == "llama3":
            first = sum(v for n, v in sizes.items() if n.startswith(("model.embed_tokens.", "model.layers.0.")))
            last = sum(v for n, v in sizes.items() if n.startswith(("model.layers.1.", "model.norm.")))
            last += sizes["model.embed_tokens.weight"] * tables  # tied head
        else:
            first = sum(v for n, v in sizes.items() if n.startswith(("wte.", "wpe.", "h.0.")))
            last = sum(v for n, v in sizes.items() if n.startswith(("h.1.", "ln_f."))) + sizes["wte.weight"] * tables
        two = LLM(str(models[arch]), pipeline_parallel_size=2, **OPTS)
        try:
            per_rank = two.engine.executor.rank_parameter_bytes()
            worker = two.engine.executor.worker
            assert len(worker.kv_caches) == 1 and worker.model_runner.kv_spec.num_layers == 1
        finally:
            two.shutdown()
        assert per_rank == [first, last], (arch, per_rank, first, last)


@pytest.mark.slow
def test_micro_batching_changes_nothing_and_the_bubble_is_measured(models):
    """M=1 and M=2 give the same tokens and logprobs (sampled with a seed, a penalty and logprobs: rank 0 samples
    from the logits the last stage sends back); every stage reports waiting and total seconds per step."""
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=3, repetition_penalty=1.3, logprobs=2)
    ref, _ = _generate(models["qwen3"], 1, params=params)
    one, _ = _generate(models["qwen3"], 2, params=params, pipeline_micro_batches=1)
    llm = LLM(str(models["qwen3"]), pipeline_parallel_size=2, pipeline_micro_batches=2, **OPTS)
    try:
        two = llm.generate(PROMPTS, params)
        again = llm.generate(PROMPTS, params)  # the prompts' full blocks now come from the prefix cache
        st = llm.engine.stats()
    finally:
        llm.shutdown()
    _assert_same(ref, one)
    # Not bitwise: a micro-batch's prefill rows can fit llmrt's fp32 kernel (<= 64 rows) where the whole batch
    # takes torch's GEMM, which rounds differently in the last bit; the decode attention is batch-invariant
    # (test_cpu_paged_attention). Measured: 1.2e-6 on main with the torch attention backend, 1.4e-6 with branch
    # `batch`'s cpu_paged kernel (a few float32 ulps of a logprob near -5).
    _assert_same(one, two, tol=1e-5)
    _assert_same(two, again)
    assert st.prefix_cache_hit_tokens > 0
    assert st.pipeline_steps > 0 and len(st.pipeline_wait_seconds) == 2
    assert all(0 < w < t for w, t in zip(st.pipeline_wait_seconds, st.pipeline_stage_seconds))
    from llmrt.metrics.prometheus import _EngineCollector

    names = {m.name for m in _EngineCollector("m", lambda: st.__dict__, lambda: None, "cpu").collect()}
    assert {"llmrt_pipeline_bubble_seconds", "llmrt_pipeline_bubble_share"} <= names


@pytest.mark.slow
def test_swap_preemption_prefix_caching_and_structured_output_at_pp2(models):
    """Block moves ride the step message and each stage moves its own layers' KV; a shared prefix is reused;
    a JSON-schema constraint is applied by rank 0 to the logits the last stage returns."""
    prompts = [list(range(10, 30)) + list(range(40 + i, 50 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)
    small = dict(num_gpu_blocks_override=24, preemption_mode="swap", swap_space=1 << 20)
    ref, _ = _generate(models["llama3"], 1, prompts, params, **small)
    got, preempted = _generate(models["llama3"], 2, prompts, params, **small)
    assert preempted > 0
    _assert_same(ref, got)
    from llmrt.structured.spec import StructuredOutputs

    regex = "[a-c]{3}-[0-9]{2}"
    constrained = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredOutputs(regex=regex))
    ref, _ = _generate(models["llama3"], 1, PROMPTS[:2], constrained)
    got, _ = _generate(models["llama3"], 2, PROMPTS[:2], constrained)
    import re

    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert re.fullmatch(regex, b.outputs[0].text), b.outputs[0].text


@pytest.mark.slow
def test_ngram_speculation_at_pp2_keeps_greedy_outputs(models):
    """Proposals are verified on rank 0 from the extra logits rows the last stage sends back."""
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8], list(range(30, 50)) * 2]
    spec = dict(speculative_method="ngram", num_speculative_tokens=3)
    ref, _ = _generate(models["llama3"], 1, prompts)
    got, _ = _generate(models["llama3"], 2, prompts, **spec)
    _assert_same(ref, got)


@pytest.mark.slow
def test_tp2_by_pp2_matches_one_rank(models, monkeypatch):
    """Four ranks: two stages of two tensor-parallel ranks each (this 2-core machine runs them oversubscribed)."""
    import llmrt.executor.distributed as dist_exec

    monkeypatch.setattr(dist_exec, "usable_cores", lambda: 4)
    ref, _ = _generate(models["qwen2"], 1)
    got, _ = _generate(models["qwen2"], 2, tp=2)
    _assert_same(ref, got)


@pytest.mark.slow
def test_pp2_over_a_local_ray_cluster_matches_one_rank(models):
    from tests.ray_utils import local_ray_cluster

    with local_ray_cluster("llmrt-pp"):
        ref, _ = _generate(models["gpt2"], 1)
        got, _ = _generate(models["gpt2"], 2, distributed_executor_backend="ray")
        _assert_same(ref, got)


def test_stage_counts_that_do_not_split_the_layers_are_refused(models):
    with pytest.raises(UnsupportedError, match=r"pipeline-parallel-size 3 does not split.*2 decoder layers.*"
                                               r"valid sizes: 1, 2"):
        EngineConfig.create(str(models["llama3"]), pipeline_parallel_size=3)
    with pytest.raises(UnsupportedError, match="draft model is not split into pipeline stages"):
        EngineConfig.create(str(models["llama3"]), pipeline_parallel_size=2, speculative_method="draft",
                            speculative_model=str(models["llama3"]))


def test_micro_batches_cut_by_sequences_and_keep_every_logits_row():
    # two decodes, then a 6-token prefill chunk and a 3-token prompt; rows: samples, then prompt-logprob rows
    inp = StepInput(list(range(11)), [[0], [1], [2], [3]], [1, 1, 6, 3], [5, 9, 6, 3], 2,
                    [0, 1, 10, 2, 3])
    assert num_micro_batches(0, 2, 4) == 2 and num_micro_batches(0, 4, 3) == 3 and num_micro_batches(5, 2, 9) == 5
    mbs = split_micro_batches(inp, 2)
    assert [m.inp.query_lens for m in mbs] == [[1, 1, 6], [3]]  # balanced by tokens, a prefill chunk kept whole
    assert [m.inp.num_decodes for m in mbs] == [2, 0]
    assert mbs[1].inp.input_ids == [8, 9, 10] and mbs[1].inp.logits_rows == [2] and mbs[1].row_slots == [2]
    assert sorted(s for m in mbs for s in m.row_slots) == list(range(5))
    assert [m.inp.query_lens for m in split_micro_batches(inp, 4)] == [[1], [1], [6], [3]]
    for m in split_micro_batches(inp, 3):
        for local, slot in zip(m.inp.logits_rows, m.row_slots):
            assert m.inp.input_ids[local] == inp.input_ids[inp.logits_rows[slot]]


def test_plan_counts_the_heaviest_stage_and_one_stage_of_kv(models, capsys):
    """`llmrt plan --pp 2` builds each stage as the engine does; its weights are the heavier stage's (the one
    with the tied head's own table) and KV per token counts one stage's layers."""
    from llmrt.cli import main

    assert main(["plan", str(models["llama3"]), "--memory", "1GiB", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["plan", str(models["llama3"]), "--memory", "1GiB", "--pp", "2", "--json"]) == 0
    two = json.loads(capsys.readouterr().out)
    hf = json.loads((models["llama3"] / "config.json").read_text())
    h, v = hf["hidden_size"], hf["vocab_size"]
    from llmrt.kernels import kernels
    from llmrt.kernels.packed import packed_bytes

    packed = kernels() is not None  # the CPU kernels hold the head packed: on one stage a copy beside the embedding
    head = packed_bytes("fp32", v, h) if packed else v * h * 4
    layer = (one["weights_bytes"] - v * h * 4 - (head if packed else 0) - h * 4) // 2
    # layer 1, final norm, the head's own table (and its dense copy where packed layers keep one)
    assert two["weights_bytes"] == layer + h * 4 + head + (v * h * 4 if two["dense_copy_bytes"] else 0)
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 2
    assert two["communication"][0]["pp_seconds"] > 0 and two["communication"][0]["bubble_share"] == 0.5
    assert main(["plan", str(models["llama3"]), "--memory", "1GiB", "--pp", "3"]) == 2
    assert "valid sizes: 1, 2" in capsys.readouterr().err
