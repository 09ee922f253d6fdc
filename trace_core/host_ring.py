"""Moving staged record rows from the GPU into a host store indexed by KV slot, without stalling the forward.

The capturer's staging buffer is one uint8 tensor `[max_tokens, row_bytes]` (a token's records of every site side
by side), and the host store is `[num_slots, row_bytes]`. After each forward, `AsyncHostRing.submit`:
  1. copies the forward's rows and its KV slots (`out_cache_loc`) into a free entry of a device-side ring, on the
     forward's stream (a short device-to-device copy), so the next forward may overwrite the staging buffer;
  2. on a side stream that waits for (1), copies that entry into the matching pinned host entry (async D2H) and
     records a CUDA event.
Entries whose event has completed are scattered into the host store in submission order (`trace_core.drain`),
so a slot reused by a later forward always ends with the later rows. A full ring makes `submit` wait for the oldest copy
(a counted stall): unread rows are never overwritten. `SyncHostRing` is the same interface for CPU tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from trace_core.drain import DrainQueue


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
    """CPU path: `submit` writes the rows into the host store at once; jobs run at once."""

    threaded = False

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

    def run_after(self, fn: Callable[[], Any], report: bool = False) -> Future:
        """Run `fn` now (every submitted forward is already in the host store); its result or error in a future.
        With `report`, an error is raised here too."""
        future: Future = Future()
        try:
            future.set_result(fn())
        except Exception as e:
            future.set_exception(e)
            if report:
                raise
        return future

    def poll(self) -> None:
        """Nothing is ever in flight on the CPU path."""

    def flush(self, upto: int | None = None) -> None:
        """Nothing is ever in flight on the CPU path."""

    def close(self) -> None:
        """Nothing to stop on the CPU path."""


class AsyncHostRing:
    """CUDA path: device snapshot ring + side-stream D2H into a pinned host ring (see module docstring).

    The host-side work (wait for a copy, scatter it by KV slot) runs as jobs of a `DrainQueue`, in submission
    order: on a background thread with `drain_thread` (the scheduler thread spends no CPU time on it; the scatter
    releases the GIL), else on the calling thread in `submit`, `poll` and `flush`. An error while draining (e.g.
    a KV slot out of range) is raised by the next `submit`, `poll` or `flush`.
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
        self.queue = DrainQueue(drain_thread, "trace-record-drain")
        self.free = deque(range(depth))  # ring entries not in flight; guarded by queue.cv
        self.stats = RingStats()

    @property
    def threaded(self) -> bool:
        return self.queue.threaded

    def submit(self, start: int, slots: torch.Tensor) -> int:
        """Queue rows [start, start + len(slots)) of the staging buffer for the host store at `slots`; returns the
        forward id (0, 1, ...) that `flush(upto=...)` waits for."""
        rows = slots.shape[0]
        _check_submit(self.staging, start, rows, slots)
        self.queue.poll()
        t0 = time.perf_counter()
        if self.queue.wait_for(lambda: bool(self.free)):
            self.stats.stalls += 1
            self.stats.stall_s += time.perf_counter() - t0
        with self.queue.cv:
            entry = self.free.popleft()
        compute = torch.cuda.current_stream(self.staging.device)
        self.dev_rows[entry, :rows].copy_(self.staging[start : start + rows])
        self.dev_slots[entry, :rows].copy_(slots)
        self.side.wait_stream(compute)
        with torch.cuda.stream(self.side):
            self.host_rows[entry, :rows].copy_(self.dev_rows[entry, :rows], non_blocking=True)
            self.host_slots[entry, :rows].copy_(self.dev_slots[entry, :rows], non_blocking=True)
            self.events[entry].record(self.side)
        forward = self.stats.forwards
        self.stats.forwards += 1
        self.stats.rows += rows
        self.stats.bytes += rows * self.staging.shape[1]
        self.queue.put(lambda: self._scatter_entry(entry, rows), forward, ready=self.events[entry].query)
        return forward

    def _scatter_entry(self, entry: int, rows: int) -> None:
        try:
            self.events[entry].synchronize()
            _scatter(self.store, self.written, self.host_slots[entry, :rows], self.host_rows[entry, :rows])
        finally:
            with self.queue.cv:
                self.free.append(entry)

    def run_after(self, fn: Callable[[], Any], report: bool = False) -> Future:
        """Run `fn` once every forward submitted so far is in the host store, before any later one is; on the
        drain thread (returns at once) or, inline, now. With `report`, an error is also raised by the next
        `submit`, `poll` or `flush` (or here, inline)."""
        future = self.queue.put(fn, self.stats.forwards - 1, report=report)
        if not self.threaded:
            self.queue.wait_for(future.done)
        return future

    def poll(self) -> None:
        """Move every completed copy, oldest first, into the host store; never blocks."""
        self.queue.poll()

    def flush(self, upto: int | None = None) -> None:
        """Wait until the copies of forwards up to id `upto` (default: all submitted) are in the host store; a
        counted wait if any was still in flight. Later forwards keep running: under an overlap scheduler the
        forward already launched is not waited for."""
        self.queue.poll()
        t0 = time.perf_counter()
        if self.queue.wait_upto(upto):
            self.stats.waits += 1
            self.stats.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        """Drain what is in flight and stop the drain thread."""
        self.queue.close()
