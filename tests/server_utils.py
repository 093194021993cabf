"""Start a real `llmrt serve` process for a test, wait until it is healthy, stop it afterwards."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx

from llmrt.bench.server_process import ServerURL, serve

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def run_server(model_dir: Optional[os.PathLike | str] = None, *extra_args: str,
               startup_timeout: float = 120.0) -> Iterator[ServerURL]:
    """`llmrt serve [model_dir] --host 127.0.0.1 --port 0 *extra_args` from the repository root, until the block ends."""
    with serve(str(model_dir) if model_dir else None, *extra_args, startup_timeout=startup_timeout,
               cwd=str(REPO)) as url:
        yield url


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return bool(value)
        time.sleep(interval)


def all_blocks_free(base: str) -> bool:
    """Whether /debug/stats shows every KV block free and nothing running."""
    st = httpx.get(f"{base}/debug/stats", timeout=5.0).json()
    return "kv_blocks_total" in st and st["kv_blocks_free"] == st["kv_blocks_total"] and not st.get("num_running")
