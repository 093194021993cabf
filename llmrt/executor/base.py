"""The executor seam: the engine core is handed an executor, which owns one worker per rank."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from llmrt.config import EngineConfig
from llmrt.engine.memory_plan import MemoryPlan
from llmrt.engine.step import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from llmrt.worker.worker import Worker


class Executor(ABC):
    """Runs the scheduler's steps on the workers; the core sees only this interface."""

    name: ClassVar[str]
    worker: "Worker"  # rank 0's worker: every executor runs it in the engine core's own process

    def __init__(self, config: EngineConfig):
        self.config = config

    @property
    def device(self) -> torch.device:
        """The device of rank 0 (where sampling happens and seeded generators live)."""
        return self.worker.device

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (rows of its LM head)."""
        return self.worker.model_runner.vocab_size

    @abstractmethod
    def initialize_cache(self) -> MemoryPlan:
        """Size and allocate the KV cache on every worker; the plan of rank 0 (all ranks get the same blocks)."""

    @abstractmethod
    def initialize_host_cache(self, swap_bytes: int) -> int:
        """Allocate every worker's host swap pool; its number of blocks."""

    @abstractmethod
    def move_blocks(self, step: SchedulerOutput) -> None:
        """Do the step's swap-outs, block copies and swap-ins on every worker."""

    @abstractmethod
    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the sampled tokens (from rank 0)."""

    def shutdown(self) -> None:
        """Release the workers (nothing to do in-process)."""
