"""Tensor parallelism through the offline API: TP=2 (two processes, gloo) against TP=1 on the same weights."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time

import pytest
import torch

from llmrt import LLM
from llmrt.config import EngineConfig, ParallelConfig
from llmrt.engine_args import add_engine_arguments
from llmrt.errors import EngineDeadError, InvalidRequestError, UnsupportedError
from llmrt.executor import EXECUTORS
from llmrt.sampling_params import SamplingParams
from tests.conftest import build_checkpoint

# Each architecture's TP-relevant twist: GQA + tied embeddings + llama3 rope; sliding window; QKV biases + tied
# embeddings + one KV head for two ranks (replicated); q/k norms; GPT-2's fused Conv1D c_attn + tied head.
CASES = {"llama3": {}, "mistral": {}, "qwen2": {"num_key_value_heads": 1}, "qwen3": {}, "gpt2": {}}
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(20, 61))]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2)
OPTS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, block_size=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {name: build_checkpoint(name, root / name, **over) for name, over in CASES.items()}


def _generate(model, tp: int, prompts=PROMPTS, params=GREEDY, **kw):
    llm = LLM(str(model), tensor_parallel_size=tp, **{**OPTS, **kw})
    try:
        return llm.generate(prompts, params), llm.engine.scheduler.num_preemptions_total
    finally:
        llm.shutdown()


def _assert_same(ref, got, tol: float = 1e-4) -> None:
    for a, b in zip(ref, got):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t] - lb[t]) < tol, (t, la[t], lb[t])


@pytest.mark.slow
@pytest.mark.parametrize("split", ["tp", "pp"])
@pytest.mark.parametrize("arch", list(CASES))
def test_two_ranks_give_one_ranks_greedy_tokens_and_logprobs(arch, split, models):
    """TP=2 or PP=2 (two stages) against one rank, for every architecture."""
    ref, _ = _generate(models[arch], 1)
    got, _ = _generate(models[arch], 2) if split == "tp" else _generate(models[arch], 1, pipeline_parallel_size=2)
    _assert_same(ref, got)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama3", "gpt2"])
def test_shared_memory_and_gloo_collectives_give_the_same_outputs(arch, models):
    """Same-host CPU ranks pick the shared-memory all-reduce by themselves; forcing gloo gives the same tokens
    and logprobs (and both match one rank)."""
    ref, _ = _generate(models[arch], 1)
    runs = {}
    for mode in ("auto", "gloo"):
        llm = LLM(str(models[arch]), tensor_parallel_size=2, cpu_all_reduce=mode, **OPTS)
        try:
            runs[llm.engine.executor.comm.transport] = llm.generate(PROMPTS, GREEDY)
        finally:
            llm.shutdown()
    assert set(runs) == {"shm", "gloo"}
    _assert_same(ref, runs["shm"])
    _assert_same(ref, runs["gloo"])
    _assert_same(runs["gloo"], runs["shm"])


@pytest.mark.slow
def test_each_rank_holds_half_the_split_parameters(models):
    """Measured per-rank parameter bytes: half of everything split, plus the replicated norms (and, for Qwen2
    with one KV head, the replicated K/V projections)."""
    for arch in ("llama3", "qwen2"):
        one = LLM(str(models[arch]), **OPTS)
        total = one.engine.executor.worker.model_runner.weights_bytes()
        model = one.engine.executor.worker.model_runner.model
        replicated = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n)
        if arch == "qwen2":  # k and v rows (and biases) of the fused qkv_proj: one KV head on both ranks
            a = model.arch
            kv_rows = 2 * a.kv_heads * a.head_dim
            replicated += sum(kv_rows * (a.hidden + 1) * 4 for _ in range(a.layers))
            if any(getattr(m, "keep_dense", False) for m in model.modules()):  # and their dense copy beside
                replicated += sum(kv_rows * a.hidden * 4 for _ in range(a.layers))
        two = LLM(str(models[arch]), tensor_parallel_size=2, **OPTS)
        try:
            per_rank = two.engine.executor.rank_parameter_bytes()
        finally:
            two.shutdown()
        assert per_rank == [(total - replicated) // 2 + replicated] * 2, (arch, per_rank, total, replicated)


@pytest.mark.slow
def test_swap_preemption_and_int8_at_tp2(models):
    """Preempted sequences' KV swaps out and back on both ranks (block moves ride the step message); int8
    weights quantize each rank's shard after loading."""
    prompts = [list(range(10 + i, 40 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0)
    small = dict(num_gpu_blocks_override=24, preemption_mode="swap", swap_space=1 << 20)
    ref, _ = _generate(models["llama3"], 1, prompts, params, **small)
    got, preempted = _generate(models["llama3"], 2, prompts, params, **small)
    assert preempted > 0
    _assert_same(ref, got)
    # int8 at TP=2, teacher-forced (prompt logprobs, so a greedy near-tie cannot send the runs apart): row-parallel
    # shards quantize their own input columns, so scales differ from one rank's; the error against the
    # unquantized model must stay of the size of one rank's int8 error (a wrong shard or scale is far larger).
    forced = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    runs = {(tp, q): _prompt_logprobs(_generate(models["llama3"], tp, PROMPTS, forced, quantization=q)[0])
            for tp, q in ((1, None), (1, "int8"), (2, "int8"))}
    one_rank = _max_diff(runs[(1, None)], runs[(1, "int8")])
    two_ranks = _max_diff(runs[(1, None)], runs[(2, "int8")])
    assert 0 < one_rank and two_ranks < 2 * one_rank, (one_rank, two_ranks)


def _prompt_logprobs(outs) -> list[list[float]]:
    return [[lp[t] for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])] for o in outs]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_sizes_that_do_not_split_are_refused_with_the_valid_ones(models):
    with pytest.raises(UnsupportedError, match=r"4 attention heads, 2 KV heads.*valid sizes: 1, 2, 4"):
        EngineConfig.create(str(models["llama3"]), tensor_parallel_size=3)
    with pytest.raises(UnsupportedError, match="draft model"):
        EngineConfig.create(str(models["llama3"]), tensor_parallel_size=2, speculative_method="draft",
                            speculative_model=str(models["llama3"]))


