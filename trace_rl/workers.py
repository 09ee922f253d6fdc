"""Rollout workers and the pools that run them: in-process (`LocalPool`) or as Ray actors (`RayPool`).

A worker owns an `EmbeddedEngine`. One request = some GRPO groups of one step; the worker writes the request's
records into the step's record store as one shard (named by the request, so a rerun replaces it) and returns the
trajectories without records: the trainer reads records from the store, never inline. A pool restarts a worker
that dies mid-request (a lost process, `WorkerDied` in-process), loads it with the current policy version and runs
the request again with the same seed; restarts are counted.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trace_core.records import RecordSpec
from trace_core.store import StepWriter
from trace_rl.config import RLConfig
from trace_rl.engine import EmbeddedEngine, Trajectory, WorkerDied
from trace_rl.policy import RolloutTask


@dataclass(frozen=True)
class Request:
    """Rows `rows` of a step's batch (prompt token ids, any lengths), sampled with `seed`; records go to `store`
    under the request id `index` (`store = ""`: no records, an evaluation)."""

    index: int
    step: int
    prompts: Sequence[torch.Tensor]
    rows: tuple[int, ...]
    seed: int
    store: str


class RolloutWorker:
    def __init__(self, cfg: RLConfig, spec: RecordSpec, task: RolloutTask):
        self.cfg, self.task = cfg, task
        self.engine = EmbeddedEngine(
            task.hf_dir,
            fp4=cfg.mode != "bf16",
            spec=spec,
            max_batch=cfg.prompts_per_step * cfg.group_size,
            max_len=task.max_len,
            device=cfg.device,
        )

    def generate(self, req: Request) -> list[Trajectory]:
        """The engine samples prompts of one length as one batch: one batch per prompt length, the k-th seeded
        `req.seed + k`."""
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(req.prompts):
            by_len.setdefault(len(p), []).append(i)
        out: list[Trajectory] = [None] * len(req.prompts)
        for k, rows in enumerate(by_len.values()):
            prompts = torch.stack([req.prompts[i] for i in rows])
            trajs = self.engine.generate(
                prompts, self.cfg.max_new_tokens, eos=self.task.eos, seed=req.seed + k, temperature=self.cfg.temperature
            )
            for i, t in zip(rows, trajs, strict=True):
                out[i] = t
        if req.store:
            writer = StepWriter(req.store, req.step, writer_id=f"request{req.index}")
            writer.write({r: t.records for r, t in zip(req.rows, out, strict=True)})
        return [dataclasses.replace(t, records=None) for t in out]

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(tensors, version)

    def version(self) -> int:
        return self.engine.version

    def kill(self) -> None:
        """In-process: the next forward raises `WorkerDied`."""
        self.engine.alive = False

    def exit_after(self, forwards: int) -> None:
        """Fault injection for chaos tests of a worker process: it exits during its `forwards`-th forward."""
        count = [0]

        def hook(module, args, output):
            count[0] += 1
            if count[0] == forwards:
                os._exit(1)

        self.engine.model.register_forward_hook(hook)


def init_ray() -> None:
    """Join the Ray cluster of `RAY_ADDRESS`, or start a new local one (no dashboard)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False, log_to_driver=False)


class _Pool:
    def __init__(self, cfg: RLConfig, spec: RecordSpec, task: RolloutTask):
        self.cfg, self.spec, self.task = cfg, spec, task
        self.weights: tuple[object, int] | None = None  # the latest policy pushed to the workers
        self.workers = [self._start() for _ in range(cfg.rollout_workers)]

    def _check_restarts(self, restarts: int, step: int) -> None:
        if restarts > self.cfg.max_restarts:
            raise RuntimeError(f"step {step}: rollout workers died {restarts} times (max_restarts exceeded)")


class LocalPool(_Pool):
    """Workers in this process, run one request after another."""

    def _start(self) -> RolloutWorker:
        worker = RolloutWorker(self.cfg, self.spec, self.task)
        if self.weights is not None:
            worker.load_weights(*self.weights)
        return worker

    def run(self, requests: Sequence[Request]) -> tuple[list[list[Trajectory]], int]:
        out, restarts = [], 0
        for req in requests:
            w = req.index % len(self.workers)
            while True:
                try:
                    out.append(self.workers[w].generate(req))
                    break
                except WorkerDied:
                    restarts += 1
                    self._check_restarts(restarts, req.step)
                    self.workers[w] = self._start()
        return out, restarts

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.weights = (tensors, version)
        for worker in self.workers:
            worker.load_weights(tensors, version)

    def versions(self) -> list[int]:
        return [w.version() for w in self.workers]


class RayPool(_Pool):
    """Workers as Ray actors (one process each), requests in flight concurrently."""

    def __init__(self, cfg: RLConfig, spec: RecordSpec, task: RolloutTask):
        import ray

        init_ray()
        self._actor = ray.remote(RolloutWorker).options(num_cpus=0, max_restarts=0)
        super().__init__(cfg, spec, task)

    def _start(self):
        import ray

        worker = self._actor.remote(self.cfg, self.spec, self.task)
        if self.weights is not None:
            ray.get(worker.load_weights.remote(*self.weights))
        return worker

    def run(self, requests: Sequence[Request]) -> tuple[list[list[Trajectory]], int]:
        import ray
        from ray.exceptions import RayActorError

        out: dict[int, list[Trajectory]] = {}
        restarts = 0
        inflight = {self.workers[r.index % len(self.workers)].generate.remote(r): r for r in requests}
        while inflight:
            done, _ = ray.wait(list(inflight), num_returns=1)
            req = inflight.pop(done[0])
            try:
                out[req.index] = ray.get(done[0])
            except RayActorError:
                restarts += 1
                self._check_restarts(restarts, req.step)
                w = req.index % len(self.workers)
                self.workers[w] = self._start()
                inflight[self.workers[w].generate.remote(req)] = req
        return [out[r.index] for r in requests], restarts

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        import ray

        self.weights = (ray.put(tensors), version)
        ray.get([w.load_weights.remote(*self.weights) for w in self.workers])

    def versions(self) -> list[int]:
        import ray

        return ray.get([w.version.remote() for w in self.workers])
