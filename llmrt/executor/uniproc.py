"""UniProcExecutor: one worker in the engine core's own process."""
from __future__ import annotations

from llmrt.config import EngineConfig
from llmrt.engine.memory_plan import MemoryPlan
from llmrt.engine.step import ModelRunnerOutput, SchedulerOutput
from llmrt.executor.base import Executor
from llmrt.worker.worker import Worker


class UniProcExecutor(Executor):
    """A single rank: calls go straight to the worker, no serialization, no process hop."""

    name = "uni"

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.worker = Worker(config, rank=0)

    def initialize_cache(self) -> MemoryPlan:
        return self.worker.initialize_cache()

    def initialize_host_cache(self, swap_bytes: int) -> int:
        return self.worker.initialize_host_cache(swap_bytes)

    def move_blocks(self, step: SchedulerOutput) -> None:
        self.worker.move_blocks(step)

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(step)
