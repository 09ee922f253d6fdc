"""Moving staged record rows from the GPU into a host store indexed by KV slot, without stalling the forward.

The capturer's staging buffer is one uint8 tensor `[max_tokens, row_bytes]` (a token's records of every site side
by side), and the host store is `[num_slots, row_bytes]`. After each forward, `AsyncHostRing.submit`:
  1. copies the forward's rows and its KV slots (`out_cache_loc`) into a free entry of a device-side ring, on the
     forward's stream (a short device-to-device copy), so the next forward may overwrite the staging buffer;
  2. on a side stream that waits for (1), copies that entry into the matching pinned host entry (async D2H) and
     records a CUDA event.
Entries whose event has completed are scattered into the host store in submission order (`poll`), so a slot
reused by a later forward always ends with the later rows. A full ring makes `submit` wait for the oldest copy
(a counted stall): unread rows are never overwritten. `SyncHostRing` is the same interface for CPU tensors.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class RingStats:
    """Counters of the capture path.

    forwards / rows / bytes: forwards submitted, token rows and bytes moved to the host;
    stalls / stall_s: times (and seconds) a forward found the ring full and waited for the oldest copy;
    waits / wait_s: times (and seconds) a reader (gather, flush) had to wait for copies still in flight.
    """

    forwards: int = 0
    rows: int = 0
    bytes: int = 0
    stalls: int = 0
    stall_s: float = 0.0
    waits: int = 0
    wait_s: float = 0.0


def _check_submit(staging: torch.Tensor, start: int, rows: int, slots: torch.Tensor) -> None:
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"out_cache_loc must be a 1-D int32/int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    if slots.device != staging.device:
        raise ValueError(f"out_cache_loc is on {slots.device}, staging is on {staging.device}")
    if start < 0 or start + rows > staging.shape[0]:
        raise ValueError(f"rows [{start}, {start + rows}) exceed the staging buffer of {staging.shape[0]} tokens")


def _scatter(store: torch.Tensor, written: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= store.shape[0]):
        raise ValueError(f"KV slots out of range [0, {store.shape[0]}): min {int(slots.min())}, max {int(slots.max())}")
    store.index_copy_(0, slots, rows)
    written[slots] = True


class SyncHostRing:
    """CPU path: `submit` writes the rows into the host store at once."""

    def __init__(self, staging: torch.Tensor, store: torch.Tensor, written: torch.Tensor) -> None:
        self.staging, self.store, self.written = staging, store, written
        self.stats = RingStats()

    def submit(self, start: int, slots: torch.Tensor) -> int:
        """Write rows [start, start + len(slots)) into the host store at `slots`; returns the forward id."""
        rows = slots.shape[0]
        _check_submit(self.staging, start, rows, slots)
        _scatter(self.store, self.written, slots.long(), self.staging[start : start + rows])
        self.stats.forwards += 1
        self.stats.rows += rows
        self.stats.bytes += rows * self.staging.shape[1]
        return self.stats.forwards - 1

    def poll(self) -> None:
        """Nothing is ever in flight on the CPU path."""

    def flush(self, upto: int | None = None) -> None:
        """Nothing is ever in flight on the CPU path."""

    def close(self) -> None:
        """Nothing to stop on the CPU path."""


class AsyncHostRing:
    """CUDA path: device snapshot ring + side-stream D2H into a pinned host ring (see module docstring).

    With `drain_thread`, a background thread waits for the copies and scatters them into the host store, so the
    scheduler thread spends no CPU time on it (the scatter releases the GIL); otherwise `submit`, `poll` and
    `flush` drain completed copies on the calling thread. An error while draining (e.g. a KV slot out of range)
    is raised by the next `submit` or `flush`.
    """

    def __init__(
        self, staging: torch.Tensor, store: torch.Tensor, written: torch.Tensor, depth: int, drain_thread: bool
    ) -> None:
        if depth < 1:
            raise ValueError(f"ring depth must be >= 1, got {depth}")
        self.staging, self.store, self.written = staging, store, written
        max_tokens, row_bytes = staging.shape
        dev = staging.device
        self.dev_rows = torch.empty(depth, max_tokens, row_bytes, dtype=torch.uint8, device=dev)
        self.dev_slots = torch.empty(depth, max_tokens, dtype=torch.int64, device=dev)
        self.host_rows = torch.empty(depth, max_tokens, row_bytes, dtype=torch.uint8, pin_memory=True)
        self.host_slots = torch.empty(depth, max_tokens, dtype=torch.int64, pin_memory=True)
        self.side = torch.cuda.Stream(device=dev)
        self.events = [torch.cuda.Event() for _ in range(depth)]
        self.free = deque(range(depth))
        self.pending: deque[tuple[int, int, int]] = deque()  # (entry, rows, forward id), oldest first
        self.stats = RingStats()
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = None
        if drain_thread:
            self._thread = threading.Thread(target=self._drain_loop, name="trace-record-drain", daemon=True)
            self._thread.start()

    def submit(self, start: int, slots: torch.Tensor) -> int:
        """Queue rows [start, start + len(slots)) of the staging buffer for the host store at `slots`; returns the
        forward id (0, 1, ...) that `flush(upto=...)` waits for."""
        rows = slots.shape[0]
        _check_submit(self.staging, start, rows, slots)
        self.poll()
        with self._cv:
            if not self.free:
                t0 = time.perf_counter()
                while not self.free:
                    if self._thread is None:
                        self._drain_oldest()
                    else:
                        self._cv.wait()
                self.stats.stalls += 1
                self.stats.stall_s += time.perf_counter() - t0
            entry = self.free.popleft()
        compute = torch.cuda.current_stream(self.staging.device)
        self.dev_rows[entry, :rows].copy_(self.staging[start : start + rows])
        self.dev_slots[entry, :rows].copy_(slots)
        self.side.wait_stream(compute)
        with torch.cuda.stream(self.side):
            self.host_rows[entry, :rows].copy_(self.dev_rows[entry, :rows], non_blocking=True)
            self.host_slots[entry, :rows].copy_(self.dev_slots[entry, :rows], non_blocking=True)
            self.events[entry].record(self.side)
        with self._cv:
            forward = self.stats.forwards
            self.pending.append((entry, rows, forward))
            self.stats.forwards += 1
            self.stats.rows += rows
            self.stats.bytes += rows * self.staging.shape[1]
            self._cv.notify_all()
        return forward

    def _scatter_entry(self, entry: int, rows: int) -> None:
        self.events[entry].synchronize()
        _scatter(self.store, self.written, self.host_slots[entry, :rows], self.host_rows[entry, :rows])

    def _drain_oldest(self) -> None:
        """Calling-thread drain (caller holds the lock): wait for the oldest copy and scatter it."""
        entry, rows, _ = self.pending[0]
        try:
            self._scatter_entry(entry, rows)
        finally:
            self.pending.popleft()
            self.free.append(entry)

    def _drain_loop(self) -> None:
        while True:
            with self._cv:
                while not self.pending and not self._closed:
                    self._cv.wait()
                if not self.pending:
                    return
                entry, rows, _ = self.pending[0]
            try:
                self._scatter_entry(entry, rows)
            except BaseException as e:  # surfaced by the next submit / flush
                with self._cv:
                    self._error = self._error or e
            with self._cv:
                self.pending.popleft()
                self.free.append(entry)
                self._cv.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def poll(self) -> None:
        """Move every completed copy, oldest first, into the host store; never blocks."""
        with self._cv:
            self._raise_error()
            if self._thread is None:
                while self.pending and self.events[self.pending[0][0]].query():
                    self._drain_oldest()

    def flush(self, upto: int | None = None) -> None:
        """Wait until the copies of forwards up to id `upto` (default: all submitted) are in the host store; a
        counted wait if any was still in flight. Later forwards keep running: under an overlap scheduler the
        forward already launched is not waited for."""
        self.poll()
        with self._cv:

            def needed() -> bool:
                return bool(self.pending) and (upto is None or self.pending[0][2] <= upto)

            if needed():
                t0 = time.perf_counter()
                while needed():
                    if self._thread is None:
                        self._drain_oldest()
                    else:
                        self._cv.wait()
                self.stats.waits += 1
                self.stats.wait_s += time.perf_counter() - t0
            self._raise_error()

    def close(self) -> None:
        """Drain what is in flight and stop the drain thread."""
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
