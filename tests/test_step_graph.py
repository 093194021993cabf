"""Step graphs (llmrt/worker/step_graph.py): a decode step recorded once per batch size and replayed from C++ gives
the eager forward's logits bitwise, and whatever a replay could not reproduce runs eagerly instead."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import ARCH_CONFIGS
from llmrt import LLM, SamplingParams
from llmrt.worker.step_graph import NotReplayable, StepGraph, StepGraphs, _Recorder, extension



def _runner(llm: LLM):
    return llm.engine.executor.worker.model_runner


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 40))] for _ in range(n)]


def _generate(llm: LLM, prompts: list[list[int]], **kw) -> list[list[int]]:
    # Different lengths, so the decode batch shrinks as sequences finish: several batch sizes get graphs.
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True, **kw) for i in range(len(prompts))]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", sorted(ARCH_CONFIGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replayed_steps_give_the_eager_tokens(checkpoints, arch, dtype):
    prompts = _prompts(4, 1)
    eager = LLM(str(checkpoints[arch]), dtype=dtype, block_size=4, max_num_seqs=8, enforce_eager=True)
    assert _runner(eager).step_graphs is None
    expected = _generate(eager, prompts)
    llm = LLM(str(checkpoints[arch]), dtype=dtype, block_size=4, max_num_seqs=8)
    graphs = _runner(llm).step_graphs
    assert _generate(llm, prompts) == expected
    assert graphs.recorded == 4 and graphs.replayed >= 8  # batch sizes 4, 3, 2, 1: each recorded, checked, replayed
    assert not graphs._eager_only


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_layers_replay(checkpoints, quantization):
    prompts = _prompts(3, 2)
    kw = dict(dtype="float32", block_size=4, max_num_seqs=8, quantization=quantization, quant_group_size=32)
    expected = _generate(LLM(str(checkpoints["llama2"]), enforce_eager=True, **kw), prompts)
    llm = LLM(str(checkpoints["llama2"]), **kw)
    assert _generate(llm, prompts) == expected
    assert _runner(llm).step_graphs.replayed > 0


def test_sampled_tokens_unchanged(checkpoints):
    # The sampler stays outside the graph: seeded sampling draws the same tokens from the same logits.
    prompts = _prompts(3, 3)
    kw = dict(dtype="float32", block_size=4, max_num_seqs=8)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(checkpoints["qwen2"]), enforce_eager=True, **kw)
                .generate(prompts, params)]
    llm = LLM(str(checkpoints["qwen2"]), **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert _runner(llm).step_graphs.replayed > 0


def test_int8_kv_cache_runs_eagerly(checkpoints):
    # The torch backend's decode sizes its gathers from the metadata's Python lengths: never recorded.
    llm = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4, kv_cache_dtype="int8")
    _generate(llm, _prompts(2, 4))
    graphs = _runner(llm).step_graphs
    assert graphs.recorded == 0 and graphs.replayed == 0


def test_backends_that_cannot_replay_build_no_graphs(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4, attention_backend="torch")
    assert _runner(llm).step_graphs is None
    _generate(llm, _prompts(2, 6))


def test_rebinding_the_kv_cache_forgets_the_graphs(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=4)
    _generate(llm, _prompts(2, 5))
    runner = _runner(llm)
    assert runner.step_graphs._graphs
    runner.bind_kv_cache([(layer.k_cache, layer.v_cache) for layer in runner.model.attention_layers()])
    assert not runner.step_graphs._graphs


# -- the recorder and the interpreter on their own ----------------------------------------------------------


def _record(fn, *inputs):
    with _Recorder() as rec:
        out = fn(*inputs)
    return rec.calls, out


def test_views_lists_and_in_place_ops_replay():
    w = torch.randn(8, 6)

    def fn(x, y):
        a, b = torch.split(x @ w.T, [3, 5], dim=1)  # a list return
        c = torch.cat([b, a * 2], dim=1)  # a Tensor[] argument of references
        c.add_(y)  # in place on an intermediate
        return torch.nn.functional.silu(c.view(-1))

    x, y = torch.randn(2, 6), torch.randn(2, 8)
    calls, out = _record(fn, x, y)
    g = StepGraph(extension(), calls, [x, y], [out], {w.untyped_storage().data_ptr()})
    x2, y2 = torch.randn(2, 6), torch.randn(2, 8)
    assert torch.equal(g.run([x2, y2])[0], fn(x2, y2))


def test_what_cannot_be_replayed_is_refused():
    x = torch.randn(4)
    calls, out = _record(lambda x: x * float(x.sum()), x)  # .item(): a Python value the forward used
    with pytest.raises(NotReplayable, match="_local_scalar_dense"):
        StepGraph(extension(), calls, [x], [out], set())
    temp = torch.randn(4)  # a tensor the caller did not name as a constant
    calls, out = _record(lambda x: x + temp, x)
    with pytest.raises(NotReplayable, match="made outside"):
        StepGraph(extension(), calls, [x], [out], set())
    StepGraph(extension(), calls, [x], [out], {temp.untyped_storage().data_ptr()})  # named: fine


def test_a_replay_that_differs_from_eager_falls_back():
    scale = [1.0]
    x = torch.randn(3)
    graphs = StepGraphs(extension(), lambda: [])
    eager = lambda: x * scale[0]  # noqa: E731 - a Python value a recording freezes
    graphs.run(1, [x], eager)  # recorded
    scale[0] = 2.0
    assert torch.equal(graphs.run(1, [x], eager), x * 2)  # the check catches it and returns eager's result
    assert 1 in graphs._eager_only and graphs.recorded == 1
    assert torch.equal(graphs.run(1, [x], eager), x * 2)


def test_op_timing_counts_every_replayed_op():
    """set_timing: per op, wall time summed over the replays since it was turned on; graphs recorded later time
    too; off, nothing more is added."""
    w = torch.randn(256, 256)
    x = torch.randn(4, 256)
    graphs = StepGraphs(extension(), lambda: [w])
    eager = lambda: torch.relu(x @ w).sum(0)  # noqa: E731
    graphs.run(1, [x], eager)  # recorded
    graphs.run(1, [x], eager)  # the checked first replay
    graphs.set_timing(True)
    for _ in range(3):
        graphs.run(1, [x], eager)
    ops, runs = graphs.timings()[1]
    assert runs == 3
    assert [label.split("(")[0] for label, _ in ops] == ["aten::mm", "aten::relu", "aten::sum"]
    assert ops[0][0] == "aten::mm(4x256, 256x256)"
    assert all(ms > 0 for _, ms in ops)
    y = torch.randn(2, 256)
    graphs.run(2, [y], lambda: torch.relu(y @ w).sum(0))  # recorded while timing is on
    graphs.run(2, [y], lambda: torch.relu(y @ w).sum(0))
    assert graphs.timings()[2][1] == 1
    graphs.set_timing(False)
    before = graphs.timings()[1]
    assert before[1] == 3 and before[0][0][1] > 0  # kept after turning it off
    graphs.run(1, [x], eager)
    assert graphs.timings()[1] == before
    graphs.set_timing(True)  # a new sum
    assert graphs.timings()[1][1] == 0
