"""One-way message channels between the API process and the engine core, over a pipe.

`multiprocessing.Queue` did this before, but every queue holds three named POSIX semaphores in /dev/shm that
only a clean exit (or the resource tracker, in the same process group) unlinks: each SIGKILL of a server's
process group left them behind. A pipe has no name, so a killed process leaves nothing. What the queue also gave,
a `put` that never blocks its caller, the writer keeps as an option: both sides send through a feeder thread, so
a busy engine core with a full pipe cannot stall HTTP, and the core's step loop does not wait on the pipe.
"""
from __future__ import annotations

import collections
import multiprocessing as mp
import queue
import threading
from typing import Any


def channel(ctx: Any = None, background: bool = False) -> tuple["ChannelReader", "ChannelWriter"]:
    """A new channel: (reader end, writer end); `background` makes the writer send from a feeder thread."""
    ctx = ctx or mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    return ChannelReader(r), ChannelWriter(w, background)


class ChannelReader:
    """The receiving end: `get` raises queue.Empty on timeout and EOFError once the writer's process is gone."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def get(self, timeout: float) -> Any:
        """The next message, waiting up to `timeout` seconds."""
        if not self._conn.poll(timeout):
            raise queue.Empty
        return self._conn.recv()

    def get_nowait(self) -> Any:
        """The next message if one is there."""
        return self.get(0.0)

    def close(self) -> None:
        """Close this process's copy of the end (after handing it to a child)."""
        self._conn.close()


class ChannelWriter:
    """The sending end. Messages are sent in `put` order; sends to a reader that is gone are dropped (the other
    side notices the death on its own, as it did with mp.Queue)."""

    def __init__(self, conn: Any, background: bool = False) -> None:
        self._conn = conn
        self._background = background
        self._send_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._pending: collections.deque[Any] = collections.deque()
        self._wake = threading.Event()
        self._feeder: threading.Thread | None = None
        self._broken = False

    def __getstate__(self) -> dict[str, Any]:
        return {"conn": self._conn, "background": self._background}  # threads and locks stay in this process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["conn"], state["background"])

    def put(self, msg: Any) -> None:
        """Send `msg` (from the feeder thread when the writer is a background one)."""
        if not self._background:
            self._send(msg)
            return
        self._pending.append(msg)
        with self._start_lock:
            if self._feeder is None:
                self._feeder = threading.Thread(target=self._feed, name="llmrt-channel-feeder", daemon=True)
                self._feeder.start()
        self._wake.set()

    def close(self) -> None:
        """Close this process's copy of the end (after handing it to a child)."""
        self._conn.close()

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until the feeder has sent what was put (before the process exits: the feeder is a daemon)."""
        if self._background and self._feeder is not None:
            done = threading.Event()
            self.put(done)
            done.wait(timeout)

    def _send(self, msg: Any) -> None:
        with self._send_lock:
            if self._broken:
                return
            try:
                self._conn.send(msg)
            except (BrokenPipeError, EOFError, OSError):
                self._broken = True

    def _feed(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while self._pending:
                msg = self._pending.popleft()
                if isinstance(msg, threading.Event):  # flush's marker: everything before it is sent
                    msg.set()
                else:
                    self._send(msg)
