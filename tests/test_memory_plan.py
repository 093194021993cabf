"""`llmrt plan` against what the engine measures and allocates, and the start-up breakdown."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from llmrt import LLM
from llmrt.cli import main
from llmrt.engine.memory_plan import MemoryPlan, plan_memory
from llmrt.hardware import kernel_isa

_MiB = 1 << 20


def _within(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b))


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "gpt2"])
def test_plan_matches_the_engine_within_five_percent(checkpoints, arch, caplog):
    with caplog.at_level(logging.INFO, logger="llmrt.worker.worker"):
        llm = LLM(str(checkpoints[arch]), dtype="float32", block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
                  kv_cache_memory=8 * _MiB)
    engine: MemoryPlan = llm.engine.memory
    assert "max concurrent sequences by context" in caplog.text
    hf = json.loads((checkpoints[arch] / "config.json").read_text())
    # The device `plan` is asked about is exactly as large as what the engine allocated in all.
    runner = llm.engine.executor.worker.model_runner
    # The engine decided the dense weight copy against the machine's RAM, this plan's device is far smaller.
    dense = "on" if any(getattr(m, "keep_dense", False) for m in runner.model.modules()) else "off"
    plan = plan_memory(hf, memory_bytes=engine.total_bytes, dtype=torch.float32, block_size=4,
                       max_num_batched_tokens=64, max_num_seqs=16, max_model_len=llm.config.model.max_model_len,
                       fused=runner.fused_layers, dense_weight_copy=dense)
    assert plan.weights_bytes == engine.weights_bytes  # counted on the same model classes, built on meta
    assert plan.kv_bytes_per_token == engine.kv_bytes_per_token
    # On CPU the engine reports the estimate (no start-up forward pass); the estimate must hold against a
    # forward pass of the largest step, measured here.
    worker = llm.engine.executor.worker
    runner = worker.model_runner
    measured = runner.profile_activation_peak(lambda n: worker._allocate(n, runner))
    runner.bind_kv_cache(worker.kv_caches)
    assert engine.activation_peak_bytes == runner.estimate_activation_peak()
    assert _within(plan.activation_peak_bytes, measured, 0.10), (plan.activation_peak_bytes, measured)
    assert _within(plan.num_blocks, engine.num_blocks, 0.05), (plan.num_blocks, engine.num_blocks)
    assert _within(plan.total_bytes, engine.total_bytes, 0.05)
    assert plan.max_concurrent_sequences(256) == pytest.approx(engine.max_concurrent_sequences(256), rel=0.05)


def test_plan_cli_table_json_and_verdicts(checkpoints, capsys):
    model = str(checkpoints["llama3"])
    assert main(["plan", model, "--memory", "64MiB", "--dtype", "float32", "--context", "128,256,1024"]) == 0
    text = capsys.readouterr().out
    assert "weights" in text and "KV cache" in text and "max concurrent sequences" in text
    assert "1024 tokens: beyond the model's context of 256" in text
    assert main(["plan", str(checkpoints["llama3"] / "config.json"), "--memory", "64MiB", "--dtype", "float32",
                 "--json", "--tp", "2", "--kv-dtype", "bfloat16"]) == 0
    data = json.loads(capsys.readouterr().out)
    # tp=2 halves the per-rank weights and KV heads (2 KV heads -> 1); bf16 halves the bytes per element.
    assert data["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 2
    assert data["num_blocks"] * data["block_size"] * data["kv_bytes_per_token"] == data["kv_cache_bytes"]
    assert data["tp"] == 2 and data["kv_dtype"] == "bfloat16"


def test_plan_says_when_nothing_fits(checkpoints, capsys):
    assert main(["plan", str(checkpoints["gpt2"]), "--memory", "100KiB"]) == 0
    assert "does not fit" in capsys.readouterr().out
    assert main(["plan", str(checkpoints["gpt2"]), "--memory", "1GiB", "--context", "a,b"]) == 2


@pytest.mark.skipif(kernel_isa() is None, reason="this CPU has no AVX2+FMA: nothing is packed")
def test_plan_counts_the_dense_weight_copy(checkpoints):
    """--dense-weight-copy on adds each packed fp32/bf16 layer's dense weights to the planned weights, as the
    engine holds them; auto decides against the device size given."""
    from llmrt.kernels import kernels
    from llmrt.model.layers.linear import dense_copy_layers
    from llmrt.model.loader import build_model

    assert kernels() is not None  # a compiler and AVX2+FMA are here: a build failure must fail this test
    hf = json.loads((checkpoints["llama3"] / "config.json").read_text())
    plans = {s: plan_memory(hf, memory_bytes=1 << 34, dtype=torch.float32, dense_weight_copy=s)
             for s in ("on", "off", "auto")}
    model = build_model(hf, hf["architectures"][0], torch.float32, torch.float32, "meta")
    extra = dense_copy_layers(model)[1]
    assert extra > 0 and plans["on"].weights_bytes - plans["off"].weights_bytes == extra
    assert plans["on"].dense_copy_bytes == extra and plans["off"].dense_copy_bytes == 0
    assert plans["auto"].weights_bytes == plans["on"].weights_bytes  # a tiny model in 16 GiB keeps them
    small = plan_memory(hf, memory_bytes=extra * 4, dtype=torch.float32, dense_weight_copy="auto")
    assert small.weights_bytes == plans["off"].weights_bytes


def test_kv_budget_takes_no_more_than_is_free():
    """The share the utilization allows, less other processes' use; capped by what is free now (another engine of
    the process holding its own share), less the activations and a margin for the allocator."""
    from llmrt.engine.memory_plan import FREE_MARGIN, kv_budget_bytes

    gib = 1 << 30
    share = kv_budget_bytes(100 * gib, 0.5, 2 * gib, gib, used_elsewhere=gib)
    assert share == 46 * gib
    assert kv_budget_bytes(100 * gib, 0.5, 2 * gib, gib, gib, free=90 * gib) == share  # room: the share
    capped = kv_budget_bytes(100 * gib, 0.5, 2 * gib, gib, gib, free=40 * gib)  # a live engine holds 50 GiB
    assert capped == int(40 * gib * (1 - FREE_MARGIN)) - gib < share
