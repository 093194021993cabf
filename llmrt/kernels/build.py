"""Compile-once, load-fast C++ extensions: the one cache both llmrt's linear kernels and its attention kernel use.

A build lives in `$LLMRT_CACHE_DIR/<kind>/<name>-<hash>` (default ~/.cache/llmrt), the hash covering the source
files, the compiler flags and the torch version; an `ok` file written after a successful build names the .so, so
a later process only calls `torch.ops.load_library` (milliseconds) and never imports the compiler toolchain.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Build:
    """A loaded extension: its .so, whether this process compiled it or found it cached, and how long that took."""

    path: Path
    how: str  # "compiled" | "cached"
    seconds: float


def cache_root() -> Path:
    """$LLMRT_CACHE_DIR, else ~/.cache/llmrt."""
    return Path(os.environ.get("LLMRT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "llmrt"))


def build_dir(kind: str, name: str, files: Sequence[Path], cflags: Sequence[str]) -> Path:
    """Where the build of `files` (sources and headers) with `cflags` lives; a change to any of them is a new one."""
    h = hashlib.sha256()
    for f in sorted(files):
        h.update(f.name.encode() + f.read_bytes())
    h.update(" ".join(cflags).encode())
    h.update(torch.__version__.encode())
    return cache_root() / kind / f"{name}-{h.hexdigest()[:16]}"


def load_or_compile(kind: str, name: str, sources: Sequence[Path], cflags: Sequence[str],
                    headers: Sequence[Path] = (), python_module: bool = False) -> Build:
    """Load `name`'s cached build into torch.ops (or, with `python_module`, build a pybind11 module: import it
    with `import_module`), compiling it first if there is none. Raises if the build fails."""
    d = build_dir(kind, name, [*sources, *headers], cflags)
    done = d / "ok"
    t = time.perf_counter()
    if done.is_file():
        path = Path(done.read_text().strip())
        if not python_module:
            torch.ops.load_library(str(path))
        return Build(path, "cached", time.perf_counter() - t)
    from torch.utils import cpp_extension  # imported only to compile: it pulls in setuptools

    if shutil.which("ninja") is None:  # pip's ninja lands beside this Python, which may not be on PATH
        os.environ["PATH"] = sysconfig.get_path("scripts") + os.pathsep + os.environ.get("PATH", "")
    logger.warning("compiling %s into %s: once per source, flags and torch version, about a minute", name, d)
    d.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=name, sources=[str(s) for s in sources], extra_cflags=list(cflags),
                       extra_ldflags=["-fopenmp"], build_directory=str(d), is_python_module=python_module, verbose=False)
    path = max(d.glob(f"{name}*.so"), key=lambda p: p.stat().st_mtime)
    done.write_text(str(path))
    return Build(path, "compiled", time.perf_counter() - t)


def import_module(name: str, path: Path) -> ModuleType:
    """The pybind11 module `name` built (python_module=True) at `path`."""
    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
