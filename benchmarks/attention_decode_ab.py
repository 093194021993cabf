"""The decode attention kernel (csrc/paged_decode.cpp) at a git revision against this tree's, in one process.

A decode step's attention over 12 layers (GQA 12/4 x 64, blocks of 16, each layer its own cache), for N sequences
with contexts drawn from 64-640 (W1-like; one sequence: 385 tokens, W2-like), the blocks either shuffled over the
cache (a long-running engine's) or in order per sequence (a fresh engine's prompts). Caches are evicted (a 64 MiB
read) before each round of 12 layers, untimed, as a step's weight stream would. Outputs are compared with each
other and with a float32 reference. The revision's source is built under its own op namespace (llmrt_attn_base).

Run: PYTHONPATH=. python benchmarks/attention_decode_ab.py --baseline REV [--seqs 64 1] [--dtypes bfloat16 float32]
     [--isa avx2] [--rounds 6] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from llmrt.attention.cpu_paged import _CFLAGS, load_kernel
from llmrt.bench.report import load_average, machine_info, now_iso
from llmrt.hardware import kernel_isa
from llmrt.kernels import ISA_FLAGS
from llmrt.kernels.build import load_or_compile

LAYERS, HEADS, KV, D, BS = 12, 12, 4, 64, 16
SOURCES = ("llmrt/attention/csrc/paged_decode.cpp", "llmrt/attention/csrc/attention_common.h",
           "llmrt/kernels/csrc/lane_sum.h", "llmrt/kernels/csrc/vec_lanes.h")


def build(rev: str | None, isa: str, tag: str):
    """paged_decode.cpp at `rev` (None: this tree), renamed to the namespace llmrt_attn_<tag>, built for `isa`."""
    d = Path(tempfile.mkdtemp(prefix=f"llmrt-attn-{tag}-"))
    for path in SOURCES:
        src = (subprocess.run(["git", "show", f"{rev}:{path}"], check=True, capture_output=True, text=True).stdout
               if rev else Path(path).read_text())
        src = re.sub(r"\bllmrt_attn\b", f"llmrt_attn_{tag}", src)
        src = src.replace("llmrt_attn_bf16dot", f"llmrt_attn_{tag}_bf16dot")  # its own switch, not the tree's
        (d / path).parent.mkdir(parents=True, exist_ok=True)
        (d / path).write_text(src)
    load_or_compile("attention-baseline", f"llmrt_paged_decode_{tag}", [d / SOURCES[0]], _CFLAGS + ISA_FLAGS[isa],
                    [d / p for p in SOURCES[1:]])
    ops = getattr(torch.ops, f"llmrt_attn_{tag}")
    ops.set_bf16dot(True)  # as load_kernel sets it where the CPU has AVX512-BF16 (a no-op in other builds)
    return ops.paged_decode.default


def case(ops: dict, nseq: int, dtype: torch.dtype, shuffled: bool, rounds: int) -> dict:
    """Every build's best time of 12 layers, and the outputs' largest differences."""
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(64, 640, (nseq,), generator=g) if nseq > 1 else torch.tensor([385])
    nbs = [-(-int(n) // BS) for n in lens]
    total = sum(nbs)
    caches = [(torch.randn(total, BS, KV, D, generator=g).to(dtype), torch.randn(total, BS, KV, D, generator=g)
               .to(dtype)) for _ in range(LAYERS)]
    order = torch.randperm(total, generator=g) if shuffled else torch.arange(total)
    tables = torch.zeros(nseq, max(nbs), dtype=torch.long)
    start = 0
    for i, nb in enumerate(nbs):
        tables[i, :nb] = order[start:start + nb]
        start += nb
    q = torch.randn(nseq, HEADS, D, generator=g).to(dtype)
    scale = D ** -0.5
    outs = {name: fn(q, *caches[0], tables, lens, scale, 0).float() for name, fn in ops.items()}
    ref = []
    for i in range(nseq):  # float32, the blocks gathered
        k, v = (c[tables[i, :nbs[i]]].reshape(-1, KV, D)[:int(lens[i])].float().repeat_interleave(HEADS // KV, 1)
                for c in caches[0])
        ref.append(torch.einsum("ht,thd->hd", (torch.einsum("hd,thd->ht", q[i].float(), k) * scale).softmax(-1), v))
    want = torch.stack(ref)
    flush = torch.ones(16 << 20)
    best = {name: float("inf") for name in ops}
    for r in range(rounds):
        for name in (list(ops) if r % 2 == 0 else list(ops)[::-1]):
            for _ in range(3):
                flush.sum()
                t = time.perf_counter()
                for kc, vc in caches:
                    ops[name](q, kc, vc, tables, lens, scale, 0)
                best[name] = min(best[name], time.perf_counter() - t)
    return {"seqs": nseq, "dtype": str(dtype).removeprefix("torch."), "blocks": "shuffled" if shuffled else "in order",
            "base_ms": best["base"] * 1e3, "new_ms": best["new"] * 1e3, "new_over_base": best["new"] / best["base"],
            "max_abs_new_minus_base": (outs["new"] - outs["base"]).abs().max().item(),
            "max_abs_new_minus_fp32_ref": (outs["new"] - want).abs().max().item()}


def main() -> None:
    """Alternate the baseline build and this tree's per case; print and optionally write the table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="git revision of paged_decode.cpp to compare against")
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--isa", default=kernel_isa(), help="the builds' ISA (default: this CPU's kernel build)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out")
    args = ap.parse_args()
    new = load_kernel().decode if args.isa == kernel_isa() else build(None, args.isa, "new")
    ops = {"base": build(args.baseline, args.isa, "base"), "new": new}
    res = {"date": now_iso(), "machine": machine_info(), "isa": args.isa, "baseline": args.baseline,
           "threads": torch.get_num_threads(), "load_average": [load_average()], "cases": []}
    for nseq in args.seqs:
        for dt in args.dtypes:
            for shuffled in (True, False):
                res["cases"].append(case(ops, nseq, getattr(torch, dt), shuffled, args.rounds))
                print(json.dumps(res["cases"][-1]), flush=True)
    res["load_average"].append(load_average())
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