def test_pre_quantized_checkpoints_are_refused_at_tp2(models, tmp_path):
    """GPTQ/AWQ loaders place whole 4-bit rows: a split is refused at configuration time, naming what works."""
    import json
    import shutil

    gptq = tmp_path / "gptq"
    shutil.copytree(models["llama3"], gptq)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                  "sym": True}
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="pre-quantized 4-bit checkpoints"):
        EngineConfig.create(str(gptq), tensor_parallel_size=2)
    EngineConfig.create(str(gptq), tensor_parallel_size=1)  # one rank takes it


def test_more_ranks_than_cores_is_refused(models, monkeypatch):
    import llmrt.executor.distributed as dist_exec

    monkeypatch.setattr(dist_exec, "usable_cores", lambda: 1)
    with pytest.raises(UnsupportedError, match="2 CPU ranks need at least 2 CPU cores.*may use 1"):
        LLM(str(models["llama3"]), tensor_parallel_size=2, **OPTS)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "hang"])
@pytest.mark.parametrize("split", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_dead_or_hung_rank_is_engine_dead_within_the_timeout(fault, split, models):
    """A TP rank or a pipeline stage (rank 1 either way) killed or stopped: engine_dead within the timeout."""
    llm = LLM(str(models["llama3"]), **{split: 2}, distributed_timeout=3.0, **OPTS)
    (pid,) = llm.engine.executor.worker_pids
    try:
        llm.generate(PROMPTS[:1], GREEDY)
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        assert time.monotonic() - start < 3.0 + 10.0
    finally:
        with contextlib.suppress(ProcessLookupError):  # already reaped after the kill
            os.kill(pid, signal.SIGKILL)
        llm.shutdown()


def test_a_rank_reads_only_its_slices_of_the_checkpoint(models):
    """Rank 1 of 2 loads a GPT-2 Conv1D c_attn ([in, out] on disk) and a row-parallel projection: every read
    from the memory-mapped file is its slice, never the whole tensor."""
    from safetensors import safe_open

    from llmrt.distributed.parallel_state import building_shard
    from llmrt.model.layers.linear import Linear
    from llmrt.model.layers.weights import CheckpointTensor

    reads = []
    with safe_open(str(models["gpt2"] / "model.safetensors"), framework="pt") as f:
        def lazy(name):
            part = f.get_slice(name)
            return CheckpointTensor(tuple(part.get_shape()),
                                    lambda index: reads.append((name, index)) or part[index])

        with building_shard(1, 2):
            c_attn = Linear(64, [64, 64, 64], True, parallel="column", shards=None)
            proj = Linear(64, [64], True, parallel="row")
        c_attn.weight_loader(c_attn.weight, lazy("transformer.h.0.attn.c_attn.weight").t())
        proj.weight_loader(proj.weight, lazy("transformer.h.0.attn.c_proj.weight").t())
        whole = f.get_tensor("transformer.h.0.attn.c_attn.weight").t()
        row_whole = f.get_tensor("transformer.h.0.attn.c_proj.weight").t()
    assert torch.equal(c_attn.weight.data[:32], whole[32:64])  # q rows of heads 2-3
    assert torch.equal(c_attn.weight.data[64:], whole[160:192])  # v rows of heads 2-3
    assert torch.equal(proj.weight.data, row_whole[:, 32:])
    assert len(reads) == 4  # q, k, v of c_attn and the columns of c_proj: one sliced read each
    assert all(any(s != slice(None) for s in idx) for _, idx in reads)  # no read took the whole tensor


@pytest.mark.slow
def test_tp2_over_a_local_ray_cluster_matches_tp1(models, tmp_path_factory):
    from tests.ray_utils import local_ray_cluster

    with local_ray_cluster("llmrt-tp"):
        ref, _ = _generate(models["qwen2"], 1)
        got, _ = _generate(models["qwen2"], 2, distributed_executor_backend="ray")
        _assert_same(ref, got)


def test_plan_counts_rank_bytes_and_estimates_communication(models, capsys):
    """`llmrt plan --tp 2`: rank 0's real shard on the meta device, and the documented communication formula."""
    from llmrt.cli import main
    from llmrt.distributed.comm_model import Device, Link, estimate_step
    from tests.conftest import ARCH_CONFIGS

    hf = {k: v for k, v in ARCH_CONFIGS["llama3"].items() if k != "model_type"}
    e = estimate_step(hf, tp=2, pp=1, link=Link(1e9, 1e-5), device=Device(1e12, 1e15), elem_bytes=4, params=1,
                      tokens=1, sampled_rows=1)
    # 2 layers x 2 + 1 all-reduces of one 64-float row, each 2 latencies + 256 B / link; a 256-logit gather
    assert e.tp_seconds == pytest.approx(5 * (2e-5 + 256 / 1e9) + (1e-5 + 1024 / 1e9))
    assert main(["plan", str(models["llama3"]), "--memory", "1GiB", "--tp", "2", "--json"]) == 0
    import json

    two = json.loads(capsys.readouterr().out)
    assert main(["plan", str(models["llama3"]), "--memory", "1GiB", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    norms = (2 * 2 + 1) * 64 * 4  # replicated RMSNorm weights (float32 per the config's dtype)
    assert two["weights_bytes"] == (one["weights_bytes"] - norms) // 2 + norms
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 2
    assert two["communication"][0]["tp_seconds"] > 0
    assert main(["plan", str(models["llama3"]), "--memory", "1GiB", "--tp", "3"]) == 2
    assert "valid sizes: 1, 2, 4" in capsys.readouterr().err


def test_collective_transport_and_executor_flags_are_checked():
    with pytest.raises(InvalidRequestError, match="cpu_all_reduce must be one of auto, shm, gloo"):
        ParallelConfig(tensor_parallel_size=2, cpu_all_reduce="tcp")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    backend = next(a for a in parser._actions if a.dest == "distributed_executor_backend")
    assert backend.choices == ["auto", *EXECUTORS]  # a registered executor is a valid flag value at once
