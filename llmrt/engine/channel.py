"""One-way message channels between the API process and the engine core, over a pipe.

`multiprocessing.Queue` did this before, but every queue holds three named POSIX semaphores in /dev/shm that
only a clean exit (or the resource tracker, in the same process group) unlinks: each SIGKILL of a server's
process group left them behind. A pipe has no name, so a killed process leaves nothing. What the queue also gave,
a `put` that never blocks its caller, the writer keeps as an option: a message is written at once only where the
pipe has room for it, otherwise a feeder thread sends it, so a busy engine core with a full pipe cannot stall
HTTP, and the core's step loop does not wait on the pipe.
"""
from __future__ import annotations

import array
import collections
import fcntl
import logging
import multiprocessing as mp
import os
import queue
import struct
import termios
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Any

logger = logging.getLogger(__name__)


def channel(ctx: Any = None, background: bool = False) -> tuple["ChannelReader", "ChannelWriter"]:
    """A new channel: (reader end, writer end); `background` makes the writer send from a feeder thread."""
    ctx = ctx or mp.get_context("spawn")
    r, w = ctx.Pipe(duplex=False)
    return ChannelReader(r), ChannelWriter(w, background)


class ChannelReader:
    """The receiving end: `get` raises queue.Empty on timeout and EOFError once the writer's process is gone."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._buf: bytearray | None = None  # read_ready's bytes of a message not yet complete

    def get(self, timeout: float) -> Any:
        """The next message, waiting up to `timeout` seconds."""
        if not self._conn.poll(timeout):
            raise queue.Empty
        return self._conn.recv()

    def get_nowait(self) -> Any:
        """The next message if one is there."""
        return self.get(0.0)

    def fileno(self) -> int:
        """The pipe's descriptor, for an event loop's add_reader."""
        return self._conn.fileno()

    def read_ready(self) -> list[Any]:
        """Every message complete in the pipe now, never waiting (for an event loop: a writer stopped halfway
        through a message must not block it); EOFError once the writer's process is gone and all is read.
        After the first call the end is non-blocking, so `get` is not for it any more."""
        if self._buf is None:
            os.set_blocking(self.fileno(), False)
            self._buf = bytearray()
        eof = False
        while True:
            try:
                chunk = os.read(self.fileno(), _READ_CHUNK)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self._buf += chunk
            if len(chunk) < _READ_CHUNK:  # drained (a later write wakes the loop again)
                break
        msgs = []
        while True:
            frame = _frame(self._buf)
            if frame is None:
                break
            start, end = frame
            body = self._buf[start:end]  # a copy: the buffer moves on
            del self._buf[:end]
            try:
                msgs.append(ForkingPickler.loads(body))
            except Exception:  # noqa: BLE001 - one unreadable message must not stop the ones after it
                logger.exception("a message on the channel could not be unpickled; it is dropped")
        if eof and not msgs:
            raise EOFError
        return msgs

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
        self._room = _pipe_room(conn) if background else 0

    def __getstate__(self) -> dict[str, Any]:
        return {"conn": self._conn, "background": self._background}  # threads and locks stay in this process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["conn"], state["background"])

    def put(self, msg: Any) -> None:
        """Send `msg` (from the feeder thread when the writer is a background one and the pipe is short of
        room: a small message into a pipe with room is written at once, without waking the feeder)."""
        if not self._background:
            self._send(msg)
            return
        data = ForkingPickler.dumps(msg)  # a view of the pickler's buffer, which it keeps alive
        if self._send_now(data):
            return
        self._queue(data)

    def _send_now(self, data: memoryview) -> bool:
        """Write `data` here if that cannot block: nothing queued before it, the feeder not mid-send, and the
        pipe's free room above it. The engine core puts a message per step: waking the feeder for each cost
        0.13-0.17 ms of CPU and ~4 context switches per token of a single stream (2-core VM), taken from the
        cores the engine decodes on."""
        if self._pending or not self._send_lock.acquire(blocking=False):
            return False
        try:
            if self._pending or len(data) + _queued_bytes(self._conn) > self._room:
                return False
            self._send_locked(data)
            return True
        finally:
            self._send_lock.release()

    def _queue(self, item: Any) -> None:
        self._pending.append(item)
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
            self._queue(done)
            done.wait(timeout)

    def _send(self, msg: Any) -> None:
        with self._send_lock:
            self._send_locked(ForkingPickler.dumps(msg))

    def _send_locked(self, data: memoryview) -> None:
        if self._broken:
            return
        try:
            self._conn.send_bytes(data)
        except (BrokenPipeError, EOFError, OSError):
            self._broken = True

    def _feed(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while True:
                # Popped and sent under the lock, so that `_send_now` never overtakes a message in flight.
                with self._send_lock:
                    if not self._pending:
                        break
                    item = self._pending.popleft()
                    if isinstance(item, threading.Event):  # flush's marker: everything before it is sent
                        item.set()
                    else:
                        self._send_locked(item)


_READ_CHUNK = 1 << 16


def _frame(buf: bytearray) -> tuple[int, int] | None:
    """(start, end) of the first whole message in `buf`, framed as `Connection.send_bytes` frames it (a signed
    big-endian 4-byte length, or -1 and an 8-byte one past 2 GiB); None while it is incomplete."""
    if len(buf) < 4:
        return None
    (n,) = struct.unpack_from("!i", buf)
    start = 4
    if n == -1:
        if len(buf) < 12:
            return None
        (n,) = struct.unpack_from("!Q", buf, 4)
        start = 12
    return (start, start + n) if len(buf) >= start + n else None


def _queued_bytes(conn: Any) -> int:
    """Bytes written to the pipe and not yet read (Linux answers FIONREAD on either end); the whole room where
    the platform does not answer, so that the feeder sends."""
    try:
        buf = array.array("i", [0])
        fcntl.ioctl(conn.fileno(), termios.FIONREAD, buf)
        return buf[0]
    except OSError:
        return 1 << 30


def _pipe_room(conn: Any) -> int:
    """Half the pipe's capacity: a write that fits leaves room to spare (a pipe counts whole pages)."""
    try:
        return fcntl.fcntl(conn.fileno(), getattr(fcntl, "F_GETPIPE_SZ", 1032)) // 2
    except OSError:
        return 4096 // 2
