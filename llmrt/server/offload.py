"""A bounded thread pool for the CPU work of a request (tokenizing, chat templates, grammar checks), so that
the event loop keeps answering /health, /metrics and the streams while a large body is being tokenized.

The Rust tokenizers release the GIL while they encode, so this work runs beside the loop, not just after it.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Offloader:
    """At most `threads` pieces of request work at a time; the rest wait their turn (in arrival order)."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"tokenizer threads must be at least 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="llmrt-tokenize")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a pool thread; its exception, if any, is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        """Stop taking work (what runs finishes)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
