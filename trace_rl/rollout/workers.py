"""Rollout workers and the pools that run them: in-process (`LocalPool`) or as Ray actors (`RayPool`).

A worker owns an `EmbeddedEngine` (with `fp4_attention = "decode"` the `FP4AttentionEngine`, whose decode
attention reads SGLang's FP4 KV pool). One request = some GRPO groups of one step, run as one attempt (a fresh
attempt id per try); the worker writes the request's records into the step's record store as one shard under a
writer id of its own, each trajectory bound to (step, policy version, trajectory, attempt, token digest), and
returns the trajectories without records: the trainer reads records from the store, never inline. A pool restarts
a worker that dies mid-request (a lost process, `WorkerDied` in-process) or misses the per-call deadline
`rollout_call_timeout_s`, loads it with the current policy version and runs the request again with the same seed
as a new attempt (the earlier attempt's shard, if any, is set aside when the step is finalized); restarts are
counted. A step that exceeds `rollout_step_timeout_s` fails with `RolloutTimeout`. A weight sync gives each worker
`weight_sync_timeout_s`: a worker that misses it (or dies) is named on stderr, replaced and synced again, at most
`max_restarts` times a sync. `check_results` validates every pool's output as the SGLang worker validates answers.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from trace_core.records.spec import Binding, RecordSpec, token_digest
from trace_core.records.store import StepWriter
from trace_rl.config import RLConfig
from trace_rl.policy import RolloutTask
from trace_rl.rollout.engine import EmbeddedEngine, Trajectory, WorkerDied
from trace_rl.rollout.fp4_kv_engine import FP4AttentionEngine


class RolloutTimeout(RuntimeError):
    """A rollout request or step missed its deadline."""


class InvalidRollout(RuntimeError):
    """A rollout worker returned output the trainer cannot use; the message names the step, worker and trajectory."""


def check_results(
    requests: Sequence[Request], results: Sequence[Sequence[Trajectory]], max_new_tokens: int, vocab: int
) -> None:
    """Validate every pool's output at the boundary, as the SGLang worker validates an answer: one trajectory per
    row, each the request's prompt then 1..`max_new_tokens` token ids of the vocabulary, one finite log-prob <= 0
    per response token, an attempt id (records are matched by it); `InvalidRollout` names the first that is not."""
    if len(results) != len(requests):
        raise InvalidRollout(f"the rollout pool returned {len(results)} results for {len(requests)} requests")
    for req, out in zip(requests, results, strict=True):
        where = f"step {req.step}: rollout request {req.index}"
        if len(out) != len(req.rows):
            raise InvalidRollout(
                f"{where} returned {len(out)} trajectories for its {len(req.rows)} rows {list(req.rows)}"
            )
        for row, prompt, t in zip(req.rows, req.prompts, out, strict=True):
            _check_trajectory(f"{where}, trajectory {row}", req, prompt, t, max_new_tokens, vocab)


def _check_trajectory(
    where: str, req: Request, prompt: torch.Tensor, t: Trajectory, max_new_tokens: int, vocab: int
) -> None:
    tokens, logprobs = t.tokens, t.logprobs
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        raise InvalidRollout(f"{where}: tokens must be a 1-D tensor of token ids, got {tokens!r:.200}")
    if t.prompt_len != len(prompt) or tokens[: t.prompt_len].tolist() != prompt.tolist():
        raise InvalidRollout(f"{where}: tokens do not start with the request's prompt of {len(prompt)} tokens")
    response = len(tokens) - t.prompt_len
    if not 1 <= response <= max_new_tokens:
        raise InvalidRollout(f"{where}: {response} response tokens, not 1..max_new_tokens={max_new_tokens}")
    bad = tokens[(tokens < 0) | (tokens >= vocab)]
    if len(bad):
        raise InvalidRollout(f"{where}: token ids {bad[:8].tolist()} are not in the vocabulary (0..{vocab - 1})")
    if not isinstance(logprobs, torch.Tensor) or logprobs.shape != (response,):
        shape = tuple(logprobs.shape) if isinstance(logprobs, torch.Tensor) else type(logprobs).__name__
        raise InvalidRollout(f"{where}: log-probs of shape {shape} for its {response} response tokens")
    wrong = (~torch.isfinite(logprobs)) | (logprobs > 0)
    if wrong.any():
        pos = int(wrong.nonzero()[0])
        raise InvalidRollout(f"{where}: log-prob of response token {pos} is {float(logprobs[pos])}, not finite <= 0")
    if req.store and not (isinstance(t.attempt, str) and t.attempt):
        raise InvalidRollout(f"{where}: names no rollout attempt ({t.attempt!r}); its records cannot be matched")
    if t.recorded is not None and not 0 < t.recorded <= len(tokens):
        raise InvalidRollout(f"{where}: recorded={t.recorded} positions of a {len(tokens)}-token trajectory")


@dataclass(frozen=True)
class Request:
    """Rows `rows` of a step's batch (prompt token ids, any lengths), sampled with `seed`; records go to `store`,
    bound to `attempt` (`store = ""`: no records, an evaluation)."""

    index: int
    step: int
    prompts: Sequence[torch.Tensor]
    rows: tuple[int, ...]
    seed: int
    store: str
    attempt: str = ""

    def next_attempt(self) -> Request:
        """The same request as a new attempt (a fresh, unique attempt id)."""
        return dataclasses.replace(self, attempt=f"s{self.step}-r{self.index}-{uuid.uuid4().hex[:12]}")


class RolloutWorker:
    def __init__(self, cfg: RLConfig, spec: RecordSpec, task: RolloutTask):
        self.cfg, self.task = cfg, task
        self._hang_on_load = False  # fault injection (`hang_on_load`)
        size = dict(max_batch=cfg.prompts_per_step * cfg.group_size, max_len=task.max_len, device=cfg.device)
        self.engine: EmbeddedEngine
        if cfg.fp4_attention == "decode":
            self.engine = FP4AttentionEngine(task.hf_dir, spec=spec, **size)
        else:
            self.engine = EmbeddedEngine(task.hf_dir, fp4=cfg.mode != "bf16", spec=spec, **size)

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
                prompts,
                self.cfg.max_new_tokens,
                eos=self.task.eos,
                seed=req.seed + k,
                temperature=self.cfg.temperature,
                top_p=self.cfg.top_p,
                top_k=self.cfg.top_k,
            )
            for i, t in zip(rows, trajs, strict=True):
                out[i] = t
        if req.store:
            version = self.engine.version
            records = {
                str(r): dataclasses.replace(
                    t.records,
                    binding=Binding(
                        req.step, version, str(r), req.attempt, token_digest(t.tokens), self.engine.recipe.name
                    ),
                )
                for r, t in zip(req.rows, out, strict=True)
            }
            StepWriter(req.store, req.step).write(records)
        return [dataclasses.replace(t, records=None, attempt=req.attempt) for t in out]

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        if self._hang_on_load:
            threading.Event().wait()
        self.engine.load_weights(tensors, version)

    def version(self) -> int:
        return self.engine.version

    def take_decode_reads(self) -> int:
        """The engine's decode reads of its FP4 KV pool since the last call (`fp4_attention = "decode"` only)."""
        if not isinstance(self.engine, FP4AttentionEngine):
            raise RuntimeError("decode reads of an FP4 KV pool need fp4_attention='decode'")
        return self.engine.take_decode_reads()

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

    def hang_on_load(self) -> None:
        """Fault injection for weight-sync deadline tests: the worker's next `load_weights` blocks forever."""
        self._hang_on_load = True

    def hang_after(self, forwards: int) -> None:
        """Fault injection for deadline tests: the worker blocks forever in its `forwards`-th forward."""
        count = [0]

        def hook(module, args, output):
            count[0] += 1
            if count[0] == forwards:
                threading.Event().wait()

        self.engine.model.register_forward_hook(hook)


