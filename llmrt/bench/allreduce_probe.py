"""Two-process all-reduce timings on this host: gloo, and a shared-memory prototype (not used by the engine).

The prototype is what a same-host CPU all-reduce could be: each rank writes its tensor into a shared buffer,
both wait at a barrier, each sums the two halves, and a second barrier keeps the buffer until both have read.
It answers whether such a path is worth building; the engine itself uses torch.distributed (gloo).
"""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import torch

SIZES = (1, 16, 256)  # rows of a hidden state: a decode of one sequence, a decode batch, a prefill chunk


def _gloo(rank: int, port: int, hidden: int, iters: int, out: Any) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    res = {}
    for rows in SIZES:
        t = torch.randn(rows, hidden)
        for _ in range(10):
            dist.all_reduce(t)
        best = float("inf")
        for _ in range(5):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)
            best = min(best, (time.perf_counter() - start) / iters)
        res[rows] = best
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def _shm(rank: int, buf: torch.Tensor, barrier: Any, hidden: int, iters: int, out: Any) -> None:
    torch.set_num_threads(1)
    res = {}
    for rows in SIZES:
        t = torch.randn(rows, hidden)
        n = rows * hidden
        mine, theirs = buf[rank, :n].view(rows, hidden), buf[1 - rank, :n].view(rows, hidden)

        def reduce() -> None:
            mine.copy_(t)
            barrier.wait()
            torch.add(mine, theirs, out=t)
            barrier.wait()

        for _ in range(10):
            reduce()
        best = float("inf")
        for _ in range(5):
            barrier.wait()
            start = time.perf_counter()
            for _ in range(iters):
                reduce()
            best = min(best, (time.perf_counter() - start) / iters)
        res[rows] = best
    if rank == 0:
        out.put(res)


def probe(hidden: int, iters: int = 200) -> dict[str, dict[int, float]]:
    """Seconds per all-reduce of [rows, hidden] float32 between two processes, best of 5 x `iters`."""
    from llmrt.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    results: dict[str, dict[int, float]] = {}
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gloo, args=(r, port, hidden, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    results["gloo"] = q.get(timeout=600)
    for p in procs:
        p.join()
    buf = torch.zeros(2, max(SIZES) * hidden).share_memory_()
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_shm, args=(r, buf, barrier, hidden, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    results["shared_memory"] = q.get(timeout=600)
    for p in procs:
        p.join()
    return results
