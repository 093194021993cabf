"""Benchmark output: aligned text tables for the terminal, JSON + Markdown files under benchmarks/."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from llmrt.table import Column, update_markdown


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo, else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """CPU model, core count, torch threads and version, and the GPU name when device is CUDA."""
    info: dict[str, Any] = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): other work on the machine skews every figure."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def now_iso() -> str:
    """The current local time, seconds precision, ISO 8601."""
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


MACHINE_COLUMNS: list[Column] = ["date", "cpu", "cores", "torch", "dtype"]


def write_results(name: str, result: dict[str, Any], out_dir: str = "benchmarks",
                  summary: dict[str, Any] | None = None, columns: Sequence[Column] | None = None,
                  key: Sequence[str] = (), table: str | None = None) -> tuple[Path, Path]:
    """Write <out_dir>/<name>.json (the full result) and append/refresh a row of <out_dir>/<table or name>.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = table or name
    json_path, md_path = out / f"{name}.json", out / f"{table}.md"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    machine = result.get("machine") or machine_info()
    summary = summary or {}
    row = {"date": result.get("date") or now_iso(), "cpu": machine.get("gpu") or machine.get("cpu"),
           "cores": machine.get("cores"), "torch": machine.get("torch"), "dtype": result.get("dtype"), **summary}
    cols = MACHINE_COLUMNS + list(columns if columns is not None else summary)
    latest = f"`{name}.json`" if table == name else "the file named in each row's `json` column"
    intro = (f"One row per configuration (a rerun on the same machine, torch, dtype and key columns replaces its row). "
             f"Full data of the latest run: {latest}.")
    update_markdown(md_path, table, intro, row, cols, key=["cpu", "cores", "torch", "dtype", *key])
    return json_path, md_path


def log(msg: str) -> None:
    """Progress to stderr, so stdout keeps only the report."""
    print(f"[bench] {msg}", file=sys.stderr, flush=True)