def init_ray() -> None:
    """Join the Ray cluster of `RAY_ADDRESS`, or start a new local one (no dashboard)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False, log_to_driver=False)


class RolloutPool(Protocol):
    """What the controller asks of a pool of rollout workers: `LocalPool`, `RayPool`
    (`trace_rl.rollout.sglang_worker.SGLangPool` for patched SGLang servers)."""

    def run(self, requests: Sequence[Request]) -> tuple[list[list[Trajectory]], int]:
        """Each request's trajectories, in request order, and the worker restarts the step took."""
        ...

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> dict[str, float] | None:
        """Give every worker policy `version` (HF tensor names); a pool may return metrics of the sync (SGLang:
        `weight_sync/*`)."""
        ...

    def versions(self) -> list[int]:
        """The policy version each worker holds."""
        ...


class _Pool:
    def __init__(self, cfg: RLConfig, spec: RecordSpec, task: RolloutTask):
        self.cfg, self.spec, self.task = cfg, spec, task
        self.weights: tuple[object, int] | None = None  # the latest policy pushed to the workers
        self.sync_misses = 0  # workers replaced in the latest weight sync (max_restarts bounds them)
        self.workers = [self._start() for _ in range(cfg.rollout_workers)]

    def _sync_missed(self, w: int) -> None:
        """Worker `w` missed `weight_sync_timeout_s` (or died) while loading the latest policy: name it on stderr,
        count it against `max_restarts`; the caller replaces it."""
        self.sync_misses += 1
        version = None if self.weights is None else self.weights[1]
        limit = self.cfg.weight_sync_timeout_s
        if self.sync_misses > self.cfg.max_restarts:
            raise RolloutTimeout(
                f"weight sync to policy version {version}: rollout worker {w} missed weight_sync_timeout_s={limit}; "
                f"{self.sync_misses} replacements in this sync exceed max_restarts={self.cfg.max_restarts}"
            )
        print(
            f"weight sync to policy version {version}: rollout worker {w} missed weight_sync_timeout_s={limit} or "
            "died; replacing it and syncing it again",
            file=sys.stderr,
        )

    def _check_restarts(self, restarts: int, step: int) -> None:
        if restarts > self.cfg.max_restarts:
            raise RuntimeError(f"step {step}: rollout workers died or timed out {restarts} times (max_restarts)")

    def _step_deadline(self) -> float:
        return time.monotonic() + self.cfg.rollout_step_timeout_s

    def _step_timeout(self, step: int) -> RolloutTimeout:
        return RolloutTimeout(f"step {step}: rollout did not finish within rollout_step_timeout_s")


