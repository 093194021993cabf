"""W2 decode TPOT with one format's vector kernel from a git revision against this tree's, in one process.

On hosts whose speed drifts by tens of percent between minutes (and whose fresh processes each draw their own decode
speed), `w2_tpot_ab.py`'s alternating processes cannot resolve a few percent. Here one `LLM` serves both: the
revision's kernel sources are built beside this tree's under their own op namespace (`gemv_bandwidth.baseline_ops`),
and between W2 runs every packed layer of the format is pointed at one build's op or the other (the packed layout
must be the same in both: kernel-only changes). Step graphs are re-recorded after each swap. Each pair of runs is
one ratio; the median of the pairs is the figure to read, the spread says how far to trust it.

Run: PYTHONPATH=.:benchmarks python benchmarks/kernel_step_ab.py --baseline REV --model DIR --workload JSON
         [--format int4] [--quantization int4] [--dtype bfloat16] [--pairs 10] [--threads N] [--name NAME]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from gemv_bandwidth import baseline_ops  # benchmarks/, the script's own folder
from llmrt import LLM, SamplingParams
from llmrt.bench.report import load_average, machine_info, now_iso, write_results
from llmrt.kernels import kernels

OPS = {"int4": "linear_int4", "int8": "linear_int8", "bf16": "linear_bf16", "fp32": "linear_fp32"}


def main() -> None:
    """Alternate the two builds' op for the format's layers between W2 runs; print and write the pair ratios."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="git revision of the kernel sources to compare against")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True, help="the peers' workload.json (its W2 prompt)")
    ap.add_argument("--format", choices=list(OPS), default="int4", help="whose vector op is swapped")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--name", default=None, help="write benchmarks/NAME.json and .md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = kernels()
    assert lib is not None, "needs llmrt's kernels (x86-64 with AVX2 or AVX-512)"
    op = OPS[args.format]
    builds = {"old": dataclasses.replace(lib, **{op: getattr(baseline_ops(args.baseline, lib.isa), op).default}),
              "new": lib}
    prompt = json.load(open(args.workload))["W2"]["prompt"]
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024, kv_cache_memory=256 << 20,
              **({"quantization": args.quantization} if args.quantization else {}))
    runner = llm.engine.executor.worker.model_runner
    layers = [m for m in runner.model.modules() if getattr(m, "packed", None) is not None and m.packed.fmt == args.format]
    assert layers, f"no {args.format} layers in this model (dtype/quantization)"
    params = SamplingParams(max_tokens=args.tokens + 1, temperature=0, ignore_eos=True)
    tpot: dict[str, list[float]] = {"old": [], "new": []}
    first: dict[str, list[int]] = {}
    loads = [load_average()]
    for pair in range(args.pairs):
        for name in (("old", "new") if pair % 2 == 0 else ("new", "old")):
            for m in layers:
                m.packed = dataclasses.replace(m.packed, lib=builds[name])
            if runner.step_graphs is not None:
                runner.step_graphs.clear()
            llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            m0 = out.metrics
            tpot[name].append((m0.last_token_time - m0.first_token_time) / args.tokens * 1e3)
            first[name] = out.outputs[0].token_ids[:16]
        print(f"pair {pair}: old {tpot['old'][-1]:.2f} ms, new {tpot['new'][-1]:.2f} ms, "
              f"new / old {tpot['new'][-1] / tpot['old'][-1]:.3f}", flush=True)
    loads.append(load_average())
    ratios = [n / o for n, o in zip(tpot["new"], tpot["old"])]
    result = {"date": now_iso(), "machine": machine_info(), "baseline": args.baseline, "format": args.format,
              "layers": len(layers), "model": args.model, "dtype": args.dtype, "quantization": args.quantization,
              "threads": torch.get_num_threads(), "tpot_ms": tpot, "pair_ratios": ratios,
              "median_pair_ratio": statistics.median(ratios), "best_ratio": min(tpot["new"]) / min(tpot["old"]),
              "same_first_16_tokens": first["old"] == first["new"], "load_average": loads}
    print(f"{len(layers)} {args.format} layers; new / old: median of {len(ratios)} pairs "
          f"{result['median_pair_ratio']:.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f}), best-of "
          f"{result['best_ratio']:.3f}; same first 16 tokens: {result['same_first_16_tokens']}")
    if args.name:
        write_results(args.name, result, summary={"format": args.format, "baseline": args.baseline,
                                                  "median pair ratio": round(result["median_pair_ratio"], 3),
                                                  "best ratio": round(result["best_ratio"], 3), "pairs": len(ratios)})


if __name__ == "__main__":
    main()
