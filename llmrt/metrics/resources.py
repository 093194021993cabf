"""Resource figures of the serving processes (RSS, CPU utilization) and of CUDA devices (memory, utilization)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

import psutil

logger = logging.getLogger(__name__)

# CPU utilization is measured over at least this long, so that frequent scrapes do not read noise.
_MIN_CPU_INTERVAL_S = 0.5


@dataclass
class ProcessSample:
    """One process's resident memory and CPU utilization (1.0 = one core busy) over the latest interval."""

    role: str  # "server" (the API process) or "engine_core"
    pid: int
    rss_bytes: int
    cpu_utilization: float


@dataclass
class DeviceSample:
    """One CUDA device's memory and (with NVML) utilization."""

    index: int
    memory_used_bytes: int
    memory_total_bytes: int
    utilization: Optional[float]  # 0..1, None without NVML


class ResourceMonitor:
    """Samples processes by pid and CUDA devices; CPU utilization is the CPU-time delta over wall-time delta."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        self._last_cpu: dict[int, tuple[float, float, float]] = {}  # pid -> (wall, cpu seconds, utilization)
        self._nvml: Any = _init_nvml()

    def processes(self, roles: dict[str, Optional[int]]) -> list[ProcessSample]:
        """A sample of each live process in roles (role -> pid); dead or unknown pids are skipped."""
        out = []
        for role, pid in roles.items():
            if pid is None:
                continue
            try:
                proc = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
                with proc.oneshot():
                    rss = proc.memory_info().rss
                    times = proc.cpu_times()
                out.append(ProcessSample(role, pid, rss, self._utilization(pid, times.user + times.system)))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                self._procs.pop(pid, None)
        return out

    def _utilization(self, pid: int, cpu_seconds: float) -> float:
        now = time.monotonic()
        last = self._last_cpu.get(pid)
        if last is None:
            self._last_cpu[pid] = (now, cpu_seconds, 0.0)
            return 0.0
        wall, cpu, util = last
        if now - wall < _MIN_CPU_INTERVAL_S:
            return util
        util = max(0.0, (cpu_seconds - cpu) / (now - wall))
        self._last_cpu[pid] = (now, cpu_seconds, util)
        return util

    def devices(self, device: str) -> list[DeviceSample]:
        """CUDA device figures through NVML ([] on CPU or without pynvml).

        Not torch.cuda: the engine runs in another process, and asking torch here would create a CUDA context
        (hundreds of MB) in the API process, memory the engine's KV sizing did not account for.
        """
        if not device.startswith("cuda") or self._nvml is None:
            return []
        try:
            return _nvml_devices(self._nvml)
        except Exception:  # noqa: BLE001 - a driver hiccup must not fail a scrape
            logger.debug("NVML query failed", exc_info=True)
            return []


def _init_nvml() -> Any:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no NVML (no driver, or pynvml not installed): no device figures
        return None


def _nvml_devices(nvml: Any) -> list[DeviceSample]:
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        util = nvml.nvmlDeviceGetUtilizationRates(handle)
        out.append(DeviceSample(i, int(mem.used), int(mem.total), util.gpu / 100.0))
    return out
