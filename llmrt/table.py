"""Plain-text and Markdown tables for the command line (plan, benchmarks)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence, Union

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
