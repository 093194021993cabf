"""Benchmark inputs from a checkpoint: its config, the non-special vocabulary, seeded random prompts, parameter count."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from llmrt.bench.report import log


def model_config(model_dir: str) -> dict[str, Any]:
    """The checkpoint's config.json."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def special_token_ids(model_dir: str, cfg: dict[str, Any]) -> set[int]:
    """bos/eos/pad ids from the config plus every special token the tokenizer declares."""
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = cfg.get(key)
        ids.update(v if isinstance(v, list) else [v] if isinstance(v, int) else [])
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        ids.update(tok.all_special_ids)
        ids.update(i for i, t in tok.added_tokens_decoder.items() if getattr(t, "special", False))
    except Exception as exc:  # a tokenizer HF cannot load: the config's ids are still excluded
        log(f"tokenizer not loadable by transformers ({type(exc).__name__}); excluding config special ids only")
    return ids


def vocab_pool(model_dir: str) -> torch.Tensor:
    """The token ids prompts are drawn from: [0, vocab_size) minus the special tokens."""
    cfg = model_config(model_dir)
    special = special_token_ids(model_dir, cfg)
    pool = torch.tensor([i for i in range(int(cfg["vocab_size"])) if i not in special], dtype=torch.long)
    if pool.numel() == 0:
        raise SystemExit("bench: the vocabulary has no non-special tokens")
    return pool


def make_prompts(pool: torch.Tensor, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n prompts of random ids from pool, lengths uniform in [lo, hi], reproducible from seed."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [pool[torch.randint(0, pool.numel(), (k,), generator=g)].tolist() for k in lens]


def count_params(model_dir: str) -> int:
    """Every tensor element stored in the checkpoint's *.safetensors files (nothing excluded)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"bench: no *.safetensors in {model_dir}")
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= int(d)
                total += n
    return total
