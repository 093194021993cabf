"""Executors by `distributed_executor_backend` name; a new one is one file plus a line here."""
from __future__ import annotations

from llmrt.config import EngineConfig
from llmrt.errors import UnsupportedError
from llmrt.executor.base import Executor
from llmrt.executor.multiproc import MultiprocExecutor
from llmrt.executor.ray_executor import RayExecutor
from llmrt.executor.uniproc import UniProcExecutor

EXECUTORS: dict[str, type[Executor]] = {
    UniProcExecutor.name: UniProcExecutor,
    MultiprocExecutor.name: MultiprocExecutor,
    RayExecutor.name: RayExecutor,  # imports ray only when chosen
}


def create_executor(config: EngineConfig) -> Executor:
    """The executor the config asks for; an unknown name is refused before anything is loaded."""
    name = config.parallel.distributed_executor_backend
    if name not in EXECUTORS:
        raise UnsupportedError(f"executor backend {name!r} is not supported; supported: {', '.join(EXECUTORS)}",
                               param="distributed_executor_backend")
    return EXECUTORS[name](config)


__all__ = ["EXECUTORS", "Executor", "MultiprocExecutor", "RayExecutor", "UniProcExecutor", "create_executor"]
