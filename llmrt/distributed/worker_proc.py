"""A tensor-parallel rank other than 0: joins the group, loads its shard, then runs what rank 0 sends.

Rank 0 (the engine core) sends one pickled message per call over a pipe: ("init_cache", None),
("init_host_cache", bytes), ("step", StepInput) or ("shutdown", None). The collectives inside each call keep
the ranks in step; the pipe only carries what rank 0 decided.
"""
from __future__ import annotations

import logging
import os
import pickle
import traceback
from typing import Any, Optional

import torch

from llmrt.config import EngineConfig
from llmrt.distributed.parallel_state import rank_device, shutdown_distributed

logger = logging.getLogger(__name__)


def set_rank_threads(config: EngineConfig) -> None:
    """CPU ranks share the cores: each gets cores / ranks intra-op threads (at least one)."""
    if rank_device(config.device, 0).type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // config.parallel.world_size))


class RankServer:
    """One rank's worker and the handling of rank 0's messages (shared by the process and Ray backends)."""

    def __init__(self, config: EngineConfig, rank: int, init_method: str, device: Optional[torch.device] = None):
        from llmrt.distributed.pipeline import join_groups
        from llmrt.worker.worker import Worker

        set_rank_threads(config)
        device = device or rank_device(config.device, rank)
        pc = config.parallel
        self.comm, self.pipe = join_groups(rank, pc.tensor_parallel_size, pc.pipeline_parallel_size, init_method,
                                           device, pc.distributed_timeout)
        self.worker = Worker(config, rank=rank, device=device, comm=self.comm, pipe=self.pipe)

    def handle(self, kind: str, arg: Any) -> Any:
        """Run one message from rank 0; the value goes back only for start-up calls."""
        if kind == "step":
            for c in (self.comm, self.pipe):
                if c is not None:
                    c.use_step_timeout()
            self.worker.execute_shard(arg)
            if self.comm is not None:  # only rank 0's figures are reported; this keeps CUDA events from piling up
                self.comm.take_stats()
            return None
        if kind == "init_cache":
            return self.worker.initialize_cache().num_blocks
        if kind == "init_host_cache":
            return self.worker.initialize_host_cache(arg)
        if kind == "param_bytes":
            return self.worker.model_runner.weights_bytes()
        raise ValueError(f"unknown message {kind!r}")


def run_worker(config: EngineConfig, rank: int, init_method: str, conn: Any, log_level: int) -> None:
    """Process entry point of rank `rank`: build, report ready (or the error), then serve messages until
    shutdown or until rank 0 is gone (the pipe closes)."""
    logging.basicConfig(level=log_level, format=f"%(levelname)s %(name)s[rank {rank}]: %(message)s")
    try:
        server = RankServer(config, rank, init_method)
    except BaseException as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    parent = os.getppid()
    while True:
        try:
            if not conn.poll(1.0):
                if os.getppid() != parent:
                    break  # rank 0's process is gone
                continue
            kind, arg = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if kind == "shutdown":
            break
        try:
            result = server.handle(kind, arg)
        except BaseException:
            # A failed collective (a peer died or timed out) or a bug: rank 0 sees this rank's exit.
            logger.error("rank %d failed in %s:\n%s", rank, kind, traceback.format_exc())
            os._exit(19)
        if kind != "step":
            conn.send(("done", result))
    shutdown_distributed()
