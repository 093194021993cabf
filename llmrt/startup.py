"""Where start-up seconds go: the process's age and named phases, for one log line."""
from __future__ import annotations

import os
import time
from typing import Optional


def seconds_since_process_start() -> Optional[float]:
    """Wall seconds since this process was started (Linux /proc, 10 ms ticks); None where unreadable."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks
    except (OSError, ValueError, IndexError):
        return None


class StartupTimer:
    """Times consecutive phases of start-up; `describe` names them with what ran before the first one."""

    def __init__(self) -> None:
        self.before = seconds_since_process_start()  # interpreter start and imports, before the timer existed
        self.phases: list[tuple[str, float]] = []
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Close the phase that ran since the previous mark (or since the timer was made)."""
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def describe(self) -> str:
        """e.g. 'start-up 1.93 s: process start and imports 1.20 s, config 0.01 s, ...'."""
        parts = ([("process start and imports", self.before)] if self.before is not None else []) + self.phases
        total = sum(s for _, s in parts)
        return f"start-up {total:.2f} s: " + ", ".join(f"{name} {s:.2f} s" for name, s in parts)
