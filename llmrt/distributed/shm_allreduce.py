"""A same-host all-reduce and gather over one shared-memory segment, for CPU tensor-parallel ranks.

gloo moves even a 768-wide row through TCP loopback (~0.4-0.8 ms here); ranks on one host can instead write
into a shared segment and meet at a flag barrier (~0.05 ms). Layout of the segment (one per TP group, a file in
/dev/shm created by rank 0 and mapped by every rank, then unlinked at once so a crash leaves nothing behind):

    int64 arrival[size] | int64 pid[size] | int32 wake[size] | (64-byte aligned) data: 2 buffers x size slots x
    capacity bytes

Call g = 1, 2, ...: rank r copies its tensor into slot r of buffer g % 2, stores arrival[r] = g (and wake[r], a
futex word, waking ranks that sleep on it) and waits until every arrival >= g; then every rank sums the slots in rank order (bfloat16/float16 accumulated in float32), so
each rank computes the same bits. Double buffering makes that one barrier per call enough: a rank at call g + 2
overwrites buffer g % 2 only after every rank arrived at call g + 1, i.e. after each finished reading call g.
The flag protocol relies on x86's store order (data stores are seen before the flag store); other CPUs use gloo.
A waiting rank polls for a few microseconds, then sleeps on the late rank's futex word: ranks usually share
cores with each other (and other work), and a sleeping rank is woken at once when the peer arrives instead of
burning the core the peer needs.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import socket
import time
import uuid
from pathlib import Path
from typing import Optional

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "llmrt-tp-"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_CAPACITY = 8 << 20  # bytes per rank's slot: a 2048-token float32 prefill of hidden 1024 fits
_SPIN_S = 200e-6  # how long a waiting rank polls before it sleeps on the futex
_LIVENESS_S = 0.05  # how often a waiting rank checks whether its peers still run
_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64 Linux; shared (not PRIVATE): the word is in a shared map
_libc = ctypes.CDLL(None, use_errno=True) if os.name == "posix" else None  # only used where supported_here()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class CollectiveTimeout(RuntimeError):
    """A peer did not arrive in time (or exited): the same kind of error a timed-out gloo collective raises."""


def supported_here() -> bool:
    """Whether this host can run the shared-memory path: /dev/shm and a CPU with x86's total store order."""
    return SHM_DIR.is_dir() and platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")


