"""Two-process all-reduce timings on this host through the engine's own communicator: gloo against the
shared-memory segment (`--cpu-all-reduce gloo | shm`), float32 rows of the model's hidden size."""
from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import torch

SIZES = (1, 16, 256)  # rows of a hidden state: a decode of one sequence, a decode batch, a prefill chunk
TRANSPORTS = ("gloo", "shm")


def _rank(rank: int, port: int, transport: str, hidden: int, iters: int, out: Any) -> None:
    from llmrt.distributed.parallel_state import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    comm = init_distributed(rank, 2, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 60.0, transport)
    comm.use_step_timeout()
    res = {}
    for rows in SIZES:
        t = torch.randn(rows, hidden)
        for _ in range(10):
            comm.all_reduce(t)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(t)
            best = min(best, (time.perf_counter() - start) / iters)
        res[rows] = best
    if rank == 0:
        out.put(res)
    comm.close()
    shutdown_distributed()


def probe(hidden: int, iters: int = 200) -> dict[str, dict[int, float]]:
    """Seconds per all-reduce of [rows, hidden] float32 between two processes per transport, best of 5 x `iters`."""
    from llmrt.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    results: dict[str, dict[int, float]] = {}
    for transport in TRANSPORTS:
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, transport, hidden, iters, q)) for r in range(2)]
        for p in procs:
            p.start()
        results[transport] = q.get(timeout=600)
        for p in procs:
            p.join()
    return results
