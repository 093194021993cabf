"""Every architecture against HF transformers on the same random weights: logits and greedy tokens."""
from __future__ import annotations

import random

import pytest
import torch


from llmrt.config import ModelConfig
from llmrt.attention import build_common_metadata, select_attention_backend
from llmrt.model.loader import load_model
from tests.conftest import ARCH_CONFIGS, DEVICES, on_device

ARCHS = list(ARCH_CONFIGS)


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def llmrt_logits(model_dir, prompt: list[int], block_size: int = 4, chunk: int = 5) -> torch.Tensor:
    """Logits at every prompt position, computed in chunks through the paged cache (chunked prefill path)."""
    model = load_model(ModelConfig(str(model_dir), dtype="float32"), torch.device("cpu"))
    spec = model.kv_cache_spec()
    backend = select_attention_backend("torch", torch.device("cpu"))
    blocks = -(-len(prompt) // block_size)
    for layer in model.attention_layers():
        layer.bind(torch.zeros(blocks, block_size, spec.num_kv_heads, spec.head_dim),
                   torch.zeros(blocks, block_size, spec.num_kv_heads, spec.head_dim), backend)
    table = torch.randperm(blocks).tolist()  # scattered blocks, as a busy cache would give
    out = []
    with torch.inference_mode():
        for start in range(0, len(prompt), chunk):
            ids = prompt[start:start + chunk]
            pos = torch.arange(start, start + len(ids))
            common = build_common_metadata([table], [len(ids)], [start + len(ids)], pos, 0, block_size,
                                           torch.device("cpu"))
            hidden = model(torch.tensor(ids), pos, backend.build_metadata(common))
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare full-length outputs
    return model.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf(arch, checkpoints):
    hf = hf_model(checkpoints[arch])
    for prompt in _prompts(4, seed=1, lo=5, hi=60):
        ours = llmrt_logits(checkpoints[arch], prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4, f"{arch}: max abs logit diff {diff}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_hf_generate(arch, device, checkpoints):
    """Chunked prefill over scattered blocks gives HF's greedy tokens exactly, HF running on the same device."""
    from llmrt import LLM, SamplingParams

    prompts = _prompts(8, seed=2, lo=2, hi=45)
    llm = LLM(str(checkpoints[arch]), dtype="float32", block_size=4, max_num_batched_tokens=24, max_num_seqs=8,
              **on_device(device))
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    hf = hf_model(checkpoints[arch]).to(device)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ids = torch.tensor([prompt], device=device)
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                              do_sample=False)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref, f"{arch}: prompt of {len(prompt)} tokens diverged"
        assert out.outputs[0].finish_reason == "length"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
