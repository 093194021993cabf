"""`llmrt route --launch N`: local `llmrt serve` processes behind the router, started together, stopped with it."""
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

_BANNER = re.compile(r"llmrt serve: .* on (http://[^\s]+)")


@contextlib.contextmanager
def launch_instances(n: int, model: Optional[str], extra_args: list[str], host: str = "127.0.0.1",
                     startup_timeout: float = 300.0) -> Iterator[list[str]]:
    """Start n `llmrt serve` processes on free ports at once; yield their base URLs once all are healthy."""
    procs: list[tuple[subprocess.Popen, str]] = []
    try:
        for _ in range(n):
            fd, log_path = tempfile.mkstemp(prefix="llmrt-route-instance-", suffix=".log")
            cmd = [sys.executable, "-m", "llmrt.cli", "serve", *([model] if model else []), "--host", host,
                   "--port", "0", *extra_args]
            with os.fdopen(fd, "wb") as out:
                procs.append((subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                               env={**os.environ, "PYTHONUNBUFFERED": "1"}), log_path))
        yield [_wait_healthy(p, log, startup_timeout) for p, log in procs]
    finally:
        for p, log in procs:
            _stop(p)
            with contextlib.suppress(OSError):
                os.unlink(log)


def _wait_healthy(proc: subprocess.Popen, log_path: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    url: Optional[str] = None
    while time.monotonic() < deadline:
        log = Path(log_path).read_text(errors="replace")
        if proc.poll() is not None:
            raise RuntimeError(f"a launched llmrt serve exited with code {proc.returncode}:\n{log[-3000:]}")
        if url is None:
            m = _BANNER.search(log)
            url = m.group(1) if m else None
        if url is not None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return url
        time.sleep(0.2)
    raise TimeoutError(f"a launched llmrt serve was not healthy after {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the engine-core child of its session
