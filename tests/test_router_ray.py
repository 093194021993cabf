"""`llmrt route --ray-replicas 2` on a local Ray cluster started here: requests spread over both replicas, and a
replica whose serve process is killed is restarted by Ray and served from again."""
from __future__ import annotations

import os
import signal
from collections import Counter

import httpx
import pytest
import ray  # a dev dependency (make test installs it): missing is a failure, not a skip

from llmrt.router import instances
from tests.ray_utils import local_ray_cluster
from tests.server_utils import REPO, wait_until


pytestmark = pytest.mark.slow

ADMIN = {"Authorization": "Bearer router-admin"}


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray_cluster("llmrt") as address:
        yield address


def _served(base: str, n: int) -> Counter:
    served: Counter = Counter()
    for i in range(n):
        r = httpx.post(f"{base}/v1/completions", json={"prompt": f"Once upon a time {i}", "max_tokens": 2,
                                                       "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        served[r.headers["x-llmrt-instance"]] += 1
    return served


def _backends(base: str) -> list[dict]:
    return httpx.get(f"{base}/admin/backends", headers=ADMIN, timeout=10).json()["backends"]


def test_ray_replicas_spread_and_restart(ray_cluster):
    # --ray-replica-host: on a joined cluster replicas would bind the node's IP; tests talk to loopback only.
    router = instances.start("route", "--ray-replicas", "2", "--ray-address", ray_cluster, "--port", "0",
                             "--ray-replica-host", "127.0.0.1",
                             "--admin-api-key", "router-admin", "--health-interval", "0.3", "--eject-after", "1",
                             "--cooldown", "1.0", "--disable-access-log", cwd=str(REPO))
    try:
        base = instances.wait_healthy(router, 240)
        assert wait_until(lambda: httpx.get(f"{base}/health").json()["available_backends"] == 2, 60)
        actors = [ray.get_actor(f"llmrt-replica-{router.proc.pid}-{i}", namespace="llmrt") for i in range(2)]
        infos = ray.get([a.info.remote() for a in actors], timeout=30)
        assert all(x["url"].startswith("http://127.0.0.1:") for x in infos)
        names = {x["url"].split("//")[1] for x in infos}
        assert {b["url"].split("//")[1] for b in _backends(base)} == names
        assert _served(base, 6) == {name: 3 for name in names}  # round-robin over both replicas

        # kill replica 0's serve process: its actor dies with it, Ray restarts the actor, which serves anew
        os.kill(infos[0]["serve_pid"], signal.SIGKILL)
        assert wait_until(lambda: ray.get(actors[0].info.remote(), timeout=120)["url"] != infos[0]["url"], 180)
        new = ray.get(actors[0].info.remote(), timeout=30)
        assert new["actor_pid"] != infos[0]["actor_pid"]
        new_name = new["url"].split("//")[1]
        want = {new_name, infos[1]["url"].split("//")[1]}

        def swapped() -> bool:
            bs = _backends(base)
            return {b["url"].split("//")[1] for b in bs} == want and all(b["available"] for b in bs)
        assert wait_until(swapped, 60), _backends(base)
        served = _served(base, 6)
        assert set(served) == want and served[new_name] >= 2, served
    finally:
        instances.stop(router)
    # the router's exit killed its actors and their serve processes
    for x in [infos[1], new]:
        assert wait_until(lambda: not _alive(x["serve_pid"]), 30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
