"""The Hugging Face `generate` baseline of `llmrt bench throughput`: static left-padded batches, same ids and weights."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from llmrt.bench.report import log
from llmrt.bench.timing import DTYPES, rates, sync

if TYPE_CHECKING:
    from llmrt.bench.throughput import Workload


def load_hf(model_dir: str, dtype: str, device: str) -> Any:
    """The same checkpoint through transformers, in eval mode on device."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype])
    return model.to(device).eval()


def pad_id(model: Any) -> int:
    """The pad id for left padding: the config's pad, else its (first) eos, else 0."""
    cfg = model.config
    for v in (cfg.pad_token_id, cfg.eos_token_id):
        if isinstance(v, list) and v:
            return int(v[0])
        if isinstance(v, int):
            return v
    return 0


def left_pad(batch: list[list[int]], pad: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask with every prompt right-aligned."""
    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def hf_generate(model: Any, batch: list[list[int]], new_tokens: int, temperature: float,
                device: str) -> tuple[float, int]:
    """(seconds, output tokens) for one HF generate of exactly new_tokens per prompt."""
    ids, mask = left_pad(batch, pad_id(model), device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=pad_id(model), **sampling)
    sync(device)
    return time.perf_counter() - t0, (out.shape[1] - ids.shape[1]) * len(batch)


def bench_hf_batch(model: Any, prompts: list[list[int]], bs: int, w: Workload, device: str) -> dict[str, Any]:
    """All prompts in order, in static batches of bs; rates over the summed generate time."""
    elapsed, n_out = 0.0, 0
    for i in range(0, len(prompts), bs):
        t, n = hf_generate(model, prompts[i:i + bs], w.output_len, w.temperature, device)
        elapsed, n_out = elapsed + t, n_out + n
    return {"batch_size": bs, **rates(elapsed, len(prompts), sum(map(len, prompts)), n_out)}


def bench_hf(model: Any, prompts: list[list[int]], sizes: list[int], w: Workload, device: str) -> dict[str, Any]:
    """One run per batch size; the best output tokens/s is the baseline."""
    runs = []
    for bs in sorted({min(bs, len(prompts)) for bs in sizes}):
        log(f"hf: {len(prompts)} prompts, batch size {bs}")
        runs.append(bench_hf_batch(model, prompts, bs, w, device))
    best = max(runs, key=lambda r: r["output_tokens_per_s"])
    return {**best, "best_batch_size": best["batch_size"], "runs": runs}


def single_hf(model: Any, prompt: list[int], w: Workload, device: str) -> dict[str, Any]:
    """Per-token decode time: (t(generate N) - t(generate 1)) / (N - 1), N = single_output_len."""
    n = w.single_output_len
    t1, _ = hf_generate(model, [prompt], 1, w.temperature, device)
    tn, _ = hf_generate(model, [prompt], n, w.temperature, device)
    return {"t_generate_1_s": t1, "t_generate_n_s": tn, "tpot_s": (tn - t1) / (n - 1) if n > 1 else None}
