"""Start a real `llmrt serve` process for a test, wait until it is healthy, stop it afterwards."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx

REPO = Path(__file__).resolve().parents[1]


class ServerURL(str):
    """The base URL (http://127.0.0.1:PORT), with the server's process and log file attached."""

    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        """Everything the server printed so far."""
        return Path(self.log_path).read_text(errors="replace")


@contextlib.contextmanager
def run_server(model_dir: Optional[os.PathLike | str] = None, *extra_args: str,
               startup_timeout: float = 120.0) -> Iterator[ServerURL]:
    """`llmrt serve [model_dir] --host 127.0.0.1 --port 0 *extra_args`, yielded once /health says ok.

    Port 0 lets the server bind a free port itself (no race with other processes); its start-up line names it.
    """
    cmd = [sys.executable, "-m", "llmrt.cli", "serve", *([str(model_dir)] if model_dir else []),
           "--host", "127.0.0.1", "--port", "0", *extra_args]
    fd, log_path = tempfile.mkstemp(prefix="llmrt-serve-", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        # Its own session, so that the engine-core child can be cleaned up with it whatever happens.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _wait_healthy(proc, log_path, startup_timeout)
        yield url
    finally:
        _stop(proc)
        with contextlib.suppress(OSError):
            os.unlink(log_path)


def _wait_healthy(proc: subprocess.Popen, log_path: str, timeout: float) -> ServerURL:
    deadline = time.monotonic() + timeout
    url: Optional[ServerURL] = None
    while time.monotonic() < deadline:
        log = Path(log_path).read_text(errors="replace")
        if proc.poll() is not None:
            raise RuntimeError(f"llmrt serve exited with code {proc.returncode}:\n{log[-4000:]}")
        if url is None:
            m = re.search(r" on (http://127\.0\.0\.1:\d+)", log)
            if m:
                url = ServerURL(m.group(1))
                url.proc, url.log_path = proc, log_path
        if url is not None:
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    raise TimeoutError(f"llmrt serve not healthy after {timeout} s:\n{Path(log_path).read_text(errors='replace')[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its session (the engine-core child)


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
