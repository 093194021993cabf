"""fp32 vs int8 activations for int8/int4 layers, end to end: single-stream decode of one model per variant, all
in one process and alternating rounds, timed in wall-clock *and* process CPU time per token. With 1 intra-op
thread the CPU time is the work a token costs, which preemption by other jobs on a shared machine does not
inflate (it still sees their memory-bandwidth and cache contention); wall time is reported beside it.

Run: PYTHONPATH=. python benchmarks/int8_act_ab.py [--threads 1] [--rounds 5] [--models A B ...]
  -> benchmarks/int8-act-ab.json + .md
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from llmrt.bench.report import load_average, machine_info, now_iso
from llmrt.engine.llm import LLM
from llmrt.kernels import kernels
from llmrt.sampling_params import SamplingParams

PEERS = Path("/tmp/peers/models")
DEFAULT = {  # label -> (model, LLM options)
    "bf16": (str(PEERS / "llama-syn-bf16"), dict(dtype="bfloat16")),
    "int8 (bf16)": (str(PEERS / "llama-syn-bf16"), dict(dtype="bfloat16", quantization="int8")),
    "int4 g32 (bf16)": (str(PEERS / "llama-syn-bf16"), dict(dtype="bfloat16", quantization="int4")),
    "GGUF Q8_0": ("/tmp/llmrt-gguf-quant/llama-syn-Q8_0.gguf", {}),
    "GGUF Q4_0": ("/tmp/llmrt-gguf-quant/llama-syn-Q4_0.gguf", {}),
}


def tpot(llm: LLM, prompt: list[int], new: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per token of a `new`-token greedy decode, the first token's cost taken out."""
    def run(n: int) -> tuple[float, float]:
        w, c = time.perf_counter(), time.process_time()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - w, time.process_time() - c
    w1, c1 = run(1)
    w, c = run(new)
    return (w - w1) / (new - 1) * 1e3, (c - c1) / (new - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="*", default=list(DEFAULT))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/int8-act-ab")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llms = {}
    for label in args.configs:
        model, opts = DEFAULT[label]
        variants = ("",) if not (opts.get("quantization") or model.endswith(".gguf")) else ("0", "1")
        for act in variants:
            os.environ["LLMRT_INT8_ACTIVATIONS"] = act or "0"
            name = label + {"": "", "0": " fp32 act", "1": " int8 act"}[act]
            llms[name] = LLM(model, max_model_len=1024, kv_cache_memory=128 << 20, **opts)
    os.environ.pop("LLMRT_INT8_ACTIVATIONS", None)
    prompt = list(range(10, 42))
    best = {k: {"wall_ms": float("inf"), "cpu_ms": float("inf")} for k in llms}
    loads = [load_average()]
    for r in range(args.rounds):
        for name, llm in llms.items():
            tpot(llm, prompt[:8], 3)  # warm
            w, c = tpot(llm, prompt, args.tokens)
            best[name]["wall_ms"], best[name]["cpu_ms"] = min(best[name]["wall_ms"], w), min(best[name]["cpu_ms"], c)
            print(f"round {r} {name}: wall {w:.2f} ms, cpu {c:.2f} ms, load {load_average()}", flush=True)
        loads.append(load_average())
    lib = kernels()
    result = {"date": now_iso(), "machine": machine_info(), "kernels": lib.isa if lib else None,
              "int_dot": lib.int_dot if lib else None, "threads": args.threads, "rounds": args.rounds,
              "tokens": args.tokens, "load_average": loads, "results": best}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# fp32 vs int8 activations, single-stream decode ({result['kernels']}, {result['int_dot']})", "",
             f"{result['date']}, {result['machine']['cpu']}, {args.threads} thread(s), {args.tokens} tokens after "
             f"a 32-token prompt, best of {args.rounds} alternating rounds; load average {loads[0]} -> {loads[-1]}. "
             "CPU ms = process CPU time per token (1 thread: the work, not the preemption).", "",
             "| config | wall ms/token | CPU ms/token |", "|---|---|---|"]
    lines += [f"| {k} | {v['wall_ms']:.2f} | {v['cpu_ms']:.2f} |" for k, v in best.items()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    for k, v in best.items():
        print(f"{k:28} wall {v['wall_ms']:7.2f} ms  cpu {v['cpu_ms']:7.2f} ms")
    print("load average", loads)


if __name__ == "__main__":
    main()
