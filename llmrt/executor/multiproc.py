"""MultiprocExecutor: one spawned process per rank beside rank 0 in the engine core's process."""
from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import socket
import time
from typing import Any

from llmrt.config import EngineConfig
from llmrt.distributed.worker_proc import run_worker
from llmrt.errors import EngineDeadError
from llmrt.executor.distributed import DistributedExecutor

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A free TCP port on the loopback interface (the process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MultiprocExecutor(DistributedExecutor):
    """Ranks 1..N-1 are spawned processes fed over pipes; each step's message is pickled once and written to
    every pipe. A rank that exits is seen before the next step; one that hangs makes rank 0's next collective
    fail after --distributed-timeout; either way the engine core dies and the server answers engine_dead."""

    name = "mp"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        for rank in range(1, config.parallel.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=run_worker, name=f"llmrt-rank-{rank}", daemon=True,
                               args=(config, rank, init_method, theirs, logging.getLogger().getEffectiveLevel()))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        try:
            self._start_rank0(init_method)
            self._collect()  # every rank has loaded its shard
        except BaseException:
            self.shutdown()
            raise

    def _send(self, kind: str, arg: Any) -> None:
        payload = pickle.dumps((kind, arg), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, OSError) as e:
                raise EngineDeadError(f"tensor-parallel rank {rank} is gone ({e})") from e

    def _collect(self) -> list[Any]:
        out = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            while not conn.poll(0.5):
                if not proc.is_alive():
                    raise EngineDeadError(f"tensor-parallel rank {rank} exited (code {proc.exitcode})")
            status, value = conn.recv()
            if status == "failed":
                raise EngineDeadError(f"tensor-parallel rank {rank} failed to start: {value}")
            out.append(value)
        return out

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                raise EngineDeadError(f"tensor-parallel rank {rank} exited (code {proc.exitcode})")

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (tests kill one)."""
        return [p.pid for p in self.procs]

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("shutdown", None)))
            except OSError:
                pass
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
        super().shutdown()
