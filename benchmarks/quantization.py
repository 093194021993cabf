"""Quantization benchmark: the random 110m Llama, single-stream TPOT and batch throughput for fp32, bf16, int8,
int4 (and int8 KV), weights and KV memory. All configurations live in one process and alternate rounds; best-of.

With --torch-paths, every configuration is also built with LLMRT_KERNELS=0 (torch's own matmul paths, the
"before" of llmrt/kernels) and measured in the same alternating rounds, labelled "... (torch)". With --int8-act,
every int8/int4 configuration is also built with LLMRT_INT8_ACTIVATIONS=1 (activations quantized to int8,
integer dot products: csrc/qdot.h), labelled "... (int8 act)". With --amx-ab, also with LLMRT_AMX=0 (steps of
several rows without the AMX tile kernel, csrc/amx.h), labelled "... (no AMX)".

Run: PYTHONPATH=. python benchmarks/quantization.py [--rounds 3] [--torch-paths] [--device cuda]
  -> benchmarks/quantization-*.json + quantization.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

import llmrt.kernels
from llmrt.bench.random_model import build_random_llama, default_cache_dir, is_complete
from llmrt.bench.report import load_average, machine_info, now_iso, write_results
from llmrt.engine.llm import LLM
from llmrt.hardware import describe_device
from llmrt.sampling_params import SamplingParams

CONFIGS = {  # label -> LLM options
    "fp32": dict(dtype="float32"),
    "bf16": dict(dtype="bfloat16"),
    "int8": dict(dtype="float32", quantization="int8"),
    "int4 g32": dict(dtype="float32", quantization="int4", quant_group_size=32),
    "bf16 + kv int8": dict(dtype="bfloat16", kv_cache_dtype="int8"),
    # The unquantized parts (embeddings, LM head: 49M of the 110m model's parameters, the LM head read every
    # decode step) in bf16 rather than fp32: what a user fitting the model in less memory would run.
    "int8 (bf16)": dict(dtype="bfloat16", quantization="int8"),
    "int4 g32 (bf16)": dict(dtype="bfloat16", quantization="int4", quant_group_size=32),
    # Calibrated by GPTQ at load (cached in $LLMRT_GPTQ_CACHE_DIR; minutes on the first run): by --configs only.
    "int4 g32 calibrated (bf16)": dict(dtype="bfloat16", quantization="int4", quant_group_size=32,
                                       quant_calibration="builtin"),
    # CUDA sm_89+ only (refused on CPUs): e4m3 weights and per-token e4m3 activations on the fp8 tensor cores.
    "fp8 (bf16)": dict(dtype="bfloat16", quantization="fp8"),
    "bf16 + kv fp8": dict(dtype="bfloat16", kv_cache_dtype="fp8"),
}
DEFAULT_CONFIGS = [k for k, v in CONFIGS.items() if "quant_calibration" not in v]
CPU_CONFIGS = [k for k in DEFAULT_CONFIGS if CONFIGS[k].get("quantization") != "fp8"
               and CONFIGS[k].get("kv_cache_dtype") != "fp8"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--configs", nargs="*", default=None,
                    help="a subset of: " + ", ".join(CONFIGS) + " (default: all on CUDA, all but the fp8 ones on CPUs)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda: where every configuration runs")
    ap.add_argument("--model", help="a checkpoint directory instead of the random 110m model")
    ap.add_argument("--name", default="quantization", help="prefix of the result files and table")
    ap.add_argument("--torch-paths", action="store_true", help="also measure every config with LLMRT_KERNELS=0")
    ap.add_argument("--int8-act", action="store_true",
                    help="also measure int8/int4 configs with LLMRT_INT8_ACTIVATIONS=1")
    ap.add_argument("--amx-ab", action="store_true",
                    help="also measure int8/int4 configs with LLMRT_AMX=0 (no AMX tile kernel; AMX CPUs)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.configs is None:
        args.configs = DEFAULT_CONFIGS if device.type == "cuda" else CPU_CONFIGS
    # CPU engines take a fixed KV budget; CUDA ones a share of the card, small enough for every config at once.
    memory = dict(kv_cache_memory=64 << 20) if device.type == "cpu" else dict(gpu_memory_utilization=0.05)
    if args.threads:  # on a loaded machine 2 OpenMP threads wait for each other at every matmul's barrier
        torch.set_num_threads(args.threads)
    path = Path(args.model) if args.model else default_cache_dir() / "110m-float32"
    if not args.model and not is_complete(path):
        build_random_llama("110m", str(path))
    llms = {}
    for paths in (("torch", "ours") if args.torch_paths else ("ours",)):
        os.environ["LLMRT_KERNELS"] = "0" if paths == "torch" else "auto"
        llmrt.kernels.kernels.cache_clear()
        for k, v in ((k, CONFIGS[k]) for k in args.configs):
            label = f"{k} (torch)" if paths == "torch" else k
            llms[label] = LLM(str(path), max_model_len=args.max_model_len, device=args.device, **memory, **v)
            # int8/int4 variants: the same config built with one switch set (read when its layers are packed)
            for wanted, var, value, suffix in ((args.int8_act, "LLMRT_INT8_ACTIVATIONS", "1", "int8 act"),
                                               (args.amx_ab, "LLMRT_AMX", "0", "no AMX")):
                if wanted and paths == "ours" and v.get("quantization"):
                    os.environ[var] = value
                    llms[f"{k} ({suffix})"] = LLM(str(path), max_model_len=args.max_model_len, device=args.device,
                                                  **memory, **v)
                    os.environ.pop(var)
    lib = llmrt.kernels.kernels()
    prompt = list(range(10, 42))
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=args.tokens + 1, temperature=0, ignore_eos=True)
    best: dict[str, dict[str, float]] = {k: {"tpot_ms": float("inf"), "throughput_tok_s": 0.0} for k in llms}
    per_round: dict[str, list[float]] = {k: [] for k in llms}  # each round's TPOT: ratios within a round
    loads = [load_average()]
    # Warm-up: the first call pays one-off costs and leaves the prompt in the prefix cache; unwarmed, round 1's
    # 1-token call paid both while its 33-token call hit the cache, and the difference, subtracted, made that
    # round's TPOT too low (an int8 round at 1.6 ms against 2.9-3.0 in the others).
    for llm in llms.values():
        llm.generate([prompt], one, use_tqdm=False)
    for _ in range(args.rounds):
        for label, llm in llms.items():
            t = time.perf_counter()
            llm.generate([prompt], one, use_tqdm=False)
            t1 = time.perf_counter() - t
            t = time.perf_counter()
            llm.generate([prompt], many, use_tqdm=False)
            tpot = (time.perf_counter() - t - t1) / args.tokens * 1e3
            t = time.perf_counter()
            outs = llm.generate([[p + i for p in prompt] for i in range(args.batch)], many, use_tqdm=False)
            thr = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
            b = best[label]
            b["tpot_ms"], b["throughput_tok_s"] = min(b["tpot_ms"], tpot), max(b["throughput_tok_s"], thr)
            per_round[label].append(tpot)
            print(f"round: {label} TPOT {tpot:.1f} ms, batch {thr:.1f} tok/s, load {load_average()}", flush=True)
        loads.append(load_average())
    fulls = [k for k in ("fp32", "bf16", "fp32 (torch)", "bf16 (torch)") if k in best]
    full = min(best[k]["tpot_ms"] for k in fulls)
    # The host's speed drifts between minutes: each round's ratio to that round's best full-precision TPOT, and
    # their median, say how steady the best-of ratio is.
    round_full = [min(per_round[k][r] for k in fulls) for r in range(args.rounds)]
    rows = {}
    for label, llm in llms.items():
        m = llm.engine.memory
        ratios = [t / f for t, f in zip(per_round[label], round_full)]
        rows[label] = {**best[label], "tpot_vs_best_full": best[label]["tpot_ms"] / full,
                       "tpot_ms_rounds": per_round[label], "tpot_vs_full_rounds": ratios,
                       "tpot_vs_full_median_round": statistics.median(ratios),
                       "weights_MiB": m.weights_bytes / (1 << 20), "kv_B_per_token": m.kv_bytes_per_token,
                       "kv_MiB_at_1k_ctx": m.kv_bytes_per_token * 1024 / (1 << 20),
                       "max_seqs_at_1k": m.max_concurrent_sequences(1024), "kv_cache_MiB": m.kv_cache_bytes / (1 << 20)}
    result = {"date": now_iso(), "machine": machine_info(args.device), "isa": describe_device(device),
              "kernels": lib.isa if lib else None, "load_average": loads, "rounds": args.rounds,
              "model": str(path), "tokens": args.tokens, "batch": args.batch, "results": rows, "dtype": "mixed",
              "threads": torch.get_num_threads()}
    for label, r in rows.items():
        print(f"{label:<16} TPOT {r['tpot_ms']:7.2f} ms ({r['tpot_vs_best_full']:.2f}x, median round "
              f"{r['tpot_vs_full_median_round']:.2f}x)  batch {r['throughput_tok_s']:7.1f} "
              f"tok/s  weights {r['weights_MiB']:7.1f} MiB  KV {r['kv_B_per_token']} B/token  "
              f"seqs@1k {r['max_seqs_at_1k']}")
    print("load average", loads)
    for label, r in rows.items():
        slug = label.replace(" ", "-").replace("+", "").replace("(", "").replace(")", "")
        write_results(f"{args.name}-{slug}", result, table=args.name,
                      summary={"config": label, "TPOT ms": round(r["tpot_ms"], 2),
                               "vs best full": round(r["tpot_vs_best_full"], 2),
                               "median round": round(r["tpot_vs_full_median_round"], 2),
                               "batch tok/s": round(r["throughput_tok_s"], 1), "weights MiB": round(r["weights_MiB"], 1),
                               "KV B/token": r["kv_B_per_token"], "load": loads[-1]}, key=["config"])


if __name__ == "__main__":
    main()
