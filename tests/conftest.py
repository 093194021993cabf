"""Shared fixtures: tiny random-weight HF checkpoints of every supported architecture."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

# Tests parametrized over DEVICES run on CUDA too where a GPU is (CI has none: the cuda cases skip there).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
needs_fp8 = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                               reason="fp8 matmuls need CUDA sm_89+")


def on_device(device: str) -> dict:
    """LLM options that put an engine on `device`; on CUDA a 5% share of the card, so several engines fit."""
    return {"device": device} if device == "cpu" else {"device": device, "gpu_memory_utilization": 0.05}


def repeating_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts with repeated stretches (so n-grams recur) of mixed lengths: speculative decoding's workload."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 512) for _ in range(rng.randint(3, 8))]
        out.append([rng.randrange(3, 512) for _ in range(rng.randint(1, 10))] + motif * rng.randint(2, 5))
    return out

EMBEDDED = Path(__file__).resolve().parents[1] / "llmrt" / "data" / "stories260K"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Tiny configs of real architectures. vocab 512 so the embedded model's tokenizer can ride along.
ARCH_CONFIGS: dict[str, dict] = {
    "llama3": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        rope_theta=500000.0,
    ),
    "llama2": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
        max_position_embeddings=256, tie_word_embeddings=False,
    ),
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=256, sliding_window=12, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
        max_position_embeddings=256, tie_word_embeddings=True,
    ),
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512,
        max_position_embeddings=256, tie_word_embeddings=False,
    ),
    "gpt2": dict(
        architectures=["GPT2LMHeadModel"], model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256,
        vocab_size=512,
    ),
}


def build_checkpoint(name: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight HF checkpoint of architecture `name` (plus the embedded tokenizer) to out_dir."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = {**ARCH_CONFIGS[name], **overrides}
    model_type = cfg_dict.pop("model_type")
    # A wider init than HF's 0.02 so random models have peaked next-token distributions: greedy comparisons
    # then test the engine rather than float rounding between near-tied logits.
    cfg_dict.setdefault("initializer_range", 0.25)
    config = AutoConfig.for_model(model_type, **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    for f in TOKENIZER_FILES:
        shutil.copy(EMBEDDED / f, out_dir / f)
    return out_dir


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny random checkpoint per architecture, built once per session."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: build_checkpoint(name, root / name) for name in ARCH_CONFIGS}


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The embedded stories260K checkpoint."""
    return EMBEDDED
