"""Run a real `llmrt serve` child process on 127.0.0.1 for as long as a block lasts (benchmarks and tests)."""
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


class ServerURL(str):
    """The base URL (http://127.0.0.1:PORT), with the server's process and log file attached."""

    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        """Everything the server printed so far."""
        return Path(self.log_path).read_text(errors="replace")


@contextlib.contextmanager
def serve(model_dir: Optional[str], *args: str, startup_timeout: float = 300.0,
          cwd: Optional[str] = None) -> Iterator[ServerURL]:
    """`llmrt serve [model_dir] --host 127.0.0.1 --port 0 *args`, yielded once /health says ok; stopped after.

    Port 0 lets the server bind a free port itself (no race with other processes); its start-up line names it.
    """
    cmd = [sys.executable, "-m", "llmrt.cli", "serve", *([str(model_dir)] if model_dir else []),
           "--host", "127.0.0.1", "--port", "0", *args]
    fd, log_path = tempfile.mkstemp(prefix="llmrt-serve-", suffix=".log")
    with os.fdopen(fd, "wb") as out:
        # Its own session, so that the engine-core child can be cleaned up with it whatever happens.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        yield _wait_healthy(proc, log_path, startup_timeout)
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
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return url
        time.sleep(0.1)
    raise TimeoutError(f"llmrt serve not healthy after {timeout} s:\n{Path(log_path).read_text(errors='replace')[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of its session (the engine-core child)
