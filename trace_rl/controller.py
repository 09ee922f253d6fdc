"""The RL controller: rollout → records and routes into the store → rewards → trainer step → weight sync,
asynchronous by `async_lag` rollout batches within `max_version_diff`, with checkpoint and resume, periodic
held-out evaluation and TensorBoard / W&B logging.

The policy is the tiny addition model or an HF Qwen3-MoE checkpoint (`trace_rl.policy`), the prompts a dataset
(`trace_rl.data`), the rewards a reward function scored in a pool as soon as a batch is generated
(`trace_rl.rewards`), so a slow reward function overlaps the trainer.

A step's GRPO groups are split into one request per rollout worker (`trace_rl.rollout.workers`: in-process, or Ray
actors with `use_ray`; `trace_rl.rollout.sglang_worker`: patched SGLang servers with `rollout_backend = "sglang"`); the
trainer runs in the controller's process (a Ray actor with `use_ray`). The controller holds an exclusive lock on
`out_dir` (`trace_rl.rundir`); a checkpoint names its pending rollout steps, which retention keeps until both kept
checkpoints have moved past them, so a run resumes from either (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from trace_core.records.reader import RecordReader
from trace_core.records.spec import CapturePolicy, RecordSpec
from trace_core.records.store import (
    INDEX_NAME,
    LOCK_NAME,
    StoreError,
    apply_retention,
    atomic_write,
    finalize_step,
    list_steps,
    shard_paths,
    step_dir,
)
from trace_rl import samples
from trace_rl.algorithm import trainer_kwargs
from trace_rl.config import ConfigError, RLConfig
from trace_rl.data import Prompt, dataset
from trace_rl.parallel_trainer import GroupTrainer
from trace_rl.policy import RolloutTask, load_policy
from trace_rl.rewards import RewardPool
from trace_rl.rollout.engine import Trajectory
from trace_rl.rollout.workers import LocalPool, RayPool, Request, RolloutPool, check_results
from trace_rl.rundir import (
    RunDirError,
    RunLock,
    fresh_start,
    fresh_start_pending,
    load_latest,
    remove_stale_temps,
    save_checkpoint,
    seal_sharded,
    sharded_dir,
)
from trace_rl.tracking import Tracker
from trace_rl.trainer import MegatronTrainer, RayTrainer

if TYPE_CHECKING:
    from trace_rl.servers import ServerGroup

LEGACY_CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
CONFIG_JSON = "config.json"  # the resolved config, readable without the checkpoint reader


class RewardError(RuntimeError):
    """The reward function raised or returned a non-finite value; the message names the prompt."""


# Settings a resume may change: where and how the run executes (layout, deadlines, servers, keys), how long it runs,
# how often it checkpoints and keeps records, what it reports (evaluation, samples, loggers). None of them shapes the
# data, the pairing of trajectories with prompts, the reward or the numerics.
RESUME_FREE = frozenset(
    {
        "out_dir",
        "steps",
        "epochs",
        "max_version_diff",
        "use_ray",
        "max_restarts",
        "checkpoint_every",
        "keep_record_steps",
        "record_store",
        "sglang_urls",
        "sglang_timeout_s",
        "sglang_api_key",
        "sglang_admin_api_key",
        "rollout_call_timeout_s",
        "rollout_step_timeout_s",
        "weight_sync_timeout_s",
        "sglang_start_timeout_s",
        "sglang_launch",
        "sglang_gpus",
        "sglang_port_base",
        "sglang_max_restarts",
        "sglang_tp",
        "sglang_cpus",
        "colocate",  # the same weights reach the servers after every release
        "weight_sync",  # the same bits reach the servers by every transport
        "weight_sync_bucket_mb",
        "weight_sync_disk_fallback",
        "weight_sync_backend",
        "weight_sync_master",
        "force_resume",
        "reward_workers",
        "reward_pool",
        "eval_data",
        "eval_every",
        "eval_k",
        "eval_prompts",
        "eval_before_train",
        "samples_every",
        "samples_per_step",
        "loggers",
        "wandb_project",
        "wandb_run",
        "tp",
        "ep",
        "pp",
        "dp",
        "gpus_per_node",
        "expert_weights_in_place",  # the same results bit for bit either way
    }
)
# Every other setting (a new one too, until it is listed above) must be what the checkpoint was written with: a
# resume with another value is refused unless `force_resume`.
RESUME_KEYS = tuple(f.name for f in fields(RLConfig) if f.name not in RESUME_FREE)


class PairingError(RuntimeError):
    """A trajectory about to be trained was generated from another prompt or dataset than the step's."""


