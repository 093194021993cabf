"""Random-weight Llama checkpoints for benchmarks and tests, cached on disk.

A random model measures speed only: its outputs are noise. Each directory is a complete Hugging Face
model dir (config.json, generation_config.json, model.safetensors, tokenizer files), so both
`llmrt.LLM(dir)` and `transformers.AutoModelForCausalLM.from_pretrained(dir)` load it.

The tokenizer is synthetic: a `tokenizers` WordLevel model whose vocabulary is exactly the model's
(`<unk>`=0, `<s>`=1, `</s>`=2, then `w3`, `w4`, ... `w{vocab-1}`), split on whitespace, with a post-processor
that prepends `<s>` like Llama's. It exists so the dir loads everywhere and every token id decodes; it is
not a real text tokenizer (ordinary words map to `<unk>`). Benchmarks feed token ids directly.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

UNK, BOS, EOS = "<unk>", "<s>", "</s>"

SIZES: dict[str, dict[str, Any]] = {
    "110m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000, max_position_embeddings=4096),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1000, max_position_embeddings=512),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_cache_dir() -> Path:
    """Where random models are cached: ~/.cache/llmrt/random-models."""
    return Path.home() / ".cache" / "llmrt" / "random-models"


def llama_config(size: str, dtype: str = "float32", max_positions: int | None = None) -> Any:
    """The LlamaConfig for a named size (see SIZES), optionally with a longer context (RoPE needs no
    position weights, so only the limit changes); initializer_range stays at its 0.02 default."""
    from transformers import LlamaConfig

    if size not in SIZES:
        raise ValueError(f"unknown random model size {size!r}; choose from {', '.join(SIZES)}")
    dims = dict(SIZES[size])
    if max_positions is not None:
        dims["max_position_embeddings"] = max_positions
    return LlamaConfig(**dims, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, dtype=dtype)


def build_tokenizer(vocab_size: int, model_max_length: int) -> Any:
    """A WordLevel PreTrainedTokenizerFast with exactly vocab_size ids (see the module docstring)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {UNK: 0, BOS: 1, EOS: 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                                   model_max_length=model_max_length, padding_side="left",
                                   clean_up_tokenization_spaces=False)


def is_complete(path: str | os.PathLike) -> bool:
    """Whether path already holds a finished random-model dir."""
    return all((Path(path) / name).is_file() for name in _REQUIRED)


def _portable_tokenizer_config(path: Path) -> None:
    """Name the class PreTrainedTokenizerFast, which transformers 4.x and 5.x both resolve."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def build_random_llama(size: str, out_dir: str, dtype: str = "float32", seed: int = 0,
                       max_positions: int | None = None) -> str:
    """Write a random-weight Llama of the given size (and its tokenizer) to out_dir; return out_dir."""
    from transformers import AutoModelForCausalLM

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}; got {dtype!r}")
    if is_complete(out_dir):
        return str(out_dir)
    cfg = llama_config(size, dtype, max_positions)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(_DTYPES[dtype])
    Path(out_dir).parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{Path(out_dir).name}-", dir=Path(out_dir).parent)
    try:
        model.save_pretrained(tmp)
        build_tokenizer(cfg.vocab_size, cfg.max_position_embeddings).save_pretrained(tmp)
        _portable_tokenizer_config(Path(tmp) / "tokenizer_config.json")
        if Path(out_dir).exists():  # an incomplete leftover from an interrupted build
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if Path(tmp).exists():
            shutil.rmtree(tmp)
    return str(out_dir)


def cached_random_llama(size: str, dtype: str = "float32", cache_dir: str | None = None, seed: int = 0,
                        max_positions: int | None = None) -> str:
    """Build once and reuse <cache_dir>/<size>-<dtype>[-ctx<max_positions>]; return its path."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    name = f"{size}-{dtype}" + (f"-ctx{max_positions}" if max_positions else "")
    return build_random_llama(size, str(root / name), dtype=dtype, seed=seed, max_positions=max_positions)
