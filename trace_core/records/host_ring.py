"""A bounded host ring for record bytes on their way from the device to the store writer.

A rollout engine copies the records of a batch of finished requests to the host in one transfer and hands them to
a writer thread. `HostRing` is the only host memory that path uses: one buffer of fixed capacity (pinned when a
GPU is present, so the device-to-host copy is asynchronous), allocated once, handed out first in, first out.
`reserve` waits while the ring is full (backpressure, counted in `RingStats`): bytes the writer has not released
are never overwritten, and host memory stays bounded whatever the KV pool size.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class RingStats:
    """reserves / bytes: spans handed out and their bytes; stalls / stall_s: reserves that waited for space."""

    reserves: int = 0
    bytes: int = 0
    stalls: int = 0
    stall_s: float = 0.0


class HostRing:
    """Fixed-capacity host byte ring with first-in, first-out spans.

    Args:
        capacity: bytes, allocated at construction. pin: page-locked memory (needs CUDA; the device-to-host copy
            into it can then run asynchronously).
    """

    def __init__(self, capacity: int, *, pin: bool) -> None:
        if capacity < 1:
            raise ValueError(f"host ring capacity must be >= 1 byte, got {capacity}")
        self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self.capacity = capacity
        self.stats = RingStats()
        self._cv = threading.Condition()
        self._spans: deque[list[int]] = deque()  # [start, end, released, ticket] in hand-out order
        self._head = 0  # where the next span starts
        self._tickets = 0

    def _fits(self, nbytes: int) -> int | None:
        """Start offset of a free contiguous span of `nbytes` (caller holds the lock), or None."""
        if not self._spans:
            self._head = 0
            return 0
        oldest = self._spans[0][0]
        if self._head > oldest:  # used region [oldest, head): free tail, then free head [0, oldest)
            if self._head + nbytes <= self.capacity:
                return self._head
            return 0 if nbytes <= oldest else None
        return self._head if self._head + nbytes <= oldest else None  # wrapped: free [head, oldest)

    def reserve(self, nbytes: int, timeout: float | None = None) -> tuple[int, torch.Tensor]:
        """A span of `nbytes` as `(ticket, uint8 view)`, waiting while the ring is full (a counted stall) until
        earlier spans are released. Raises ValueError for a span larger than the ring, TimeoutError after
        `timeout` seconds."""
        if not 0 < nbytes <= self.capacity:
            raise ValueError(f"{nbytes} bytes do not fit the host ring of {self.capacity} bytes (raise its size)")
        t0 = time.perf_counter()
        with self._cv:
            start = self._fits(nbytes)
            if start is None:
                self.stats.stalls += 1
                if not self._cv.wait_for(lambda: self._fits(nbytes) is not None, timeout):
                    raise TimeoutError(f"host ring full for {timeout} s ({len(self._spans)} spans in use)")
                start = self._fits(nbytes)
                assert start is not None  # wait_for returned because it fits, under the same lock
                self.stats.stall_s += time.perf_counter() - t0
            self._tickets += 1
            self._spans.append([start, start + nbytes, 0, self._tickets])
            self._head = start + nbytes
            self.stats.reserves += 1
            self.stats.bytes += nbytes
            return self._tickets, self.buffer[start : start + nbytes]

    def release(self, ticket: int) -> None:
        """Hand a span back (any order; space frees up oldest first)."""
        with self._cv:
            for span in self._spans:
                if span[3] == ticket:
                    span[2] = 1
                    break
            else:
                raise ValueError(f"ticket {ticket} is not a span in use")
            while self._spans and self._spans[0][2]:
                self._spans.popleft()
            self._cv.notify_all()

    @property
    def in_use(self) -> int:
        """Spans handed out and not yet freed."""
        with self._cv:
            return len(self._spans)