class _StopOnInterrupt:
    """While entered (in the main thread): the first SIGINT only sets `requested`, the second raises
    KeyboardInterrupt as usual; the previous handler is restored on exit."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nCtrl-C: stopping after this step (a checkpoint is saved); Ctrl-C again to stop now", file=sys.stderr)

    def __enter__(self) -> _StopOnInterrupt:
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


# A pending trajectory in a checkpoint: its fields by name, all but the records (those stay in the store).
TRAJECTORY_STATE = tuple(f.name for f in fields(Trajectory) if f.name != "records")


@dataclass
class RolloutBatch:
    step: int
    version: int
    prompts: list[Prompt]
    trajectories: list[Trajectory]
    restarts: int
    rewards: list[Future]  # one per trajectory, scored in the reward pool
    stale_shards: int = 0  # shards of earlier rollout attempts set aside when the step was finalized
    decode_reads: int | None = None  # decode reads of the workers' FP4 KV pools (fp4_attention = "decode")
    generate_s: float = 0.0  # wall seconds of the rollout pool's run (a resumed batch: 0, it ran before)
    record_wait_s: float = 0.0  # the part of it spent after the answers until their records were in the store


BREAKDOWN = ("rollout", "record_wait", "record_read", "train", "weight_sync", "idle")
"""The parts of a step's wall time, `time/breakdown/<part>_s`, which add up to `time/step_s` (`step_breakdown`)."""


def step_breakdown(
    step_s: float,
    *,
    generate_s: float,
    record_wait_s: float,
    record_read_s: float,
    train_s: float,
    weight_sync_s: float,
) -> dict[str, float]:
    """A step's wall time `step_s` in disjoint parts that add up to it: `rollout` (the pool generating, less the
    record wait), `record_wait` (after the answers, until the records were in the store: SGLang servers write them
    behind their answers; bf16: the routes stored), `record_read` (the trainer reading and unpacking the step's
    records and routes from the store), `train` (the trainer step, less the record read), `weight_sync` (the
    policy's export and push to the engines, with `colocate` the servers' memory release and resume) and `idle`
    (the rest: waiting for the reward pool, finalizing and checking the store's step, retention)."""
    parts = {
        "rollout": generate_s - record_wait_s,
        "record_wait": record_wait_s,
        "record_read": min(record_read_s, train_s),
        "train": train_s - min(record_read_s, train_s),
        "weight_sync": weight_sync_s,
    }
    parts["idle"] = max(0.0, step_s - sum(parts.values()))
    return {f"time/breakdown/{k}_s": v for k, v in parts.items()}


def record_spec(layers: int, cfg: RLConfig) -> RecordSpec:
    """The trainer's guidance spec."""
    ids = tuple(range(layers))
    return cfg.capture_policy().spec(ids, ids, cfg.recipe)


def capture_spec(layers: int, cfg: RLConfig) -> RecordSpec:
    """What the rollout records: the guidance spec, or 4 bits at every layer with `measure_all_sites`."""
    if cfg.measure_all_sites:
        ids = tuple(range(layers))
        return CapturePolicy(4, "all").spec(ids, ids, cfg.recipe)
    return record_spec(layers, cfg)


def export_device(cfg: RLConfig) -> str:
    """Where the trainer exports the policy for the engines: its GPU when colocated servers take it by `tensor` (CUDA
    IPC handles of the trainer's own memory, no host copy), else the CPU."""
    colocated_ipc = cfg.colocate and cfg.weight_sync == "tensor" and torch.device(cfg.device).type == "cuda"
    return cfg.device if colocated_ipc else "cpu"


