"""`llmrt route --ray-replicas N`: `llmrt serve` instances as Ray actors (one per placement-group bundle,
restarted by Ray when they die); the router follows each actor's current URL."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from llmrt.router.backends import BackendPool
from llmrt.router.instances import Process, start, stop, wait_healthy

logger = logging.getLogger(__name__)

NAMESPACE = "llmrt"  # named actors live here, so that other drivers (a test, an operator) can find them
LOOPBACK = "127.0.0.1"


def replica_host(override: Optional[str], on_cluster: bool, node_ip: Callable[[], str]) -> str:
    """The address a replica's `llmrt serve` binds and reports: `override` (`--ray-replica-host`) when given;
    else, on a cluster the router joined (`--ray-address`), where a replica may run on another node, its node's
    IP (`node_ip()`, asked on that node), so the router can reach it; else (the local single-node Ray the router
    starts itself) loopback, which exposes nothing."""
    if override:
        return override
    return node_ip() if on_cluster else LOOPBACK


class ServeReplica:
    """A Ray actor that owns one `llmrt serve` child process; it dies with the child, so Ray restarts both."""

    def __init__(self, cli_args: list[str], startup_timeout: float, host: Optional[str] = None,
                 on_cluster: bool = False) -> None:
        import ray

        host = replica_host(host, on_cluster, ray.util.get_node_ip_address)
        self._process: Process = start("serve", *cli_args, "--host", host, "--port", "0")
        self._stopping = False
        try:
            self._url = wait_healthy(self._process, startup_timeout)
        except BaseException:
            stop(self._process)
            raise
        threading.Thread(target=self._exit_with_child, daemon=True).start()

    def _exit_with_child(self) -> None:
        self._process.proc.wait()
        if not self._stopping:
            # a crash, not an exit_actor(): Ray counts it against max_restarts and runs __init__ again
            os._exit(1)

    def info(self) -> dict[str, Any]:
        """The instance's base URL, its pid and the actor's pid."""
        return {"url": self._url, "serve_pid": self._process.proc.pid, "actor_pid": os.getpid()}

    def shutdown(self) -> None:
        """Stop the serve process (the actor is killed after)."""
        self._stopping = True
        stop(self._process)


@dataclass
class RayReplicas:
    """The replica actors of one router, the URL each served at last, and the placement group holding them."""

    actors: list[Any]
    urls: list[str]
    placement_group: Any
    poll_s: float = 1.0
    swaps: int = field(default=0)

    async def watch(self, pool: BackendPool) -> None:
        """Every poll_s, ask each actor its URL; a restarted actor (new URL) replaces its old backend."""
        while True:
            await asyncio.gather(*(self._follow(i, pool) for i in range(len(self.actors))))
            await asyncio.sleep(self.poll_s)

    async def _follow(self, i: int, pool: BackendPool) -> None:
        try:
            # while Ray restarts the actor this waits (max_task_retries); the old backend is ejected meanwhile
            url = (await asyncio.wait_for(_awaitable(self.actors[i].info.remote()), timeout=30.0))["url"]
        except Exception as e:  # noqa: BLE001 - a replica being restarted; ask again next round
            logger.info("ray replica %d not answering: %s", i, e)
            return
        if url != self.urls[i]:
            logger.warning("ray replica %d restarted: %s -> %s", i, self.urls[i], url)
            pool.remove(self.urls[i])
            self.urls[i] = url
            await pool.check(pool.add(url))
            self.swaps += 1


async def _awaitable(ref: Any) -> Any:
    return await ref


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("--ray-replicas needs Ray: pip install 'llmrt[ray]'") from e
    return ray


@contextlib.contextmanager
def ray_replicas(n: int, model: Optional[str], extra_args: list[str], address: Optional[str] = None,
                 cpus_per_replica: float = 1.0, startup_timeout: float = 300.0,
                 poll_s: float = 1.0, host: Optional[str] = None) -> Iterator[RayReplicas]:
    """Connect to (address) or start a Ray cluster, place n replica actors, yield them once all serve (each on
    the address `replica_host` chooses)."""
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started_ray = not ray.is_initialized()
    if started_ray:
        # "local" always starts a new cluster; None would join one found in /tmp/ray
        ray.init(address=address or "local", namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    pg = placement_group([{"CPU": cpus_per_replica}] * n, strategy="SPREAD")
    actors: list[Any] = []
    try:
        if not pg.wait(timeout_seconds=startup_timeout):
            raise RuntimeError(f"Ray cannot place {n} replicas of {cpus_per_replica} CPU each")
        cls = ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=cpus_per_replica)(ServeReplica)
        cli_args = [*([model] if model else []), *extra_args]
        for i in range(n):
            actors.append(cls.options(
                name=f"llmrt-replica-{os.getpid()}-{i}", namespace=NAMESPACE,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            ).remote(cli_args, startup_timeout, host, address is not None))
        infos = ray.get([a.info.remote() for a in actors], timeout=startup_timeout)
        yield RayReplicas(actors=actors, urls=[x["url"] for x in infos], placement_group=pg, poll_s=poll_s)
    finally:
        for a in actors:
            with contextlib.suppress(Exception):
                ray.get(a.shutdown.remote(), timeout=30)
            with contextlib.suppress(Exception):
                ray.kill(a, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(pg)
        if started_ray:
            ray.shutdown()
