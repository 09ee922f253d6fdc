"""`SlotFence`: KV slots freed while the finish path still reads them, held back from SGLang's allocator.

The finish path (`TraceCapturer.on_batch_done`) reads a finished request's record rows and K/V bytes from the device
stores keyed by KV slot and copies them to the host ring. SGLang frees the request's slots right after its finish
hook, and a later forward may reuse them. Rather than make the scheduler thread wait for the copies (the host link
moves the 310 MB of a 16K-token request at the default policy in about 5 ms), the capturer queues the gathers and
copies on a stream of their own, and the fence holds every slot freed from the first finished request of a result
batch until the copies queued after it completed:
  * `arm` (a request's records will be copied) starts holding frees; `seal(done)` (the batch's copies are queued,
    `done` their completion event) ties the frees held so far to it; frees while sealed copies run join the newest;
  * `release` gives back the slots whose copies completed (`done.query()`, no wait), after every forward;
  * an allocation that fails while slots are held waits for the copies (`drain`) and runs again (counted in
    `stats`), so no request is refused memory that the fence holds;
  * `available_size` counts the held slots, so SGLang's admission, retraction and idle leak check see the pool as
    if they had been freed.
The fence takes over the allocator instance's `free`, `alloc*`, `available_size` and `clear` (SGLang's
`TokenToKVPoolAllocator` and `PagedTokenToKVPoolAllocator`, the allocators of the models TRACE supports); another
allocator is refused by name.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

SUPPORTED = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")


class Done(Protocol):
    """A completion marker of queued device work (`torch.cuda.Event`)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass
class FenceStats:
    """What the fence did: frees held, slots given back, allocations that waited for copies (and for how long)."""

    held_frees: int = 0
    released_slots: int = 0
    alloc_waits: int = 0
    alloc_wait_s: float = 0.0


class SlotFence:
    """Holds the slots freed on `allocator` while the finish path's copies may still read them (module docstring)."""

    def __init__(self, allocator) -> None:
        name = type(allocator).__name__
        if name not in SUPPORTED:
            raise ValueError(
                f"TRACE's finish path holds freed KV slots until their records are copied, which it supports on "
                f"{', '.join(SUPPORTED)}; this server's KV allocator is {name}"
            )
        self.allocator = allocator
        self.page_size: int = allocator.page_size
        self.stats = FenceStats()
        self._armed = False
        self._open: list[tuple[torch.Tensor, int]] = []  # (free_index, tokens) since `arm`, not tied to a copy
        self._held: deque[tuple[Done | None, list[tuple[torch.Tensor, int]]]] = deque()  # (copies' end, frees)
        self._held_tokens = 0
        self._free, self._available = allocator.free, allocator.available_size
        self._clear = allocator.clear
        allocator.free, allocator.available_size, allocator.clear = self.free, self.available_size, self.clear
        for method in ("alloc", "alloc_extend", "alloc_decode"):
            setattr(allocator, method, self._allocating(getattr(allocator, method)))

    @property
    def held_tokens(self) -> int:
        """Slots (in tokens, whole pages) the fence holds now."""
        return self._held_tokens

    def arm(self) -> None:
        """A finished request's records will be copied: hold every free from now until `seal`."""
        self._armed = True

    def seal(self, done: Done | None) -> None:
        """The copies of the armed frees are queued; `done` marks their completion (None: they already ran)."""
        if self._open or done is not None:  # frees after this one (evictions) wait for the newest copies
            self._held.append((done, self._open))
            self._open = []
        self._armed = False
        self.release()

    def free(self, free_index: torch.Tensor) -> None:
        """SGLang's `free`: held while armed or while sealed copies run, else passed on."""
        if free_index.numel() == 0:
            return
        if not self._armed and not self._held:
            self._free(free_index)
            return
        held = (free_index, self._tokens(free_index))
        (self._open if self._armed else self._held[-1][1]).append(held)
        self.stats.held_frees += 1
        self._held_tokens += held[1]

    def available_size(self) -> int:
        """SGLang's `available_size`, counting the held slots as free."""
        return self._available() + self._held_tokens

    def release(self) -> None:
        """Give back the slots whose copies completed (no wait)."""
        while self._held and (self._held[0][0] is None or self._held[0][0].query()):
            self._give_back(self._held.popleft()[1])

    def drain(self) -> None:
        """Wait for every sealed copy and give back its slots (the frees of an unsealed batch stay held)."""
        while self._held:
            done, frees = self._held.popleft()
            if done is not None:
                done.synchronize()
            self._give_back(frees)

    def clear(self) -> None:
        """SGLang's `clear` (the pool emptied, every slot free): wait for the copies, drop what is held."""
        self.drain()
        self._open, self._armed, self._held_tokens = [], False, 0
        self._clear()

    def _allocating(self, alloc):
        """`alloc` that, when it fails while sealed copies hold slots, waits for them and tries once more."""

        def allocate(*args, **kwargs):
            self.release()
            out = alloc(*args, **kwargs)
            if out is None and self._held:
                t0 = time.perf_counter()
                self.drain()
                self.stats.alloc_waits += 1
                self.stats.alloc_wait_s += time.perf_counter() - t0
                out = alloc(*args, **kwargs)
            return out

        return allocate

    def _give_back(self, frees: list[tuple[torch.Tensor, int]]) -> None:
        if not frees:
            return
        index = frees[0][0] if len(frees) == 1 else torch.cat([f for f, _ in frees])
        tokens = sum(n for _, n in frees)
        self._held_tokens -= tokens
        self.stats.released_slots += tokens
        self._free(index)

    def _tokens(self, free_index: torch.Tensor) -> int:
        """Tokens `free_index` gives back: its slots, or the whole pages they lie in (the paged allocator frees
        pages)."""
        if self.page_size == 1:
            return free_index.numel()
        return torch.unique(free_index // self.page_size).numel() * self.page_size