class Controller:
    def __init__(self, cfg: RLConfig, *, resume: bool = True, servers: ServerGroup | None = None):
        """`servers`: the launcher's group of the servers at `sglang_urls` (a dead one is then restarted)."""
        self.cfg = cfg
        self.servers = servers
        self.out = Path(cfg.out_dir)
        self.lock = RunLock(self.out)  # before anything in out_dir is read or changed
        try:
            self._start(resume)
        except BaseException:
            pool = getattr(self, "pool", None)
            if pool is not None and hasattr(pool, "close"):  # a weight-update group formed already
                pool.close()
            self.lock.release()
            raise

    def _start(self, resume: bool) -> None:
        cfg = self.cfg
        self.store = cfg.record_store_dir()
        _check_writable(self.store)
        if cfg.record_store:  # the default store lives in the run directory (which may move between resumes)
            _claim_store(self.store, self.out)
        for p in remove_stale_temps(self.out):
            print(f"removed {p}, a temporary file of a controller that was killed", file=sys.stderr)
        self.policy = policy = load_policy(cfg.model_dir)
        tiny, state = policy.dims, policy.state
        self.data = dataset(cfg.data, cfg, policy)
        self.eval_data = dataset(cfg.eval_data, cfg, policy) if cfg.eval_data else None
        max_prompt = max(d.max_prompt_len for d in (self.data, self.eval_data) if d is not None)
        if max_prompt + cfg.max_new_tokens > tiny.max_seq:
            raise ValueError(f"prompt ({max_prompt}) + max_new_tokens exceeds the model's max_seq {tiny.max_seq}")
        self.steps = cfg.steps
        if cfg.epochs and self.data.size is not None:
            self.steps = min(cfg.steps, cfg.epochs * self.data.size // cfg.prompts_per_step)
            if self.steps < 1:
                raise ValueError(f"epochs={cfg.epochs} of {self.data.size} prompts: no step of {cfg.prompts_per_step}")
        self.rewards = RewardPool(cfg.reward, cfg.reward_workers, cfg.reward_pool)
        self.spec = record_spec(tiny.layers, cfg)
        kw: dict[str, Any] = dict(mode=cfg.mode, spec=self.spec, lr=cfg.lr, max_version_diff=cfg.max_version_diff)
        kw["dtype"] = getattr(torch, cfg.trainer_dtype)
        kw |= dict(experts=cfg.trainer_experts, expert_weights_in_place=cfg.expert_weights_in_place)
        kw |= trainer_kwargs(cfg, self.steps)
        self.trainer: GroupTrainer | RayTrainer | MegatronTrainer
        if cfg.parallel_trainer():
            self.trainer = GroupTrainer.from_config(tiny, state, cfg, **kw)
        else:
            self.trainer = (RayTrainer if cfg.use_ray else MegatronTrainer)(tiny, state, **kw)
        pool_cfg = cfg.replace(model_dir=str(Path(cfg.model_dir).resolve()))  # worker processes may run elsewhere
        capture = capture_spec(tiny.layers, cfg)
        task = RolloutTask(str(policy.hf_dir), max_prompt + cfg.max_new_tokens, policy.eos)
        self.pool: RolloutPool
        if cfg.rollout_backend == "sglang":
            from trace_rl.rollout.sglang_worker import SGLangPool

            self.pool = SGLangPool(pool_cfg, capture, task, servers=self.servers, policy=self.trainer.hf_weights)
        else:
            self.pool = (RayPool if cfg.use_ray else LocalPool)(pool_cfg, capture, task)
        self.pending: deque[RolloutBatch] = deque()
        self.history: list[dict] = []
        self.step = 0
        self.checkpoint_steps: list[list[int]] = []  # pending rollout steps of each kept checkpoint
        if (self.out / LEGACY_CHECKPOINT).exists():
            raise ConfigError(f"{self.out / LEGACY_CHECKPOINT} has the old checkpoint format; use a new out_dir")
        if resume and fresh_start_pending(self.out):
            print(f"{self.out}: finishing an interrupted fresh start; the old run is not resumed", file=sys.stderr)
            resume = False
        if resume:
            self._load_checkpoint()
        else:
            fresh_start(self.out)  # marked first: a crash midway cannot leave a checkpoint that a resume would find
        self._discard_unsaved_rollouts()
        with open(self.out / METRICS, "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in self.history)
        (self.out / CONFIG_JSON).write_text(json.dumps(asdict(cfg), indent=1) + "\n")
        samples.truncate(self.out / samples.SAMPLES, self.step)
        self.tracker = Tracker(
            self.out,
            cfg.logger_list(),
            config=asdict(cfg),
            start_step=self.step,
            wandb_project=cfg.wandb_project,
            wandb_run=cfg.wandb_run,
        )

    def _discard_unsaved_rollouts(self) -> None:
        """Record-store steps that no checkpoint knows of (a fresh start, or rollouts after the last checkpoint)
        are regenerated, so what they hold goes. With SGLang servers the next step's directory itself stays, emptied
        but for its lock file: a live server opened it for its records when it started (its writer would find it
        gone)."""
        first = self.step + len(self.pending)
        stale = [s for s in list_steps(self.store) if s >= first] if self.store.exists() else []
        keep = first if self.cfg.rollout_backend == "sglang" else None
        discarded = []
        for s in stale:
            directory = step_dir(self.store, s)
            if s != keep:
                shutil.rmtree(directory)
                discarded.append(s)
                continue
            entries = [e for e in directory.iterdir() if e.name != LOCK_NAME]
            for entry in entries:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            if entries:
                discarded.append(s)
        if discarded:
            print(f"discarded record-store steps {discarded} of {self.out} (not covered by a checkpoint)")

    def close(self) -> None:
        """Close the loggers, stop the reward pool and release `out_dir` (the lock); the controller is not used
        after."""
        self.tracker.close()
        self.rewards.close()
        if hasattr(self.pool, "close"):  # SGLang: leave the weight-update group
            self.pool.close()
        if isinstance(self.trainer, GroupTrainer):
            self.trainer.shutdown()
        self.lock.release()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- rollout
    def _policy_tensors(self) -> dict[str, torch.Tensor]:
        """The trainer's HF export for the engines, on `export_device`'s device (the in-process trainer only: the
        trainer groups' exports cross processes on the CPU)."""
        if type(self.trainer) is MegatronTrainer:
            return self.trainer.hf_weights(device=export_device(self.cfg))
        return self.trainer.hf_weights()

    def rollout(self, step: int) -> RolloutBatch:
        """Generate step `step`'s trajectories; the workers write their records into the store."""
        cfg, n = self.cfg, self.cfg.group_size
        prompts = self.data.batch(step, cfg.prompts_per_step)
        ids = [p.ids for p in prompts for _ in range(n)]
        requests = []
        for w, groups in enumerate(torch.arange(cfg.prompts_per_step).tensor_split(cfg.rollout_workers)):
            if len(groups):
                rows = tuple(range(int(groups[0]) * n, (int(groups[-1]) + 1) * n))
                seed = (cfg.seed * 1_000_003 + step) * 64 + w
                requests.append(Request(w, step, [ids[r] for r in rows], rows, seed, str(self.store)))
        generating = time.perf_counter()
        results, restarts = self.pool.run(requests)
        generate_s = time.perf_counter() - generating
        take_wait = getattr(self.pool, "take_record_wait", None)  # SGLang servers write records after answering
        record_wait_s = min(take_wait(), generate_s) if take_wait is not None else 0.0
        check_results(requests, results, cfg.max_new_tokens, self.policy.dims.vocab)
        reads = self._take_decode_reads()
        keys = [p.key for p in prompts]
        trajs = [
            dataclasses.replace(t, prompt=keys[i // n], dataset=self.data.digest)
            for i, t in enumerate(t for out in results for t in out)
        ]
        attempts: dict[str, str] = {}
        for i, t in enumerate(trajs):
            if t.attempt is None:
                raise RuntimeError(f"step {step}: trajectory {i} came from the rollout pool without an attempt id")
            attempts[str(i)] = t.attempt
        index = finalize_step(self.store, step, attempts=attempts)
        stored = len(RecordReader(self.store, step).trajectories())
        if stored != len(trajs):
            raise RuntimeError(f"step {step}: {stored} trajectories in the record store, {len(trajs)} generated")
        versions = set(self.pool.versions())
        if len(versions) != 1:
            raise RuntimeError(f"rollout workers hold different policy versions {sorted(versions)}")
        stale = json.loads(index.read_bytes())["stale"]  # shards holding trajectories of earlier attempts
        set_aside = [s["shard"] for s in stale if s["set_aside"]]
        if set_aside:
            print(
                f"step {step}: set aside {len(set_aside)} shards of earlier rollout attempts: {set_aside}",
                file=sys.stderr,
            )
        kept = {s["shard"]: s["trajectories"] for s in stale if not s["set_aside"]}
        if kept:
            print(
                f"step {step}: trajectories of earlier rollout attempts not indexed, by shard: {kept}", file=sys.stderr
            )
        scores = self._score(prompts, trajs)
        return RolloutBatch(
            step, versions.pop(), prompts, trajs, restarts, scores, len(set_aside), reads, generate_s, record_wait_s
        )

    def _score(self, prompts: list[Prompt], trajs: list[Trajectory]) -> list[Future]:
        """Submit every trajectory's response text (EOS stripped) with its prompt's answer to the reward pool."""
        n = len(trajs) // len(prompts)
        samples = []
        for i, t in enumerate(trajs):
            response = t.response
            if len(response) and int(response[-1]) in self.policy.eos:
                response = response[:-1]
            text = self.policy.tokenizer.decode(response.tolist(), skip_special_tokens=True)
            samples.append((text, prompts[i // n].answer, prompts[i // n].metadata))
        return self.rewards.submit(samples)

    def _record_bytes_per_token(self, batch: RolloutBatch) -> float:
        """Bytes of the step's record shards per trajectory token. The index and lock are left out: the index names
        shards by their writer's process id, so its size (not the records') changes with the pid's digits."""
        shards = shard_paths(step_dir(self.store, batch.step))
        return sum(f.stat().st_size for f in shards) / sum(len(t.tokens) for t in batch.trajectories)

    def _take_decode_reads(self) -> int | None:
        """The workers' decode reads of their FP4 KV pools since the last call; None unless fp4_attention is
        "decode" (the config allows it with the embedded pool only)."""
        if self.cfg.fp4_attention != "decode":
            return None
        assert isinstance(self.pool, LocalPool | RayPool), type(self.pool)
        return self.pool.take_decode_reads()

    # ----------------------------------------------------------------- evaluation
    def evaluate(self) -> dict[str, float]:
        """`eval_k` samples of each held-out prompt with the current policy (no records): mean reward (mean@k),
        pass@1 (fraction of positive-reward samples) and pass@k (prompts with a positive-reward sample)."""
        cfg, k = self.cfg, self.cfg.eval_k
        if self.eval_data is None:
            raise ValueError("evaluate() needs eval_data in the config")
        prompts = self.eval_data.head(cfg.eval_prompts)
        ids = [p.ids for p in prompts for _ in range(k)]
        chunk = cfg.prompts_per_step * cfg.group_size
        requests = []
        for j, lo in enumerate(range(0, len(ids), chunk)):
            seed = -((cfg.seed * 1_000_003 + self.step) * 64 + j) - 1  # training seeds are >= 0
            rows = tuple(range(lo, min(lo + chunk, len(ids))))
            requests.append(Request(j, self.step, ids[lo : lo + chunk], rows, seed, ""))
        results, _ = self.pool.run(requests)
        check_results(requests, results, cfg.max_new_tokens, self.policy.dims.vocab)
        trajs = [t for out in results for t in out]
        rewards = self._rewards(prompts, trajs, self._score(prompts, trajs), self.step).view(len(prompts), k)
        metrics = {
            f"eval/mean@{k}": float(rewards.mean()),
            "eval/pass@1": float((rewards > 0).float().mean()),
            f"eval/pass@{k}": float((rewards > 0).any(dim=1).float().mean()),
            "eval/response_len": sum(len(t.response) for t in trajs) / len(trajs),
        }
        reads = self._take_decode_reads()
        if reads is not None:
            metrics["eval/fp4_decode_reads"] = float(reads)
        return metrics

    # ----------------------------------------------------------------- the loop
    def train_step(self) -> dict:
        """Fill the rollout pipeline, train on its oldest batch, sync weights; returns the step's metrics."""
        if self.step >= self.steps:
            raise RuntimeError(
                f"the run in {self.out} is finished: {self.step} of steps={self.steps} trained (raise steps to go on)"
            )
        self.lock.check()
        start = time.perf_counter()
        rolled_now: list[RolloutBatch] = []  # the rollouts this step ran (with async_lag, not only the trained one)
        while len(self.pending) <= self.cfg.async_lag and self.step + len(self.pending) < self.steps:
            rolled_now.append(self.rollout(self.step + len(self.pending)))
            self.pending.append(rolled_now[-1])
        batch = self.pending.popleft()
        self._check_pairing(batch)
        waiting = time.perf_counter()
        rewards = self._rewards(batch.prompts, batch.trajectories, batch.rewards, batch.step)
        rolled = time.perf_counter()
        if self.cfg.colocate:  # the servers give their GPU memory to the trainer step (trace_rl.rollout.colocate)
            from trace_rl.rollout.sglang_worker import SGLangPool

            assert isinstance(self.pool, SGLangPool), type(self.pool)
            self.pool.release_memory()
        released = time.perf_counter()
        metrics: dict[str, Any] = self.trainer.step(
            batch.trajectories, rewards, self.cfg.group_size, str(self.store), batch.step, batch.version
        )
        trained = time.perf_counter()
        diffs = metrics.pop("samples/logprob_abs_diff", {})
        metrics["reward/zero_variance_groups"] = self._zero_variance_groups(rewards, batch.step)
        version = self.trainer.policy_version()
        sync = self.pool.load_weights(self._policy_tensors(), version) or {}  # SGLang: weight_sync/* metrics
        pushed = time.perf_counter()
        apply_retention(self.store, self.cfg.keep_record_steps, protect=self._protected_steps())
        synced = time.perf_counter()
        metrics |= {
            "step": self.step,
            "mode": self.cfg.mode,
            "reward/mean": float(rewards.mean()),
            "rollout/response_len": sum(len(t.response) for t in batch.trajectories) / len(batch.trajectories),
            "rollout/restarts": float(batch.restarts),
            "trace/record_bytes_per_token": self._record_bytes_per_token(batch),
            "rollout/stale_shards": float(batch.stale_shards),
            "time/step_s": synced - start,
            "time/rollout_s": rolled - start,
            "time/reward_wait_s": rolled - waiting,
            "time/train_s": trained - released,
            "time/sync_s": synced - trained,
        }
        if self.cfg.colocate:
            metrics["time/release_s"] = released - rolled
        metrics |= step_breakdown(
            synced - start,
            generate_s=sum(b.generate_s for b in rolled_now),
            record_wait_s=sum(b.record_wait_s for b in rolled_now),
            record_read_s=metrics.get("time/record_read_s", 0.0),
            train_s=trained - released,
            weight_sync_s=(pushed - trained) + (released - rolled),
        )
        metrics |= sync
        if batch.decode_reads is not None:
            metrics["rollout/fp4_decode_reads"] = float(batch.decode_reads)
        self.step += 1
        if self.eval_data is not None and (self.step % self.cfg.eval_every == 0 or self.step == self.steps):
            evaluated = time.perf_counter()
            metrics |= self.evaluate()
            metrics["time/eval_s"] = time.perf_counter() - evaluated
        self.history.append(metrics)
        self.tracker.log(metrics, metrics["step"])
        if self.cfg.samples_every and batch.step % self.cfg.samples_every == 0:
            self._log_samples(batch, rewards, diffs)
        with open(self.out / METRICS, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.step % self.cfg.checkpoint_every == 0 or self.step == self.steps:
            self.save_checkpoint()
        return metrics

    def _check_pairing(self, batch: RolloutBatch) -> None:
        """`PairingError` unless every trajectory of `batch` carries the id of the step's prompt it is scored and
        trained against, the digest of this dataset, and that prompt's tokens (a resume with other data settings
        would otherwise pair it with another prompt)."""
        n = len(batch.trajectories) // len(batch.prompts)
        for i, t in enumerate(batch.trajectories):
            p = batch.prompts[i // n]
            same_tokens = t.tokens[: t.prompt_len].tolist() == p.ids.tolist()
            if t.prompt != p.key or t.dataset != self.data.digest or not same_tokens:
                raise PairingError(
                    f"step {batch.step}: trajectory {i} was generated from prompt {t.prompt} of dataset {t.dataset}, "
                    f"but the config's data gives prompt {p.key} of dataset {self.data.digest} for it (the data "
                    "settings or the dataset file changed since the checkpoint; resume with the checkpoint's, or start "
                    "a new run)"
                )

    def run(self, desc: str | None = None) -> list[dict]:
        """Train to `steps` (from the resumed step). Ctrl-C (SIGINT) stops at the next safe point, the end of the
        step in progress: a checkpoint is saved there and `SystemExit(130)` leaves with one line (a second Ctrl-C
        interrupts at once). Evaluates first with `eval_before_train` on a fresh run."""
        if self.cfg.eval_before_train and self.step == 0 and self.eval_data is not None:
            initial = self.evaluate()
            self.tracker.log(initial, -1)
            print("evaluation before training: " + json.dumps(initial))
        bar = tqdm(total=self.steps, initial=self.step, desc=desc or self.cfg.mode, unit="step")
        with _StopOnInterrupt() as stop:
            while self.step < self.steps:
                m = self.train_step()
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward/mean']:.2f}", dlogp=f"{m['train_rollout_logprob_abs_diff']:.4f}")
                if stop.requested and self.step < self.steps:
                    if self.step % self.cfg.checkpoint_every:
                        self.save_checkpoint()
                    bar.close()
                    print(
                        f"interrupted: checkpoint of step {self.step} saved in {self.out}; the same command resumes",
                        file=sys.stderr,
                    )
                    raise SystemExit(130)
        bar.close()
        dead = sum(m.get("reward/zero_variance_groups", 0) == self.cfg.prompts_per_step for m in self.history)
        if dead:
            print(
                f"{dead} of {len(self.history)} steps trained nothing: every group had zero reward variance "
                f"(see {self.out / samples.SAMPLES}; reward={self.cfg.reward!r})",
                file=sys.stderr,
            )
        return self.history

    # ----------------------------------------------------------------- rewards and samples
    def _rewards(self, prompts: list[Prompt], trajs: list[Trajectory], scores: list[Future], step: int):
        """The rewards of `trajs` (`len(trajs) // len(prompts)` per prompt); a reward function that raises or returns
        a non-finite value is a `RewardError` naming the step, the trajectory and its prompt."""
        n, values = len(trajs) // len(prompts), []
        for i, f in enumerate(scores):
            try:
                value = float(f.result())
            except Exception as e:  # the user's function: any exception, named with its prompt
                problem = self._reward_problem(prompts[i // n], step, i, f"raised {type(e).__name__}: {e}")
                raise RewardError(problem) from e
            if not math.isfinite(value):
                raise RewardError(self._reward_problem(prompts[i // n], step, i, f"returned {value}"))
            values.append(value)
        return torch.tensor(values)

    def _reward_problem(self, prompt: Prompt, step: int, i: int, what: str) -> str:
        text = self.policy.tokenizer.decode(prompt.ids.tolist(), skip_special_tokens=True)
        row = f"row {prompt.row} of {self.cfg.data}" if prompt.row >= 0 else self.cfg.data
        return (
            f"reward={self.cfg.reward!r} {what} at step {step}, trajectory {i}, prompt {row} ({text[-120:]!r}): fix "
            "the reward function; it must return a finite float for every response"
        )

    def _zero_variance_groups(self, rewards: torch.Tensor, step: int) -> float:
        """Groups of the step whose rewards are all equal (zero advantages: nothing to learn from); a warning when
        every group is."""
        groups = rewards.view(-1, self.cfg.group_size)
        zero = int((groups == groups[:, :1]).all(dim=1).sum())
        if zero == len(groups):
            print(
                f"warning: step {step}: all {zero} groups have zero reward variance (all advantages 0), so the step "
                f"trains nothing; read {self.out / samples.SAMPLES} and check reward={self.cfg.reward!r}",
                file=sys.stderr,
            )
        return float(zero)

    def _log_samples(self, batch: RolloutBatch, rewards: torch.Tensor, diffs: dict) -> None:
        """`samples_per_step` of the batch's trajectories to samples.jsonl and the trackers (`trace_rl.samples`)."""
        n, tok = self.cfg.group_size, self.policy.tokenizer
        rows = []
        for i in samples.pick(len(batch.trajectories), self.cfg.samples_per_step):
            t = batch.trajectories[i]
            rows.append(
                {
                    "step": batch.step,
                    "version": batch.version,
                    "trajectory": i,
                    "prompt": tok.decode(batch.prompts[i // n].ids.tolist(), skip_special_tokens=True),
                    "response": tok.decode(t.response.tolist(), skip_special_tokens=True),
                    "reward": float(rewards[i]),
                    "logprob_abs_diff": diffs.get(i, float("nan")),
                }
            )
        samples.write(self.out / samples.SAMPLES, rows)
        self.tracker.log_text("samples", rows, samples.markdown(rows), batch.step)

    # ----------------------------------------------------------------- checkpoint
    def _protected_steps(self) -> set[int]:
        """Record steps retention must keep: the pending batches and those of every kept checkpoint."""
        return {b.step for b in self.pending} | {s for steps in self.checkpoint_steps for s in steps}

    def save_checkpoint(self) -> Path:
        """Trainer state (a distributed checkpoint, `megatron_trace.checkpoint`), pending rollout batches (their
        records stay in the store) and metrics, fsynced and checksummed (`trace_rl.rundir`; the last two are kept)."""
        pending = [
            {
                "step": b.step,
                "version": b.version,
                "restarts": b.restarts,
                "decode_reads": b.decode_reads,
                "trajectories": [{k: getattr(t, k) for k in TRAJECTORY_STATE} for t in b.trajectories],
            }
            for b in self.pending
        ]
        self.lock.check()
        # The trainer's tensors: a distributed checkpoint every rank writes (readable at any layout), sealed first.
        written = sharded_dir(self.out, self.step, tmp=True)
        shutil.rmtree(written, ignore_errors=True)
        try:
            self.trainer.save_sharded(str(written.resolve()))  # Ray actors have another working directory
            sharded = seal_sharded(self.out, self.step)
        except BaseException:
            shutil.rmtree(written, ignore_errors=True)
            raise
        self.checkpoint_steps = [*self.checkpoint_steps[-1:], [b.step for b in self.pending]]
        state = {
            "config": asdict(self.cfg),
            "step": self.step,
            "sharded": sharded,
            "pending": pending,
            "history": self.history,
            "checkpoint_steps": self.checkpoint_steps,
        }
        return save_checkpoint(self.out, self.step, state)

    def _load_checkpoint(self) -> None:
        loaded = load_latest(self.out)
        if loaded is None:
            return
        for path, reason in loaded.rejected:
            print(f"checkpoint {path} is damaged ({reason}); resuming from {loaded.path}", file=sys.stderr)
        state, path = loaded.state, loaded.path
        if "sharded" not in state:
            raise ConfigError(
                f"{path} holds the trainer in an earlier format (no distributed checkpoint); use a new out_dir"
            )
        saved = {f.name: f.default for f in fields(RLConfig)} | state["config"]  # keys added since: their defaults
        changed = {k: (saved[k], getattr(self.cfg, k)) for k in RESUME_KEYS if saved[k] != getattr(self.cfg, k)}
        if changed and not self.cfg.force_resume:
            raise ValueError(
                f"checkpoint {path} was written with "
                + ", ".join(f"{k}={a!r}, the config has {b!r}" for k, (a, b) in changed.items())
                + " (these shape the data, pairing, reward or numerics; force_resume=true resumes anyway)"
            )
        if changed:
            print(f"force_resume: resuming {path} with changed settings {changed}", file=sys.stderr)
        self.trainer.load_sharded(str((path.parent / state["sharded"]["dir"]).resolve()), lr=self.cfg.lr)
        self.step, self.history = state["step"], state["history"]
        self.checkpoint_steps = state["checkpoint_steps"]
        for p in state["pending"]:  # prompts are a function of the step; rewards are scored again
            prompts = self.data.batch(p["step"], self.cfg.prompts_per_step)
            trajs = [Trajectory(**t, records=None) for t in p["trajectories"]]
            scores = self._score(prompts, trajs)
            reads = p.get("decode_reads")  # absent in checkpoints written before fp4_attention
            self.pending.append(RolloutBatch(p["step"], p["version"], prompts, trajs, p["restarts"], scores, 0, reads))
        for b in self.pending:
            if not (step_dir(self.store, b.step) / INDEX_NAME).exists():
                raise StoreError(f"checkpoint {path} needs record step {b.step}, which {self.store} does not hold")
        version = self.trainer.policy_version()
        if version > 0:
            self.pool.load_weights(self.trainer.hf_weights(), version)
        print(f"resumed from step {self.step} ({path})")


STORE_OWNER = ".trace-run"  # in a record store: the run directory it belongs to


def _claim_store(store: Path, out: Path) -> None:
    """Mark the record store as the run's in `out` (`STORE_OWNER`); `RunDirError` naming both directories if another
    run directory owns it (two runs in one store would retire and overwrite each other's steps)."""
    marker, owner = store / STORE_OWNER, str(out.resolve())
    try:
        found = marker.read_text().strip()
    except FileNotFoundError:
        atomic_write(marker, [owner.encode()])
        return
    if found != owner:
        raise RunDirError(
            f"record store {store} belongs to the run in {found}, not to {owner}: give this run its own record_store"
        )


def _check_writable(store: Path) -> None:
    """`RunDirError` naming the record store's absolute path unless it can be created and written (checked before
    the run changes anything)."""
    try:
        store.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=store)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RunDirError(f"record store {store} is not writable: {e.strerror}") from None
