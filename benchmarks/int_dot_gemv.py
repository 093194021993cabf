"""int8/int4 GEMVs: the float-activation kernels (weights widened to fp32) against the int8-activation ones
(integer dot products, csrc/qdot.h), with the bf16 kernel and a plain copy as yardsticks. Cold cache: each call
reads the next of enough weight copies to overflow the caches (>= --working-set MiB), as a decode step does. All
variants run from one build (the one this CPU gets), alternating within every round; best of rounds.

Run: PYTHONPATH=. python benchmarks/int_dot_gemv.py [--threads 1] [--rounds 7] -> benchmarks/int-dot-gemv*.json/md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import torch

from llmrt.bench.report import load_average, machine_info, now_iso
from llmrt.hardware import cpu_flags, describe_device
from llmrt.kernels import build_for, load
from llmrt.kernels.packed import PackedLinear
from llmrt.model.quantization.int4 import quantize_int4
from llmrt.model.quantization.int8 import quantize_int8

SHAPES = {"qkv 768->1280": (1280, 768), "o 768->768": (768, 768), "gate_up 768->4096": (4096, 768),
          "down 2048->768": (768, 2048), "lm_head 768->32000": (32000, 768)}
VARIANTS = ("bf16", "int8 fp32-act", "int8 int8-act", "int4 fp32-act", "int4 int8-act")


def packed(lib, variant: str, w: torch.Tensor) -> PackedLinear:
    """One packed copy of `w` for `variant`."""
    if variant == "bf16":
        return PackedLinear.dense(lib, w.bfloat16())
    if variant.startswith("int8"):
        q, s = quantize_int8(w)
        p = PackedLinear.dense(lib, q, scale=s)
    else:
        q, s, z = quantize_int4(w, 32)
        p = PackedLinear.int4(lib, q, s, z, 32, w.shape[1])
    return dataclasses.replace(p, int8_act=variant.endswith("int8-act"))


def copies(one: PackedLinear, mib: int) -> list[PackedLinear]:
    """Independent copies of `one`'s tensors until they exceed `mib` MiB."""
    out, total = [], 0
    while total < mib << 20:
        out.append(dataclasses.replace(one, data=one.data.clone(),
                                       scale=None if one.scale is None else one.scale.clone(),
                                       sz=None if one.sz is None else one.sz.clone()))
        total += one.nbytes
    return out


def timed(fns: list[Callable], x: torch.Tensor, calls: int) -> float:
    t = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)](x)
    return (time.perf_counter() - t) / calls


def copy_gbps(mib: int, rounds: int) -> float:
    """Bytes read + written per second by a plain tensor copy of `mib` MiB (the machine's streaming yardstick)."""
    src, dst = torch.ones(mib << 18), torch.empty(mib << 18)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--working-set", type=int, default=96)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/int-dot-gemv")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lib = load(build_for(cpu_flags()))
    loads, rows_out = [load_average()], []
    copy = copy_gbps(args.working_set, args.rounds)
    print(f"{lib.isa} ({lib.int_dot}), {torch.get_num_threads()} threads, copy {copy:.1f} GB/s", flush=True)
    for shape in args.shapes:
        n, k = SHAPES[shape]
        w = torch.randn(n, k) * 0.05
        sets = {v: copies(packed(lib, v, w), args.working_set) for v in VARIANTS}
        for rows in args.rows:
            x = torch.randn(rows, k)
            best = {v: float("inf") for v in sets}
            for v, fns in sets.items():
                timed(fns, x.bfloat16() if v == "bf16" else x, len(fns))
            for _ in range(args.rounds):
                for v, fns in sets.items():
                    best[v] = min(best[v], timed(fns, x.bfloat16() if v == "bf16" else x, 2 * len(fns)))
            row = {"shape": shape, "rows": rows, "us": {v: best[v] * 1e6 for v in sets},
                   "GBps": {v: sets[v][0].nbytes / best[v] / 1e9 for v in sets}}
            rows_out.append(row)
            print(shape, rows, " | ".join(f"{v} {row['us'][v]:.1f} us {row['GBps'][v]:.1f} GB/s" for v in sets),
                  flush=True)
        del sets
        loads.append(load_average())
    result = {"date": now_iso(), "machine": machine_info(), "isa": describe_device(torch.device("cpu")),
              "kernels": lib.isa, "int_dot": lib.int_dot, "threads": torch.get_num_threads(),
              "rounds": args.rounds, "working_set_MiB": args.working_set, "copy_GBps": copy,
              "load_average": loads, "results": rows_out}
    out = Path(f"{args.out}-{torch.get_num_threads()}thread")
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# int8/int4 GEMV: fp32 activations vs int8 activations ({lib.isa} build, {lib.int_dot})", "",
             f"{result['date']}, {result['machine']['cpu']}, {result['isa']}, torch {result['machine']['torch']}, "
             f"{result['threads']} threads, best of {args.rounds} alternating rounds, cold cache (>= "
             f"{args.working_set} MiB of copies); load average {loads[0]} -> {loads[-1]}. Plain copy: "
             f"{copy:.1f} GB/s (read + write). Cells: us per call / GB/s of weight bytes (scales included).", "",
             "| shape | rows | " + " | ".join(VARIANTS) + " | int8 speed-up | int4 speed-up |",
             "|---|---|" + "---|" * (len(VARIANTS) + 2)]
    for r in rows_out:
        u, g = r["us"], r["GBps"]
        lines.append(f"| {r['shape']} | {r['rows']} | " + " | ".join(f"{u[v]:.1f} / {g[v]:.1f}" for v in VARIANTS)
                     + f" | {u['int8 fp32-act'] / u['int8 int8-act']:.2f}x"
                     f" | {u['int4 fp32-act'] / u['int4 int8-act']:.2f}x |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("load average", loads)


if __name__ == "__main__":
    main()
