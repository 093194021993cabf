"""RayExecutor: ranks 1..N-1 as Ray actors, one placement-group bundle each; rank 0 stays in the engine core.

The engine core joins the Ray cluster it runs in (or RAY_ADDRESS / a local one found by address="auto"). The
process group forms over TCP at rank 0's node address (loopback when every bundle landed on rank 0's node).
Step messages are pickled once and handed to each actor as bytes; actor calls run in order, and a failed call
(a dead actor, a failed collective) surfaces at the next step as engine_dead.
"""
from __future__ import annotations

import contextlib
import os
import pickle
from typing import Any

from llmrt.config import EngineConfig
from llmrt.distributed.parallel_state import rank_device
from llmrt.errors import EngineDeadError, UnsupportedError
from llmrt.executor.distributed import DistributedExecutor
from llmrt.executor.multiproc import free_port


class RankActor:
    """One rank inside a Ray actor (wrapped with ray.remote by the executor)."""

    def __init__(self) -> None:
        self.server: Any = None

    def node_ip(self) -> str:
        """This actor's node address."""
        import ray

        return ray.util.get_node_ip_address()

    def start(self, config: EngineConfig, rank: int, init_method: str) -> int:
        """Join the group and load the shard; this actor's pid. On CUDA, Ray shows the actor only its own GPU
        (CUDA_VISIBLE_DEVICES), so the rank's device is cuda:0 here."""
        import torch

        from llmrt.distributed.worker_proc import RankServer

        cuda = rank_device(config.device, 0).type == "cuda"
        self.server = RankServer(config, rank, init_method, torch.device("cuda", 0) if cuda else None)
        return os.getpid()

    def handle(self, payload: bytes) -> Any:
        """Run one message from rank 0."""
        kind, arg = pickle.loads(payload)
        return self.server.handle(kind, arg)


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise UnsupportedError("--distributed-executor-backend ray needs Ray: pip install 'llmrt[ray]'",
                               param="distributed_executor_backend") from e
    return ray


class RayExecutor(DistributedExecutor):
    """Tensor-parallel ranks on a Ray cluster (one node or several)."""

    name = "ray"

    def __init__(self, config: EngineConfig):
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(config)
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=False)
        cuda = rank_device(config.device, 0).type == "cuda"
        n = config.parallel.world_size - 1
        self.pg = placement_group([{"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}] * n, strategy="PACK")
        self.actors: list[Any] = []
        self._inflight: list[Any] = []
        try:
            if not self.pg.wait(timeout_seconds=120):
                raise UnsupportedError(f"the Ray cluster cannot place {n} worker rank(s) of one "
                                       f"{'GPU' if cuda else 'CPU'} each", param="tensor_parallel_size")
            cls = ray.remote(num_cpus=1, num_gpus=1 if cuda else 0, max_restarts=0)(RankActor)
            self.actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=i)).remote() for i in range(n)]
            here = ray.util.get_node_ip_address()
            same_node = all(ip == here for ip in ray.get([a.node_ip.remote() for a in self.actors]))
            init_method = f"tcp://{'127.0.0.1' if same_node else here}:{free_port()}"
            starts = [a.start.remote(config, rank, init_method) for rank, a in enumerate(self.actors, start=1)]
            self._start_rank0(init_method)
            self.worker_pids = ray.get(starts)
        except BaseException:
            self.shutdown()
            raise

    def _check_ranks_fit(self) -> None:
        """The placement group is the check: a cluster without room for every rank is refused when it waits."""

    def _send(self, kind: str, arg: Any) -> None:
        payload = pickle.dumps((kind, arg), protocol=pickle.HIGHEST_PROTOCOL)
        self._inflight = [a.handle.remote(payload) for a in self.actors]

    def _collect(self) -> list[Any]:
        ray = _ray()
        refs, self._inflight = self._inflight, []
        try:
            return ray.get(refs)
        except Exception as e:
            raise EngineDeadError(f"a Ray worker rank failed: {e}") from e

    def _check_alive(self) -> None:
        ray = _ray()
        ready, _ = ray.wait(self._inflight, num_returns=len(self._inflight), timeout=0)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:
                raise EngineDeadError(f"a Ray worker rank failed: {e}") from e

    def shutdown(self) -> None:
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(self.pg)
        self.actors = []
        super().shutdown()
