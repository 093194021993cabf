"""One W2 decode step's attention (12 layers, one sequence, GQA 12/4 x 64, block 16) through this tree's kernel and
another build of the kernel source (e.g. main's, renamed to the op namespace llmrt_attn_old), alternating in rounds.

Every layer reads its own cache (as in a step: 12 x 2 x ctx x 4 x 64 elements), best of `--reps` per round;
with one thread the clock is the thread's CPU time (time slicing on a loaded host does not count).

usage: python attention_decode_micro.py OLD_SOURCE [--ctx 385] [--threads 1] [--rounds 5] [--out F]
"""
import argparse
import json
import os
import time
from pathlib import Path

import torch

from llmrt.attention.cpu_paged import load_kernel
from llmrt.kernels.build import load_or_compile

ap = argparse.ArgumentParser()
ap.add_argument("old_source")
ap.add_argument("--ctx", type=int, nargs="+", default=[385])
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--reps", type=int, default=20)
ap.add_argument("--old-flags", nargs="+", default=["-O3", "-fopenmp", "-ffast-math", "-mavx2", "-mfma"],
                help="the old source's compiler flags (default: main's before this branch)")
ap.add_argument("--cold", action="store_true",
                help="evict the caches (read 64 MiB) before each layer's call, untimed: K/V come from DRAM as in a "
                     "decode step, where the layer's weights stream through the caches between two reads of its K/V")
ap.add_argument("--out")
args = ap.parse_args()
# One thread: its CPU time, which the other processes' time slices do not inflate; more threads: wall time.
CLOCK = time.thread_time if args.threads == 1 else time.perf_counter
torch.set_num_threads(args.threads)
load_or_compile("attention", "llmrt_paged_decode_old", [Path(args.old_source)], args.old_flags)
old = torch.ops.llmrt_attn_old.paged_decode.default
new = load_kernel()
LAYERS, HEADS, KV, D, BS = 12, 12, 4, 64, 16


def case(dtype: torch.dtype, ctx: int) -> dict:
    """Old vs new, one dtype and context length."""
    nb = -(-ctx // BS) + 1
    g = torch.Generator().manual_seed(0)
    caches = [(torch.randn(nb * 4, BS, KV, D, generator=g).to(dtype), torch.randn(nb * 4, BS, KV, D, generator=g)
               .to(dtype)) for _ in range(LAYERS)]
    table = torch.randperm(nb * 4, generator=g)[:nb].view(1, -1)
    lens = torch.tensor([ctx])
    qkv = torch.randn(1, (HEADS + 2 * KV) * D, generator=g).to(dtype)
    q = qkv[:, :HEADS * D].view(1, HEADS, D)
    k = qkv[:, HEADS * D:(HEADS + KV) * D].view(1, KV, D)
    v = qkv[:, (HEADS + KV) * D:].view(1, KV, D)
    slot = torch.tensor([int(table[0, (ctx - 1) // BS]) * BS + (ctx - 1) % BS])
    scale = D ** -0.5

    flush = torch.ones(16 << 20)

    def timed_layers(call) -> float:
        total = 0.0
        for kc, vc in caches:
            if args.cold:
                flush.sum()
            t = CLOCK()
            call(kc, vc)
            total += CLOCK() - t
        return total

    def old_call(kc, vc):  # as main did it: two index_copy_ then the kernel
        kc.view(-1, KV, D).index_copy_(0, slot, k)
        vc.view(-1, KV, D).index_copy_(0, slot, v)
        old(q, kc, vc, table, lens, scale, 0)

    def new_call(kc, vc):
        new.decode_write(q, k, v, slot, kc, vc, table, lens, scale, 0)

    run_old = lambda: timed_layers(old_call)  # noqa: E731
    run_new = lambda: timed_layers(new_call)  # noqa: E731

    o1 = old(q, caches[0][0], caches[0][1], table, lens, scale, 0)
    o2 = new.decode(q, caches[0][0], caches[0][1], table, lens, scale, 0)
    err = (o1.float() - o2.float()).abs().max().item()
    best = {"old": float("inf"), "new": float("inf")}
    for _ in range(args.rounds):
        for name, fn in (("old", run_old), ("new", run_new)):
            for _ in range(args.reps):
                best[name] = min(best[name], fn())
    return {"dtype": str(dtype), "ctx": ctx, "old_ms": best["old"] * 1e3, "new_ms": best["new"] * 1e3,
            "old_over_new": best["old"] / best["new"], "max_abs_diff": err}


res = {"threads": args.threads, "cold": args.cold, "load": [os.getloadavg()[0]], "cases": []}
for dt in (torch.bfloat16, torch.float32):
    for ctx in args.ctx:
        res["cases"].append(case(dt, ctx))
        print(json.dumps(res["cases"][-1]), flush=True)
res["load"].append(os.getloadavg()[0])
print("load", res["load"])
if args.out:
    json.dump(res, open(args.out, "w"), indent=1)
