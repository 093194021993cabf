"""int8/int4 vector kernels per row count: a git revision's build against this tree's, in one process (issue 16).

The peers' 124.7M model's 48 decoder linear shapes, quantized from random weights (int4: group 32), three copies
read in turn so the weights come from memory as in a decode step; the two builds' ops (the revision's under its own
namespace, `gemv_bandwidth.baseline_ops`) alternate within every round, best of rounds. From 8 rows the table
also has the weights dequantized into a reused buffer + torch's `F.linear` (what a layer runs above its row limit).

Run: PYTHONPATH=.:benchmarks python benchmarks/int_rows_ab.py --baseline REV [--formats int4 int8]
         [--rows 1 2 4 8 16] [--isa avx2] [--rounds 8] [--out benchmarks/NAME.md]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import llmrt.kernels as K
from gemv_bandwidth import baseline_ops  # benchmarks/, the script's own folder
from llmrt.bench.report import load_average, machine_info, now_iso
from llmrt.kernels.packed import PackedLinear
from llmrt.model.quantization.int4 import quantize_int4
from llmrt.model.quantization.int8 import quantize_int8

SHAPES = [(1280, 768), (768, 768), (4096, 768), (768, 2048)] * 12  # (out, in) of qkv, o, gate_up, down x 12 layers


def packed_sets(lib: K.KernelLib, fmt: str, copies: int) -> list[list[PackedLinear]]:
    """`copies` sets of the 48 layers in `fmt`, packed for `lib`."""
    sets = []
    for _ in range(copies):
        packs = []
        for n, k in SHAPES:
            w = torch.randn(n, k)
            if fmt == "int4":
                q, sc, z = quantize_int4(w, 32)
                packs.append(PackedLinear.int4(lib, q, sc, z, 32, k))
            else:
                q, sc = quantize_int8(w)
                packs.append(PackedLinear.dense(lib, q, scale=sc))
        sets.append(packs)
    return sets


def main() -> None:
    """Time both builds' op (and dequantize + F.linear from 8 rows) per format, dtype and row count."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="git revision of the kernel sources to compare against")
    ap.add_argument("--formats", nargs="*", default=["int4", "int8"])
    ap.add_argument("--rows", nargs="*", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--isa", default=None, help="a build other than the one this CPU would use (e.g. avx2)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args()
    lib = K.load(args.isa) if args.isa else K.kernels()
    base = baseline_ops(args.baseline, lib.isa)
    lines = [f"# int8/int4 vector kernels per row count: `{args.baseline}` vs this tree ({lib.isa} build)", "",
             f"{now_iso()}, {machine_info()['cpu']}, {machine_info()['cores']} cores, torch threads "
             f"{torch.get_num_threads()}, load {load_average()}; the 48 decoder linears of the 124.7M "
             f"model, 3 copies, best of {args.rounds} alternating rounds, ms.", "",
             "| format | activations | rows | baseline | this tree | ratio | dequantize + F.linear |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for fmt in args.formats:
        sets = packed_sets(lib, fmt, 3)
        old = getattr(base, f"linear_{fmt}").default
        new = getattr(lib, f"linear_{fmt}")

        def call(fn, p: PackedLinear, x: torch.Tensor) -> torch.Tensor:
            return fn(x, p.data, p.sz, 32, p.n, None) if fmt == "int4" else fn(x, p.data, p.scale, p.n, None)

        for dt in (torch.float32, torch.bfloat16):
            bufs: dict[tuple[int, int], torch.Tensor] = {}
            for rows in args.rows:
                xs = {k: torch.randn(rows, k).to(dt) for _, k in SHAPES}
                best = {"old": float("inf"), "new": float("inf"), "deq": float("inf")}
                for rnd in range(args.rounds):
                    order = [("old", old), ("new", new)] if rnd % 2 else [("new", new), ("old", old)]
                    for name, fn in order + ([("deq", None)] if rows >= 8 else []):
                        for packs in sets:
                            t = time.perf_counter()
                            for p, (n, k) in zip(packs, SHAPES):
                                if fn is None:
                                    buf = bufs.setdefault((n, k), torch.empty(n, p.padded_in, dtype=dt))
                                    F.linear(xs[k], p.unpack_into(buf)[:, :k])
                                else:
                                    call(fn, p, xs[k])
                            best[name] = min(best[name], time.perf_counter() - t)
                deq = f"{best['deq'] * 1e3:.2f}" if rows >= 8 else ""
                line = (f"| {fmt} | {str(dt).split('.')[-1]} | {rows} | {best['old'] * 1e3:.2f} | "
                        f"{best['new'] * 1e3:.2f} | {best['new'] / best['old']:.3f} | {deq} |")
                lines.append(line)
                print(line, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
