"""A local Ray cluster for tests, started in-process and stopped alone."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from typing import Iterator


@contextlib.contextmanager
def local_ray_cluster(namespace: str) -> Iterator[str]:
    """An in-process Ray cluster of 2 CPUs; yields its GCS address. Its temp dir is private and short (Ray's socket
    paths have a length limit), and ray.shutdown() stops only this cluster (`ray stop` would stop every Ray
    process of the user)."""
    import ray

    temp_dir = tempfile.mkdtemp(prefix="llmrt-ray-", dir="/tmp")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=temp_dir, namespace=namespace, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