class LocalPool(_Pool):
    """Workers in this process, run one request after another; each call runs on its own thread so its deadline
    holds even when the worker hangs (a hung worker is killed cooperatively: its next forward raises)."""

    def _start(self) -> RolloutWorker:
        return RolloutWorker(self.cfg, self.spec, self.task)

    def _loaded(self, worker: RolloutWorker) -> bool:
        """`worker.load_weights(*self.weights)` within `weight_sync_timeout_s`, on its own thread so that a hung
        worker cannot hold the run; False (and the worker killed) when it is late."""
        box: dict = {}
        done = threading.Event()

        def target() -> None:
            try:
                worker.load_weights(*self.weights)
            except BaseException as e:
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=target, name="weight-sync", daemon=True).start()
        if not done.wait(self.cfg.weight_sync_timeout_s):
            worker.kill()
            return False
        if "error" in box:
            raise box["error"]
        return True

    def _replace(self, w: int) -> None:
        """Worker `w` replaced by a fresh one holding the latest policy (a fresh one late in its sync: again)."""
        while True:
            worker = self._start()
            if self.weights is None or self._loaded(worker):
                self.workers[w] = worker
                return
            self._sync_missed(w)

    def _call(self, worker: RolloutWorker, req: Request, deadline: float) -> list[Trajectory]:
        """`worker.generate(req)` within `rollout_call_timeout_s` and the step `deadline`."""
        box: dict = {}
        done = threading.Event()

        def target() -> None:
            try:
                box["out"] = worker.generate(req)
            except BaseException as e:
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=target, name=f"rollout-{req.attempt}", daemon=True).start()
        limit = min(self.cfg.rollout_call_timeout_s, deadline - time.monotonic())
        if not done.wait(max(0.0, limit)):
            worker.kill()
            if time.monotonic() >= deadline:
                raise self._step_timeout(req.step)
            raise RolloutTimeout(
                f"step {req.step}: rollout worker {req.index % len(self.workers)} missed rollout_call_timeout_s="
                f"{self.cfg.rollout_call_timeout_s} on attempt {req.attempt}"
            )
        if "error" in box:
            raise box["error"]
        return box["out"]

    def run(self, requests: Sequence[Request]) -> tuple[list[list[Trajectory]], int]:
        out, restarts, deadline = [], 0, self._step_deadline()
        for req in requests:
            w = req.index % len(self.workers)
            while True:
                req = req.next_attempt()
                try:
                    out.append(self._call(self.workers[w], req, deadline))
                    break
                except (WorkerDied, RolloutTimeout) as e:
                    if time.monotonic() >= deadline:
                        raise self._step_timeout(req.step) from e
                    restarts += 1
                    self._check_restarts(restarts, req.step)
                    self.sync_misses = 0
                    self._replace(w)
        return out, restarts

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Every worker loads policy `version`, each within `weight_sync_timeout_s`; a late one is named, replaced
        and synced again (at most `max_restarts` times a sync)."""
        self.weights, self.sync_misses = (tensors, version), 0
        for w, worker in enumerate(self.workers):
            if not self._loaded(worker):
                self._sync_missed(w)
                self._replace(w)

    def versions(self) -> list[int]:
        return [w.version() for w in self.workers]

    def take_decode_reads(self) -> int:
        """Decode reads of the workers' FP4 KV pools since the last call, summed (`fp4_attention = "decode"`); the
        reads of a worker replaced since (its attempt was run again) are not counted."""
        return sum(w.take_decode_reads() for w in self.workers)


class RayPool(_Pool):
    """Workers as Ray actors (one process each), requests in flight concurrently."""

    def __init__(self, cfg: RLConfig, spec: RecordSpec, task: RolloutTask):
        import ray

        init_ray()
        self._actor = ray.remote(RolloutWorker).options(num_cpus=0, max_restarts=0)
        super().__init__(cfg, spec, task)

    def _start(self):
        return self._actor.remote(self.cfg, self.spec, self.task)

    def _replace(self, w: int) -> None:
        """Actor `w` killed and replaced by a fresh one holding the latest policy, its start and sync within
        `weight_sync_timeout_s` (a fresh one late or dead: again)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        ray.kill(self.workers[w], no_restart=True)
        while True:
            worker = self._start()
            if self.weights is None:
                break
            try:
                ray.get(worker.load_weights.remote(*self.weights), timeout=self.cfg.weight_sync_timeout_s)
                break
            except (GetTimeoutError, RayActorError):
                ray.kill(worker, no_restart=True)
                self._sync_missed(w)
        self.workers[w] = worker

    def run(self, requests: Sequence[Request]) -> tuple[list[list[Trajectory]], int]:
        """Requests in flight concurrently; a worker whose call dies or passes `rollout_call_timeout_s` is killed
        (`ray.kill`), restarted and given the request again as a new attempt."""
        import ray
        from ray.exceptions import RayActorError

        out: dict[int, list[Trajectory]] = {}
        restarts, deadline = 0, self._step_deadline()
        inflight: dict = {}  # object ref -> (request, call deadline)

        def submit(req: Request) -> None:
            req = req.next_attempt()
            ref = self.workers[req.index % len(self.workers)].generate.remote(req)
            inflight[ref] = (req, min(deadline, time.monotonic() + self.cfg.rollout_call_timeout_s))

        def restart(req: Request) -> None:
            nonlocal restarts
            restarts += 1
            self._check_restarts(restarts, req.step)
            self.sync_misses = 0
            self._replace(req.index % len(self.workers))
            submit(req)

        for r in requests:
            submit(r)
        while inflight:
            soonest = min(d for _, d in inflight.values())
            done, _ = ray.wait(list(inflight), num_returns=1, timeout=max(0.0, soonest - time.monotonic()))
            if not done:
                if time.monotonic() >= deadline:
                    for ref in inflight:
                        ray.cancel(ref, force=True)
                    raise self._step_timeout(next(iter(inflight.values()))[0].step)
                late = [ref for ref, (_, d) in inflight.items() if time.monotonic() >= d]
                for ref in late:
                    restart(inflight.pop(ref)[0])
                continue
            req, _ = inflight.pop(done[0])
            try:
                out[req.index] = ray.get(done[0])
            except RayActorError:
                restart(req)
        return [out[r.index] for r in requests], restarts

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Every actor loads policy `version` concurrently within `weight_sync_timeout_s`; one that is late or dies
        is named, `ray.kill`ed, replaced and synced again (at most `max_restarts` times a sync)."""
        import ray
        from ray.exceptions import RayActorError

        self.weights, self.sync_misses = (ray.put(tensors), version), 0
        refs = [worker.load_weights.remote(*self.weights) for worker in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.weight_sync_timeout_s)
        for w, ref in enumerate(refs):
            if ref in ready:
                try:
                    ray.get(ref)
                    continue
                except RayActorError:
                    pass
            self._sync_missed(w)
            self._replace(w)

    def versions(self) -> list[int]:
        import ray

        return ray.get([w.version.remote() for w in self.workers], timeout=self.cfg.rollout_call_timeout_s)

    def take_decode_reads(self) -> int:
        """As `LocalPool.take_decode_reads`."""
        import ray

        refs = [w.take_decode_reads.remote() for w in self.workers]
        return sum(ray.get(refs, timeout=self.cfg.rollout_call_timeout_s))
