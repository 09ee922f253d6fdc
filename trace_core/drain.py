"""An ordered job queue for the capture path: host-side work that must happen in submission order.

The capture ring queues one job per forward (wait for its D2H copy, scatter the rows into the host store by KV
slot) and, at request finish, jobs that read or clear slots of the host store. Running them strictly in order is
what makes slot reuse safe: a job sees every earlier forward's rows and none of a later one's. Jobs run on a
background thread (`thread=True`; the scheduler thread then spends no CPU time on them) or inline, on the calling
thread, whenever it polls or waits. Each job carries a tag (the forward id it belongs to) so callers can wait for
the jobs up to a tag. A failed job's exception goes to its future; jobs submitted with `report=True` (nobody
holds their future) also re-raise it from the next `poll` or `wait_*` call.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Job:
    fn: Callable[[], Any]
    tag: int
    ready: Callable[[], bool] | None
    report: bool
    future: Future = field(default_factory=Future)


class DrainQueue:
    """Runs jobs one at a time in submission order (see module docstring)."""

    def __init__(self, thread: bool, name: str = "trace-drain") -> None:
        self.cv = threading.Condition()
        self.jobs: deque[_Job] = deque()
        self.running: _Job | None = None
        self.completed = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True) if thread else None
        if self._thread is not None:
            self._thread.start()

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def put(
        self, fn: Callable[[], Any], tag: int, *, ready: Callable[[], bool] | None = None, report: bool = True
    ) -> Future:
        """Queue `fn`; `ready()` says (inline mode) whether running it now would not block."""
        job = _Job(fn, tag, ready, report)
        with self.cv:
            if self._closed:
                raise RuntimeError("the drain queue is closed")
            self.jobs.append(job)
            self.cv.notify_all()
        return job.future

    def _run(self, job: _Job) -> None:
        try:
            job.future.set_result(job.fn())
        except BaseException as e:
            job.future.set_exception(e)
            if job.report:
                with self.cv:
                    self._error = self._error or e

    def _step_inline(self) -> None:
        job = self.jobs.popleft()
        self.running = job
        try:
            self._run(job)
        finally:
            self.running = None
            self.completed += 1
            self.cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.jobs and not self._closed:
                    self.cv.wait()
                if not self.jobs:
                    return
                job = self.jobs.popleft()
                self.running = job
            self._run(job)
            with self.cv:
                self.running = None
                self.completed += 1
                self.cv.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def poll(self) -> None:
        """Inline mode: run the leading jobs that are ready. Both modes: re-raise a reported error."""
        with self.cv:
            if self._thread is None:
                while self.jobs and (self.jobs[0].ready is None or self.jobs[0].ready()):
                    self._step_inline()
            self._raise()

    def wait_for(self, predicate: Callable[[], bool]) -> bool:
        """Block until `predicate()` (evaluated under the queue's lock) holds, running jobs inline or waiting for
        the thread; returns whether it had to wait."""
        with self.cv:
            waited = False
            while not predicate():
                waited = True
                if self._thread is not None:
                    self.cv.wait()
                elif self.jobs:
                    self._step_inline()
                else:
                    raise RuntimeError("no queued job can satisfy the wait")
            self._raise()
            return waited

    def busy_upto(self, tag: int | None) -> bool:
        """Whether a job with tag <= `tag` (any job, for None) is queued or running. Call under `cv`."""
        head = self.running or (self.jobs[0] if self.jobs else None)
        return head is not None and (tag is None or head.tag <= tag)

    def wait_upto(self, tag: int | None) -> bool:
        """Wait until every job with tag <= `tag` (every job, for None) has run; returns whether it had to wait."""
        return self.wait_for(lambda: not self.busy_upto(tag))

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        self.wait_upto(None)
        with self.cv:
            self._closed = True
            self.cv.notify_all()
        if self._thread is not None:
            self._thread.join()
