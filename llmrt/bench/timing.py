"""Honest device timings for benchmarks: device sync, the matmul FLOP/s probe and its token-rate floor, run rates."""
from __future__ import annotations

import time
from typing import Any

import torch

from llmrt.hardware import compute_dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device: str) -> None:
    """Wait for queued device work, so wall-clock timings are honest."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_flops(m: int, k: int, n: int, dtype: torch.dtype, device: str, trials: int = 5) -> float:
    """Best-of-trials FLOP/s of an [m, k] x [k, n] matmul; each trial runs long enough to time (>= 50 ms)."""
    a = torch.randn(m, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype)  # [out, in], the layout model weights have

    def mm() -> None:
        torch.nn.functional.linear(a, w)

    mm()
    sync(device)
    t0 = time.perf_counter()
    mm()
    sync(device)
    reps = max(1, int(0.05 / max(time.perf_counter() - t0, 1e-6)))
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            mm()
        sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2.0 * m * k * n / best


def compute_floor(cfg: dict[str, Any], dtype: str, device: str, n_params: int) -> dict[str, Any]:
    """The GEMM probe and the token rate it would allow: flops / (2 * n_params)."""
    hidden = int(cfg["hidden_size"])
    ffn = int(cfg.get("intermediate_size") or 4 * hidden)
    storage = DTYPES[dtype]
    # On CPUs without bf16/fp16 arithmetic the engine computes in fp32 (llmrt.hardware.compute_dtype); the
    # floor is the faster of the two ways the device can do these matmuls.
    compute = compute_dtype(torch.device(device if device != "auto" else "cpu"), storage)
    probes = {str(d).replace("torch.", ""): matmul_flops(2048, hidden, ffn, d, device) for d in {storage, compute}}
    flops = max(probes.values())
    return {"gemm_shape": [2048, hidden, ffn], "dtype": dtype, "probes_flops_per_s": probes, "flops_per_s": flops,
            "floor_tokens_per_s": flops / (2.0 * n_params)}


def rates(elapsed: float, n_requests: int, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    """Throughput figures of one timed run."""
    return {"elapsed_s": elapsed, "num_requests": n_requests, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "requests_per_s": n_requests / elapsed,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed}
