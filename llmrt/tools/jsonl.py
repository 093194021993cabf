"""Reading JSONL files of request bodies: one JSON value a line, blank lines skipped, errors naming the line."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmrt.errors import InvalidRequestError


def read_jsonl(path: str, param: str) -> list[tuple[int, Any]]:
    """(line number, parsed value) for each non-blank line of `path`; InvalidRequestError(param=param) if unreadable."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InvalidRequestError(f"cannot read {path}: {e.strerror or e}", param=param) from None
    values = []
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            values.append((k, json.loads(line)))
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{path}:{k}: not JSON ({e.msg})", param=param) from None
    if not values:
        raise InvalidRequestError(f"{path}: no requests in the file", param=param)
    return values
