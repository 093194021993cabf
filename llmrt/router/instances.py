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
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import httpx

_BANNER = re.compile(r"llmrt (?:serve|route): .* on (http://[^\s]+)")


@dataclass
class Process:
    """An `llmrt ...` child process in its own session, with its log file."""

    proc: subprocess.Popen
    log_path: str
    url: Optional[str] = None

    def log(self) -> str:
        """Everything it printed so far."""
        return Path(self.log_path).read_text(errors="replace")


def start(*cli_args: str, cwd: Optional[str] = None) -> Process:
    """Start `python -m llmrt.cli *cli_args` (its own session, so that its engine-core child goes with it)."""
    fd, log_path = tempfile.mkstemp(prefix=f"llmrt-{cli_args[0] if cli_args else 'x'}-", suffix=".log")
    with os.fdopen(fd, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "llmrt.cli", *cli_args], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Process(proc, log_path)


def wait_healthy(p: Process, timeout: float = 300.0) -> str:
    """Wait for its start-up line and a 200 from /health; its base URL."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            raise RuntimeError(f"llmrt exited with code {p.proc.returncode}:\n{p.log()[-3000:]}")
        if p.url is None:
            m = _BANNER.search(p.log())
            p.url = m.group(1) if m else None
        if p.url is not None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{p.url}/health", timeout=2.0).status_code == 200:
                    return p.url
        time.sleep(0.2)
    raise TimeoutError(f"llmrt was not healthy after {timeout} s:\n{p.log()[-3000:]}")


def stop(p: Process) -> None:
    """SIGTERM, then SIGKILL of whatever is left of its session; remove its log."""
    if p.proc.poll() is None:
        p.proc.send_signal(signal.SIGTERM)
        try:
            p.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.proc.pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.unlink(p.log_path)


@contextlib.contextmanager
def launch_instances(n: int, model: Optional[str], extra_args: list[str], host: str = "127.0.0.1",
                     startup_timeout: float = 300.0) -> Iterator[list[str]]:
    """Start n `llmrt serve` processes on free ports at once; yield their base URLs once all are healthy."""
    procs: list[Process] = []
    try:
        for _ in range(n):
            procs.append(start("serve", *([model] if model else []), "--host", host, "--port", "0", *extra_args))
        yield [wait_healthy(p, startup_timeout) for p in procs]
    finally:
        for p in procs:
            stop(p)
