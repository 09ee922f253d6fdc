"""Colocation memory handoff (`colocate = true`): the SGLang servers and the trainer share the GPUs, so the servers give
their GPU memory back while the trainer steps and take it again for the next rollout.

The servers run with `--enable-memory-saver` (SGLang's torch_memory_saver regions around the weights, the KV cache
and the CUDA graphs; the launcher adds the flag, `trace_rl.servers`). SGLang 0.5.15's endpoints
(`http_server.py`, `scheduler_components/weight_updater.py`): `/release_memory_occupation {"tags": [...]}` pauses
the regions of the tags (no tags: all of `kv_cache`, `weights`, `cuda_graph`; the KV cache is flushed, the model's
non-parameter buffers stashed; the server must be idle), `/resume_memory_occupation {"tags": [...]}` maps them
again. The weights' contents are not kept (no `--enable-weights-cpu-backup`): after resuming `weights` a server
must be given the policy again before it generates. So the pool's order is, around every trainer step:

1. `release` every server (all tags) after the rollout, before the trainer step;
2. `resume` `weights` after the trainer step, then the weight sync (every bucket of the new policy),
3. `resume` `kv_cache` and `cuda_graph`, then the next rollout.

Both routes answer 200 with an empty body on success and 400 with the error otherwise. A server that does not report
`enable_memory_saver` in its `/server_info` is refused at start-up: its release would free nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trace_rl.rollout.sglang_worker import SGLangWorker

WEIGHTS = ("weights",)  # sglang.srt.constants.GPU_MEMORY_TYPE_WEIGHTS
REST = ("kv_cache", "cuda_graph")  # GPU_MEMORY_TYPE_KV_CACHE, GPU_MEMORY_TYPE_CUDA_GRAPH
ALL = WEIGHTS + REST  # GPU_MEMORY_ALL_TYPES
AWAKE, RELEASED, WEIGHTS_BACK = "awake", "released", "weights back"


class MemoryHandoff:
    """The memory state of each server of a pool and the calls that move it (`release`, `resume_weights`,
    `resume_rest`); each call goes to every server concurrently, each bounded by `sglang_timeout_s`."""

    def __init__(self, workers: Sequence[SGLangWorker]):
        from trace_rl.rollout.sglang_worker import SGLangError

        self.workers = list(workers)
        off = [w.url for w in self.workers if w.server_info.get("enable_memory_saver") is not True]
        if off:
            raise SGLangError(
                f"colocate=true needs SGLang servers started with --enable-memory-saver; {off} report "
                "enable_memory_saver false in /server_info (the launcher adds the flag to the servers it starts; "
                "add it to servers you start yourself)"
            )
        self.state = [AWAKE] * len(self.workers)

    @property
    def asleep(self) -> bool:
        """Whether some server's weights or KV cache are released (it cannot generate yet)."""
        return any(s != AWAKE for s in self.state)

    def awake(self, i: int) -> None:
        """Server `i` was started again: it holds all its memory."""
        self.state[i] = AWAKE

    def _post(self, endpoint: str, tags: Sequence[str], frm: str, to: str) -> float:
        """`endpoint` with `tags` to every server in state `frm`, concurrently; they move to `to`. Seconds taken."""
        todo = [i for i, s in enumerate(self.state) if s == frm]
        start = time.perf_counter()
        if not todo:
            return 0.0
        with ThreadPoolExecutor(max_workers=len(todo), thread_name_prefix="memory") as ex:
            futures = {i: ex.submit(self.workers[i].post_memory, endpoint, list(tags)) for i in todo}
        errors: list[BaseException] = []
        for i, f in futures.items():
            error = f.exception()
            if error is None:
                self.state[i] = to
            else:
                errors.append(error)
        if errors:
            raise errors[0]
        return time.perf_counter() - start

    def release(self) -> float:
        """Every awake server releases its weights, KV cache and CUDA graphs (before the trainer step)."""
        return self._post("/release_memory_occupation", ALL, AWAKE, RELEASED)

    def resume_weights(self) -> float:
        """Every released server maps its weights again (contents undefined until the weight sync that follows)."""
        return self._post("/resume_memory_occupation", WEIGHTS, RELEASED, WEIGHTS_BACK)

    def resume_rest(self) -> float:
        """Every server whose weights are back (and synced) maps its KV cache and CUDA graphs again."""
        return self._post("/resume_memory_occupation", REST, WEIGHTS_BACK, AWAKE)
