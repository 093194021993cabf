"""The fp8 (e4m3) KV cache: rows of [values | float32 scale] per token and head, like int8's, converted in
software where the device has no fp8 instructions (this CPU)."""
from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from llmrt.attention.kv_quant import dequantize_kv, is_quantized, kv_storage, quantize_kv
from llmrt.bench.quality import quality_of, teacher_forced_logits
from llmrt.config import ModelConfig
from llmrt.engine.llm import LLM
from llmrt.engine.memory_plan import plan_memory
from llmrt.hardware import EMULATED, NATIVE, check_formats, format_support
from llmrt.sampling_params import SamplingParams
from tests.conftest import ARCH_CONFIGS

CPU = torch.device("cpu")


def test_rows_round_trip_within_e4m3_precision():
    torch.manual_seed(0)
    x = torch.randn(64, 4, 32) * torch.logspace(-3, 2, 64)[:, None, None]  # rows of very different sizes
    dtype, dim = kv_storage(32, torch.float32, "fp8")
    rows = quantize_kv(x, dtype)
    assert (rows.dtype, rows.shape, dim) == (torch.uint8, (64, 4, 36), 36) and is_quantized(rows)
    back = dequantize_kv(rows, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    # e4m3: 3 mantissa bits (relative error <= 2^-4); values under 2^-6 of the scale are subnormal (absolute
    # error <= 2^-10 of the scale, i.e. amax / 448 / 512)
    assert ((back - x).abs() <= x.abs() / 16 + amax / 448 / 512 * 1.01).all()
    # the stored bytes are torch's own e4m3 conversion of the scaled values, and the row maximum is exact
    scale = rows[..., 32:].contiguous().view(torch.float32)
    want = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(rows[..., :32], want)
    assert torch.allclose(back.abs().amax(-1, keepdim=True), amax, rtol=1e-6)
    int8_rows = quantize_kv(x, torch.int8)  # the other 8-bit format is still int8, and more precise
    err8 = (dequantize_kv(int8_rows, torch.float32) - x).abs().mean()
    assert err8 < (back - x).abs().mean()


def test_capability_table_and_warning(caplog):
    assert format_support(CPU, "kv:fp8", frozenset({"avx2"})).status == EMULATED
    cuda = torch.device("cuda")
    assert format_support(cuda, "kv:fp8", capability=(9, 0)).status == NATIVE
    assert format_support(cuda, "kv:fp8", capability=(8, 0)).status == EMULATED
    with caplog.at_level(logging.WARNING):
        check_formats(CPU, torch.float32, None, "fp8", flags=frozenset({"avx2"}))
    assert any("kv:fp8" in r.message and "int8" in r.message for r in caplog.records)


@pytest.mark.parametrize("arch", list(ARCH_CONFIGS))
def test_fp8_kv_tracks_the_unquantized_model(arch, checkpoints):
    rng = random.Random(3)
    tokens = [rng.randrange(4, 500) for _ in range(40)]
    ref, _ = teacher_forced_logits(ModelConfig(str(checkpoints[arch]), dtype="float32"), tokens)
    fp8 = quality_of(str(checkpoints[arch]), tokens, None, kv_cache_dtype="fp8", ref=ref)
    int8 = quality_of(str(checkpoints[arch]), tokens, None, kv_cache_dtype="int8", ref=ref)
    # Bounds: measured on these random 2-layer models (which amplify noise: see test_quantization's BOUNDS),
    # fp8 agreement 0.825-0.95, error 9.5-26%, mean KL 0.008-0.027; int8 0.875-1.0, 1.9-5.8%, KL under 0.001.
    # fp8's 3 mantissa bits (relative error up to 1/16 per value) are a coarser grid than int8's 127 levels
    # per row, so fp8 is the worse 8-bit format wherever both are only storage (as here).
    assert fp8.top1_agreement >= 0.75 and fp8.rel_logit_error <= 0.35, (arch, fp8)
    assert int8.rel_logit_error < fp8.rel_logit_error and int8.mean_kl < fp8.mean_kl, (arch, int8, fp8)


def test_fp8_kv_doubles_the_tokens_and_keeps_the_story(embedded_model_dir):
    base = LLM(dtype="bfloat16", kv_cache_memory=1 << 20)
    q = LLM(dtype="bfloat16", kv_cache_memory=1 << 20, kv_cache_dtype="fp8")
    # stories260K has head_dim 8: per token and head 16 B of bf16 vs 8 + 4 B of fp8 + scale.
    assert q.engine.memory.kv_bytes_per_token * 16 == base.engine.memory.kv_bytes_per_token * 12
    assert q.engine.memory.num_blocks > base.engine.memory.num_blocks * 1.3
    assert "fp8 + float32 scale" in q.engine.memory.describe()
    params = SamplingParams(max_tokens=24, temperature=0)
    a = base.generate(["Once upon a time"], params)[0].outputs[0].token_ids
    b = q.generate(["Once upon a time"], params)[0].outputs[0].token_ids
    assert a[:16] == b[:16]


def test_plan_and_engine_agree_on_fp8_kv(checkpoints, embedded_model_dir):
    hf = json.loads((checkpoints["llama3"] / "config.json").read_text())
    hf["head_dim"] = 64
    full = plan_memory(hf, memory_bytes=64 << 20, dtype=torch.bfloat16)
    kv8 = plan_memory(hf, memory_bytes=64 << 20, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    assert kv8.kv_bytes_per_token * 128 == full.kv_bytes_per_token * 68
    assert kv8.max_concurrent_sequences(256) >= 1.8 * full.max_concurrent_sequences(256)
    llm = LLM(kv_cache_memory=1 << 20, kv_cache_dtype="fp8")
    plan = plan_memory(ModelConfig(str(embedded_model_dir)).hf_config, memory_bytes=1 << 30, dtype=torch.float32,
                       kv_cache_dtype="fp8")
    assert plan.kv_bytes_per_token == llm.engine.memory.kv_bytes_per_token
