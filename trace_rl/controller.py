"""The RL controller: rollout → records and routes into the store → rewards → trainer step → weight sync,
asynchronous by `async_lag` rollout batches within `max_version_diff`, with checkpoint and resume.

A step's GRPO groups are split into one request per rollout worker (`trace_rl.workers`: in-process, or Ray actors
with `use_ray`; `trace_rl.sglang_worker`: patched SGLang servers with `rollout_backend = "sglang"`); the trainer
runs in the controller's process (a Ray actor with `use_ray`). The controller holds an exclusive lock on `out_dir`
(`trace_rl.rundir`); a checkpoint names its pending rollout steps, which retention keeps until both kept checkpoints
have moved past them, so a run resumes from either (docs/reliability.md).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from trace_core.records import RecordSpec
from trace_core.store import INDEX_NAME, StoreError, apply_retention, finalize_step, list_steps, step_dir
from trace_core.store_reader import RecordReader
from trace_rl.config import ConfigError, RLConfig
from trace_rl.engine import Trajectory
from trace_rl.rundir import RunLock, checkpoints, load_latest, save_checkpoint
from trace_rl.task import AdditionTask
from trace_rl.trainer import MegatronTrainer, RayTrainer
from trace_rl.warmup import load_megatron_state
from trace_rl.workers import LocalPool, RayPool, Request

LEGACY_CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
# Settings a checkpoint must have been written with (they change the numerics or the resume itself); a resume with
# other values is refused unless `force_resume`.
RESUME_KEYS = (
    "mode",
    "model_dir",
    "prompts_per_step",
    "group_size",
    "seed",
    "record_bits",
    "record_all_layers",
    "measure_all_sites",
    "max_new_tokens",
    "temperature",
    "lr",
    "rollout_workers",
    "rollout_backend",
    "async_lag",
)


@dataclass
class RolloutBatch:
    step: int
    version: int
    operands: torch.Tensor
    trajectories: list[Trajectory]
    restarts: int
    stale_shards: int = 0  # shards of earlier rollout attempts set aside when the step was finalized


def record_spec(layers: int, cfg: RLConfig) -> RecordSpec:
    """The trainer's guidance spec."""
    ids = tuple(range(layers))
    if cfg.record_all_layers:
        return RecordSpec(bits=cfg.record_bits, moe_layers=ids, attn_layers=ids)
    return RecordSpec.default(ids, ids, bits=cfg.record_bits)


def capture_spec(layers: int, cfg: RLConfig) -> RecordSpec:
    """What the rollout records: the guidance spec, or 4 bits at every layer with `measure_all_sites`."""
    if cfg.measure_all_sites:
        ids = tuple(range(layers))
        return RecordSpec(bits=4, moe_layers=ids, attn_layers=ids)
    return record_spec(layers, cfg)


