"""Checkpoint loading: sharded safetensors, dtypes, and clear errors for broken checkpoints."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmrt import LLM, SamplingParams
from llmrt.config import ModelConfig
from llmrt.errors import ModelLoadError
from llmrt.model.loader import load_model
from tests.conftest import EMBEDDED


def _copy(tmp_path):
    shutil.copytree(EMBEDDED, tmp_path / "m")
    return tmp_path / "m"


def test_sharded_checkpoint_loads_the_same(tmp_path):
    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / fname)
    (d / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    params = SamplingParams(max_tokens=20, temperature=0)
    assert LLM(str(d)).generate("Once upon a time", params)[0].outputs[0].token_ids == \
        LLM().generate("Once upon a time", params)[0].outputs[0].token_ids


def test_missing_tensor_is_named(tmp_path):
    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match="layers.3.mlp.gate_up_proj"):
        load_model(ModelConfig(str(d)), torch.device("cpu"))


def test_shape_mismatch_is_named(tmp_path):
    d = _copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"k_proj.*\(3, 64\).*\(32, 64\)"):
        load_model(ModelConfig(str(d)), torch.device("cpu"))


def test_no_weights_and_no_config(tmp_path):
    d = _copy(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(ModelConfig(str(d)), torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelConfig(str(tmp_path / "nowhere"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes(dtype):
    llm = LLM(dtype=dtype)
    assert llm.engine.executor.worker.model_runner.model.lm_head.dense_weight().dtype == getattr(torch, dtype)
    text = llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    assert text.startswith(", there was a little")


@pytest.mark.parametrize("native", [True, False])
def test_norm_weights_load_in_the_compute_dtype(native, monkeypatch):
    """bf16 weights on a CPU without bf16 arithmetic compute in float32: the norms' weights are loaded in float32 so
    the fused norm takes them (before, every norm fell back to ~10 torch ops); with bf16 arithmetic they stay bf16.
    `llmrt plan` counts the same bytes, and the greedy tokens are those of the norms' torch path."""
    from llmrt import hardware
    from llmrt.engine.memory_plan import plan_memory
    from llmrt.model.layers.fused import set_fused
    from llmrt.model.layers.norms import RMSNorm

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    llm = LLM(dtype="bfloat16")
    model = llm.engine.executor.worker.model_runner.model
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    want = torch.bfloat16 if native else torch.float32
    assert norms and all(m.weight.dtype == want for m in norms)
    plan = plan_memory(llm.engine.config.model.hf_config, memory_bytes=24 << 30, dtype=torch.bfloat16)
    assert plan.weights_bytes == llm.engine.memory.weights_bytes
    params = SamplingParams(max_tokens=24, temperature=0)
    fused = llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids
    set_fused(model, False)
    assert llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids == fused
