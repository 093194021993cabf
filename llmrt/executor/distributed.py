"""What every multi-rank executor shares: rank 0 in the engine core's process, one message per step to the rest."""
from __future__ import annotations

import logging
import os
from abc import abstractmethod
from typing import Any, Optional

import torch

from llmrt.config import EngineConfig
from llmrt.distributed.parallel_state import Communicator, rank_device, shutdown_distributed
from llmrt.distributed.pipeline import PipeComm, join_groups
from llmrt.distributed.worker_proc import set_rank_threads
from llmrt.engine.memory_plan import MemoryPlan
from llmrt.engine.step import BlockMoves, ModelRunnerOutput, SchedulerOutput, StepInput
from llmrt.errors import EngineDeadError, UnsupportedError
from llmrt.executor.base import Executor
from llmrt.worker.worker import Worker

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_ranks_fit(config: EngineConfig) -> None:
    """Refuse more ranks than devices (CUDA) or CPU cores (gloo ranks each need a core to make progress)."""
    world = config.parallel.world_size
    device = rank_device(config.device, 0)
    if device.type == "cuda":
        last = (device.index or 0) + world - 1
        if last >= torch.cuda.device_count():
            raise UnsupportedError(f"{world} ranks from {device} need devices up to cuda:{last}, but this machine has "
                                   f"{torch.cuda.device_count()} CUDA device(s)", param="tensor_parallel_size")
    elif world > usable_cores():
        raise UnsupportedError(f"{world} CPU ranks need at least {world} CPU cores, but this process may use "
                               f"{usable_cores()}; use --tensor-parallel-size x --pipeline-parallel-size = "
                               f"{usable_cores()} or fewer", param="tensor_parallel_size")


class DistributedExecutor(Executor):
    """Rank 0 runs in this process beside the scheduler; each step it sends the other ranks one StepInput
    (the flat batch and the block moves), then all ranks run the forward pass, meeting in its collectives.
    Subclasses start the other ranks and carry the messages (processes and pipes, or Ray actors)."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self._check_ranks_fit()
        self._pending_moves: list[BlockMoves] = []
        self.worker: Worker
        self.comm: Optional[Communicator]  # this stage's tensor-parallel group (None at tp = 1)
        self.pipe: Optional[PipeComm] = None  # links to the other pipeline stages (None at pp = 1)

    def _check_ranks_fit(self) -> None:
        """Refuse more ranks than this machine has devices or cores for (all ranks run here)."""
        check_ranks_fit(self.config)

    def _start_rank0(self, init_method: str) -> None:
        """Join the group as rank 0 and load rank 0's shard (the other ranks must be starting already)."""
        set_rank_threads(self.config)
        pc = self.config.parallel
        self.comm, self.pipe = join_groups(0, pc.tensor_parallel_size, pc.pipeline_parallel_size, init_method,
                                           rank_device(self.config.device, 0), pc.distributed_timeout)
        self.worker = Worker(self.config, rank=0, comm=self.comm, pipe=self.pipe)
        self.worker.model_runner.step_listener = self._send_step

    @abstractmethod
    def _send(self, kind: str, arg: Any) -> None:
        """Send one message to every other rank (serialized once)."""

    @abstractmethod
    def _collect(self) -> list[Any]:
        """The other ranks' results of the last start-up message, in rank order."""

    @abstractmethod
    def _check_alive(self) -> None:
        """Raise EngineDeadError when another rank is gone."""

    def initialize_cache(self) -> MemoryPlan:
        self._send("init_cache", None)
        plan = self.worker.initialize_cache()
        self._collect()
        self._take_stats()  # the profiling pass's collectives are not a step's
        return plan

    def initialize_host_cache(self, swap_bytes: int) -> int:
        self._send("init_host_cache", swap_bytes)
        num = self.worker.initialize_host_cache(swap_bytes)
        self._collect()
        return num

    def rank_parameter_bytes(self) -> list[int]:
        """Each rank's parameter bytes, rank 0 first (tests and `llmrt bench parallel`)."""
        self._send("param_bytes", None)
        own = self.worker.model_runner.weights_bytes()
        return [own] + self._collect()

    def move_blocks(self, step: SchedulerOutput) -> None:
        self.worker.move_blocks(step)
        if step.swap_out or step.block_copies or step.swap_in:  # the other ranks do them with the next step
            self._pending_moves.append(BlockMoves(list(step.swap_out), list(step.block_copies), list(step.swap_in)))

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        self._check_alive()
        for c in (self.comm, self.pipe):
            if c is not None:
                c.use_step_timeout()
        try:
            out = self.worker.execute(step)  # its step_listener sends the StepInput first
        except RuntimeError as e:  # torch.distributed raises RuntimeError subclasses for failed collectives
            if isinstance(e, torch.OutOfMemoryError):
                raise
            self._check_alive()
            raise EngineDeadError(f"a distributed step failed (a rank died, or hung past --distributed-timeout "
                                  f"{self.config.parallel.distributed_timeout:g} s): {e}") from e
        out.collective_seconds, out.collective_bytes = self._take_stats()
        runner = self.worker.model_runner
        if self.pipe is not None:
            out.stage_times, runner.stage_times = runner.stage_times, []
            out.collective_bytes += out.stage_times[0].p2p_bytes if out.stage_times else 0
        return out

    def _take_stats(self) -> tuple[float, int]:
        """Rank 0's seconds inside tensor-parallel collectives and the bytes it put in, since the last call."""
        if self.comm is None:
            return 0.0, 0
        stats = self.comm.take_stats()
        return stats.seconds, stats.bytes

    def _send_step(self, inp: StepInput) -> None:
        inp.block_moves, self._pending_moves = self._pending_moves, []
        self._send("step", inp)

    def shutdown(self) -> None:
        shutdown_distributed()