class Controller:
    def __init__(self, cfg: RLConfig, *, resume: bool = True):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.lock = RunLock(self.out)  # before anything in out_dir is read or changed
        try:
            self._start(resume)
        except BaseException:
            self.lock.release()
            raise

    def _start(self, resume: bool) -> None:
        cfg = self.cfg
        self.store = (self.out / "records").resolve()
        tiny, digits, state = load_megatron_state(cfg.model_dir)
        self.task = AdditionTask(digits)
        if self.task.prompt_len + cfg.max_new_tokens > tiny.max_seq:
            raise ValueError(f"prompt + max_new_tokens exceeds the model's max_seq {tiny.max_seq}")
        self.spec = record_spec(tiny.layers, cfg)
        trainer = RayTrainer if cfg.use_ray else MegatronTrainer
        self.trainer = trainer(
            tiny, state, mode=cfg.mode, spec=self.spec, lr=cfg.lr, max_version_diff=cfg.max_version_diff
        )
        pool_cfg = cfg.replace(model_dir=str(Path(cfg.model_dir).resolve()))  # worker processes may run elsewhere
        capture = capture_spec(tiny.layers, cfg)
        if cfg.rollout_backend == "sglang":
            from trace_rl.sglang_worker import SGLangPool

            self.pool = SGLangPool(pool_cfg, capture, self.task)
        else:
            self.pool = (RayPool if cfg.use_ray else LocalPool)(pool_cfg, capture, self.task)
        self.pending: deque[RolloutBatch] = deque()
        self.history: list[dict] = []
        self.step = 0
        self.checkpoint_steps: list[list[int]] = []  # pending rollout steps of each kept checkpoint
        if (self.out / LEGACY_CHECKPOINT).exists():
            raise ConfigError(f"{self.out / LEGACY_CHECKPOINT} has the old checkpoint format; use a new out_dir")
        if resume:
            self._load_checkpoint()
        else:
            for _, path in checkpoints(self.out):  # a fresh start: a later resume must not find the old run's
                path.unlink()
        self._discard_unsaved_rollouts()
        with open(self.out / METRICS, "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in self.history)

    def _discard_unsaved_rollouts(self) -> None:
        """Record-store steps that no checkpoint knows of (a fresh start, or rollouts after the last checkpoint)
        are regenerated, so their old directories go."""
        first = self.step + len(self.pending)
        stale = [s for s in list_steps(self.store) if s >= first] if self.store.exists() else []
        for s in stale:
            shutil.rmtree(step_dir(self.store, s))
        if stale:
            print(f"discarded record-store steps {stale} of {self.out} (not covered by a checkpoint)")

    def close(self) -> None:
        """Release `out_dir` (the lock); the controller is not used after."""
        self.lock.release()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- rollout
    def rollout(self, step: int) -> RolloutBatch:
        """Generate step `step`'s trajectories; the workers write their records into the store."""
        cfg, n = self.cfg, self.cfg.group_size
        operands = self.task.sample(cfg.prompts_per_step, torch.Generator().manual_seed(cfg.seed * 7919 + step))
        prompts = self.task.prompts(operands).repeat_interleave(n, dim=0)
        requests = []
        for w, groups in enumerate(torch.arange(cfg.prompts_per_step).tensor_split(cfg.rollout_workers)):
            if len(groups):
                rows = tuple(range(int(groups[0]) * n, (int(groups[-1]) + 1) * n))
                seed = (cfg.seed * 1_000_003 + step) * 64 + w
                requests.append(Request(w, step, prompts[list(rows)], rows, seed, str(self.store)))
        results, restarts = self.pool.run(requests)
        trajs = [t for out in results for t in out]
        index = finalize_step(self.store, step, attempts={str(i): t.attempt for i, t in enumerate(trajs)})
        stored = len(RecordReader(self.store, step).trajectories())
        if stored != len(trajs):
            raise RuntimeError(f"step {step}: {stored} trajectories in the record store, {len(trajs)} generated")
        versions = set(self.pool.versions())
        if len(versions) != 1:
            raise RuntimeError(f"rollout workers hold different policy versions {sorted(versions)}")
        stale = json.loads(index.read_bytes())["stale"]
        if stale:
            print(f"step {step}: set aside {len(stale)} shards of earlier rollout attempts: {stale}", file=sys.stderr)
        return RolloutBatch(step, versions.pop(), operands, trajs, restarts, len(stale))

    # ----------------------------------------------------------------- the loop
    def train_step(self) -> dict:
        """Fill the rollout pipeline, train on its oldest batch, sync weights; returns the step's metrics."""
        start = time.perf_counter()
        while len(self.pending) <= self.cfg.async_lag and self.step + len(self.pending) < self.cfg.steps:
            self.pending.append(self.rollout(self.step + len(self.pending)))
        batch = self.pending.popleft()
        rewards = self.task.reward(batch.operands.repeat_interleave(self.cfg.group_size, 0), batch_responses(batch))
        rolled = time.perf_counter()
        metrics = self.trainer.step(
            batch.trajectories, rewards, self.cfg.group_size, str(self.store), batch.step, batch.version
        )
        trained = time.perf_counter()
        version = self.trainer.policy_version()
        self.pool.load_weights(self.trainer.hf_weights(), version)
        apply_retention(self.store, self.cfg.keep_record_steps, protect=self._protected_steps())
        synced = time.perf_counter()
        metrics |= {
            "step": self.step,
            "mode": self.cfg.mode,
            "reward/mean": float(rewards.mean()),
            "rollout/response_len": sum(len(t.response) for t in batch.trajectories) / len(batch.trajectories),
            "rollout/restarts": float(batch.restarts),
            "rollout/stale_shards": float(batch.stale_shards),
            "time/step_s": synced - start,
            "time/rollout_s": rolled - start,
            "time/train_s": trained - rolled,
            "time/sync_s": synced - trained,
        }
        self.history.append(metrics)
        self.step += 1
        with open(self.out / METRICS, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
            self.save_checkpoint()
        return metrics

    def run(self, desc: str | None = None) -> list[dict]:
        bar = tqdm(range(self.step, self.cfg.steps), desc=desc or self.cfg.mode, unit="step")
        for _ in bar:
            m = self.train_step()
            bar.set_postfix(reward=f"{m['reward/mean']:.2f}", dlogp=f"{m['train_rollout_logprob_abs_diff']:.4f}")
        return self.history

    # ----------------------------------------------------------------- checkpoint
    def _protected_steps(self) -> set[int]:
        """Record steps retention must keep: the pending batches and those of every kept checkpoint."""
        return {b.step for b in self.pending} | {s for steps in self.checkpoint_steps for s in steps}

    def save_checkpoint(self) -> Path:
        """Trainer state, pending rollout batches (their records stay in the store) and metrics, fsynced and
        checksummed (`trace_rl.rundir`; the last two are kept)."""
        pending = [
            {
                "step": b.step,
                "version": b.version,
                "operands": b.operands,
                "restarts": b.restarts,
                "trajectories": [(t.tokens, t.prompt_len, t.logprobs, t.recorded, t.attempt) for t in b.trajectories],
            }
            for b in self.pending
        ]
        self.checkpoint_steps = [*self.checkpoint_steps[-1:], [b.step for b in self.pending]]
        state = {
            "config": asdict(self.cfg),
            "step": self.step,
            "trainer": self.trainer.state_dict(),
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
        saved = state["config"]
        changed = {k: (saved[k], getattr(self.cfg, k)) for k in RESUME_KEYS if saved[k] != getattr(self.cfg, k)}
        if changed and not self.cfg.force_resume:
            raise ValueError(
                f"checkpoint {path} was written with "
                + ", ".join(f"{k}={a!r}, the config has {b!r}" for k, (a, b) in changed.items())
                + " (these change the numerics; force_resume=true resumes anyway)"
            )
        if changed:
            print(f"force_resume: resuming {path} with changed settings {changed}", file=sys.stderr)
        self.trainer.load_state_dict(state["trainer"], lr=self.cfg.lr)
        self.step, self.history = state["step"], state["history"]
        self.checkpoint_steps = state["checkpoint_steps"]
        self.pending = deque(
            RolloutBatch(
                p["step"],
                p["version"],
                p["operands"],
                [Trajectory(*t[:3], None, *t[3:]) for t in p["trajectories"]],
                p["restarts"],
            )
            for p in state["pending"]
        )
        for b in self.pending:
            if not (step_dir(self.store, b.step) / INDEX_NAME).exists():
                raise StoreError(f"checkpoint {path} needs record step {b.step}, which {self.store} does not hold")
        version = self.trainer.policy_version()
        if version > 0:
            self.pool.load_weights(self.trainer.hf_weights(), version)


def batch_responses(batch: RolloutBatch) -> list[torch.Tensor]:
    return [t.response for t in batch.trajectories]
