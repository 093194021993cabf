"""Benchmark output: aligned text tables for the terminal, JSON + Markdown files under benchmarks/."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Sequence, Union

import torch

Column = Union[str, tuple[str, str]]  # a key, or (key, header)


def _key_header(col: Column) -> tuple[str, str]:
    return (col, col) if isinstance(col, str) else col


def format_value(value: Any) -> str:
    """Render a cell: floats to 4 significant digits (3 decimals at most), None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def _cells(rows: Sequence[dict], columns: Sequence[Column]) -> tuple[list[str], list[list[str]]]:
    pairs = [_key_header(c) for c in columns]
    return [h for _, h in pairs], [[format_value(r.get(k)) for k, _ in pairs] for r in rows]


def format_table(rows: list[dict], columns: Sequence[Column]) -> str:
    """An aligned plain-text table of rows; columns are keys or (key, header) pairs."""
    headers, body = _cells(rows, columns)
    widths = [max(len(x) for x in col) for col in zip(headers, *body)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(b) for b in body)])


def _md(headers: list[str], body: list[list[str]]) -> str:
    row = lambda cells: "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"
    return "\n".join([row(headers), "|" + "|".join("---" for _ in headers) + "|", *(row(b) for b in body)])


def markdown_table(rows: list[dict], columns: Sequence[Column]) -> str:
    """The same table as GitHub Markdown."""
    return _md(*_cells(rows, columns))


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


def _parse_md_rows(lines: Iterable[str]) -> tuple[list[str], list[list[str]]]:
    """The header and body rows of the first Markdown table in lines."""
    table = [ln for ln in lines if ln.startswith("|")]
    if len(table) < 2:
        return [], []
    split = lambda ln: [c.strip() for c in ln.strip().strip("|").split("|")]
    return split(table[0]), [split(ln) for ln in table[2:]]


def update_markdown(path: Path, title: str, intro: str, row: dict[str, Any],
                    columns: Sequence[Column], key: Sequence[str]) -> None:
    """Append row to the Markdown table at path, replacing an earlier row with the same key columns."""
    headers, new = _cells([row], columns)
    old_headers, body = _parse_md_rows(path.read_text().splitlines()) if path.exists() else ([], [])
    if old_headers != headers:
        body = []  # the columns changed: start the table afresh
    idx = [headers.index(_key_header(k)[1]) for k in key]
    body = [b for b in body if [b[i] for i in idx] != [new[0][i] for i in idx]] + new
    path.write_text(f"# {title}\n\n{intro.strip()}\n\n{_md(headers, body)}\n")


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
