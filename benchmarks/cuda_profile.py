"""Where a CUDA engine step's time goes: the random 110m Llama under a W1-like batch (64 prompts of 64-512
tokens, 32 output tokens), through torch.profiler. Reports wall time, the GPU's busy time (the sum of its
kernels: launch-bound when far below the wall), kernel launches per step, and the top ops by host and device time.

Run: PYTHONPATH=. python benchmarks/cuda_profile.py [--dtype bfloat16] [--prompts 1 --output-len 64 --name NAME]
  -> benchmarks/cuda-profile-<gpu>.txt
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from llmrt.bench.random_model import build_random_llama, default_cache_dir, is_complete
from llmrt.engine.llm import LLM
from llmrt.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--name", default="cuda-profile", help="stem of the result file (-<gpu>.txt is added)")
    args = ap.parse_args()
    path = default_cache_dir() / "110m-float32"
    if not is_complete(path):
        build_random_llama("110m", str(path))
    llm = LLM(str(path), dtype=args.dtype, device="cuda", gpu_memory_utilization=0.3)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(64, 512))] for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    steps0 = llm.engine.num_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    steps = llm.engine.num_steps - steps0
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events
                 if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunch", "cuLaunch")))
    head = (f"{torch.cuda.get_device_name()} torch {torch.__version__}, {args.dtype}, {args.prompts} prompts x "
            f"{args.output_len} tokens: wall {wall:.2f} s over {steps} steps ({wall / steps * 1e3:.1f} ms/step); "
            f"GPU kernels busy {gpu_us / 1e6:.2f} s ({gpu_us / 1e6 / wall:.0%} of the wall); "
            f"{launches / steps:.0f} kernel launches per step")
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=25)
    by_gpu = events.table(sort_by="self_device_time_total", row_limit=15)
    text = f"{head}\n\nTop ops by host (self CPU) time:\n{by_cpu}\n\nTop ops by device time:\n{by_gpu}\n"
    print(text)
    name = torch.cuda.get_device_name().replace(" ", "-")
    (Path(__file__).parent / f"{args.name}-{name}.txt").write_text(text)


if __name__ == "__main__":
    main()