def host_id() -> str:
    """This host's identity for 'all ranks on one host': the hostname and the kernel's boot id."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def _pid_alive(pid: int) -> bool:
    """False once `pid` has exited (a zombie counts as exited: rank 0 reaps its spawned ranks late)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class ShmAllReduce:
    """One rank's mapping of its group's segment; `all_reduce` / `gather_to_first` are collective calls that
    every rank makes in the same order with tensors of the same shape and dtype."""

    def __init__(self, path: Path, rank: int, size: int, capacity: int, timeout_s: float):
        self.rank, self.size, self.capacity, self.timeout_s = rank, size, capacity, timeout_s
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, self.segment_bytes(size, capacity))
        finally:
            os.close(fd)
        self._header = memoryview(self._mm)[:16 * size].cast("q")
        self._arrival, self._pids = self._header[:size], self._header[size:]
        self._wake = memoryview(self._mm)[16 * size:20 * size].cast("i")
        anchor = ctypes.c_char.from_buffer(self._mm)  # only for the address (an export would block close)
        self._wake_addr = [ctypes.addressof(anchor) + 16 * size + 4 * r for r in range(size)]
        del anchor
        self._pids[rank] = os.getpid()
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=self.header_bytes(size),
                                count=2 * size * capacity)
        self._slots = data.view(2, size, capacity)
        self._calls = 0
        self._view_cache: dict[tuple[torch.dtype, torch.Size], list[list[torch.Tensor]]] = {}
        self._check_pids = Path("/proc").is_dir()

    @staticmethod
    def header_bytes(size: int) -> int:
        """The counters, pids and futex words of `size` ranks, rounded up to a cache line."""
        return -(-20 * size // 64) * 64

    @staticmethod
    def segment_bytes(size: int, capacity: int) -> int:
        """Bytes of a segment for `size` ranks with `capacity` bytes per slot."""
        return ShmAllReduce.header_bytes(size) + 2 * size * capacity

    @staticmethod
    def create_segment(size: int, capacity: int) -> Path:
        """Rank 0: a fresh zeroed segment file (the caller unlinks it once every rank has mapped it)."""
        path = SHM_DIR / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, ShmAllReduce.segment_bytes(size, capacity))
        finally:
            os.close(fd)
        return path

    def fits(self, t: torch.Tensor) -> bool:
        """Whether `t` can go through the segment (else the caller uses gloo; every rank decides alike)."""
        return t.device.type == "cpu" and t.dtype in DTYPES and t.numel() * t.element_size() <= self.capacity

    def _views(self, t: torch.Tensor) -> list[list[torch.Tensor]]:
        """Per buffer, every rank's slot viewed as `t`'s dtype and shape (cached: a step's calls share a shape,
        and building the views costs more than a small all-reduce's arithmetic)."""
        key = (t.dtype, t.shape)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= 64:
                self._view_cache.clear()
            nbytes = t.numel() * t.element_size()
            views = [[self._slots[b, r, :nbytes].view(t.dtype).view(t.shape) for r in range(self.size)]
                     for b in range(2)]
            self._view_cache[key] = views
        return views

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Publish `t` in this rank's slot and wait until every rank published the same call's; their slots."""
        self._calls += 1
        g = self._calls
        slots = self._views(t)[g % 2]
        slots[self.rank].copy_(t)
        self._arrival[self.rank] = g
        self._wake[self.rank] = g & 0x7FFFFFFF
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._wake_addr[self.rank]), _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
        self._wait(g)
        return slots

    def _wait(self, g: int) -> None:
        arrival = self._arrival
        spin_end = time.perf_counter() + _SPIN_S
        while min(arrival) < g:
            if time.perf_counter() > spin_end:
                break
        else:
            return
        now = time.monotonic()
        deadline, check_at = now + self.timeout_s, now + _LIVENESS_S
        while True:
            late = next((r for r in range(self.size) if arrival[r] < g), None)
            if late is None:
                return
            word = self._wake[late]
            if arrival[late] < g:  # still late after reading its word: sleep until the word changes (or 50 ms)
                wait = min(_LIVENESS_S, max(deadline - now, 0.0))
                ts = _Timespec(int(wait), int((wait % 1) * 1e9))
                _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(self._wake_addr[late]), _FUTEX_WAIT, ctypes.c_int(word),
                              ctypes.byref(ts), None, 0)
            now = time.monotonic()
            if now >= check_at:
                check_at = now + _LIVENESS_S
                self._check_peers(g)
            if now >= deadline:
                late_ranks = [r for r in range(self.size) if arrival[r] < g]
                if late_ranks:
                    raise CollectiveTimeout(f"shared-memory collective {g} timed out after {self.timeout_s:g} s "
                                            f"waiting for rank(s) {late_ranks}")

    def _check_peers(self, g: int) -> None:
        if not self._check_pids:
            return
        for r in range(self.size):
            if self._arrival[r] < g and not _pid_alive(self._pids[r]):
                raise CollectiveTimeout(f"shared-memory collective {g}: rank {r} (pid {self._pids[r]}) exited")

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks in place (the same bits on every rank); returns it."""
        slots = self._exchange(t)
        if t.dtype == torch.float32:
            torch.add(slots[0], slots[1], out=t)
            for s in slots[2:]:
                t.add_(s)
        else:
            acc = slots[0].float()
            for s in slots[1:]:
                acc.add_(s)
            t.copy_(acc)
        return t

    def gather_to_first(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """Rank 0: every rank's `t` concatenated along the last dim; other ranks: None."""
        slots = self._exchange(t)
        return torch.cat(slots, dim=-1) if self.rank == 0 else None

    def close(self) -> None:
        """Unmap the segment (tensors viewing it must be gone)."""
        self._slots = None  # type: ignore[assignment]
        self._view_cache.clear()
        for view in (self._arrival, self._pids, self._header, self._wake):
            view.release()
        with contextlib.suppress(BufferError):
            self._mm.close()
