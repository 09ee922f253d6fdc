"""The RL controller (in-process): rollout → records and routes into the store → rewards → trainer step → weight
sync, asynchronous by `async_lag` rollout batches within `max_version_diff`, with checkpoint and resume.

Rollout workers each own an `EmbeddedEngine`; a step's groups are split into one request per worker. A worker that
dies mid-request is replaced by a fresh one loaded with the current policy version and the request is run again
with the same seed; its records reach the store only as a whole shard once the request completes, so nothing is
lost or written twice. Restarts are counted (`rollout/restarts`).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from trace_core.records import RecordSpec
from trace_core.store import StepWriter, apply_retention, finalize_step
from trace_core.store_reader import RecordReader
from trace_rl.config import RLConfig
from trace_rl.engine import EmbeddedEngine, Trajectory, WorkerDied
from trace_rl.task import EOS, AdditionTask
from trace_rl.trainer import MegatronTrainer
from trace_rl.warmup import HF_DIR, load_megatron_state

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"


@dataclass
class RolloutBatch:
    step: int
    version: int
    operands: torch.Tensor
    trajectories: list[Trajectory]
    restarts: int


class RolloutWorker:
    """One rollout engine; `kill()` makes its next forward fail (what a lost process looks like to the caller)."""

    def __init__(self, cfg: RLConfig, spec: RecordSpec, task: AdditionTask, name: str):
        self.name = name
        self.engine = EmbeddedEngine(
            str(Path(cfg.model_dir) / HF_DIR),
            fp4=cfg.mode != "bf16",
            spec=spec,
            max_batch=cfg.prompts_per_step * cfg.group_size,
            max_len=task.prompt_len + cfg.max_new_tokens,
            device=cfg.device,
        )

    def kill(self) -> None:
        self.engine.alive = False

    def generate(self, prompts: torch.Tensor, max_new: int, seed: int, temperature: float) -> list[Trajectory]:
        return self.engine.generate(prompts, max_new, eos=EOS, seed=seed, temperature=temperature)


def record_spec(layers: int, cfg: RLConfig) -> RecordSpec:
    ids = tuple(range(layers))
    if cfg.record_all_layers:
        return RecordSpec(bits=cfg.record_bits, moe_layers=ids, attn_layers=ids)
    return RecordSpec.default(ids, ids, bits=cfg.record_bits)


class Controller:
    def __init__(self, cfg: RLConfig, *, resume: bool = True):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.store = self.out / "records"
        tiny, digits, state = load_megatron_state(cfg.model_dir)
        self.task = AdditionTask(digits)
        if self.task.prompt_len + cfg.max_new_tokens > tiny.max_seq:
            raise ValueError(f"prompt + max_new_tokens exceeds the model's max_seq {tiny.max_seq}")
        self.spec = record_spec(tiny.layers, cfg)
        self.trainer = MegatronTrainer(
            tiny, state, mode=cfg.mode, spec=self.spec, lr=cfg.lr, max_version_diff=cfg.max_version_diff
        )
        self.workers = [self._new_worker(i) for i in range(cfg.rollout_workers)]
        self.pending: deque[RolloutBatch] = deque()
        self.history: list[dict] = []
        self.step = 0
        if resume and (self.out / CHECKPOINT).exists():
            self._load_checkpoint()

    # ----------------------------------------------------------------- rollout
    def _new_worker(self, i: int) -> RolloutWorker:
        worker = RolloutWorker(self.cfg, self.spec, self.task, f"rollout{i}")
        if self.trainer.version > 0:
            worker.engine.load_weights(self.trainer.hf_weights(), self.trainer.version)
        return worker

    def rollout(self, step: int) -> RolloutBatch:
        """Generate step `step`'s trajectories and write their records into the store."""
        cfg, n = self.cfg, self.cfg.group_size
        operands = self.task.sample(cfg.prompts_per_step, torch.Generator().manual_seed(cfg.seed * 7919 + step))
        prompts = self.task.prompts(operands).repeat_interleave(n, dim=0)
        groups = torch.arange(cfg.prompts_per_step).tensor_split(len(self.workers))
        trajs: list[Trajectory] = []
        restarts = 0
        for w, group in enumerate(groups):
            if not len(group):
                continue
            rows = torch.arange(int(group[0]) * n, (int(group[-1]) + 1) * n)
            seed = (cfg.seed * 1_000_003 + step) * 64 + w
            while True:
                try:
                    out = self.workers[w].generate(prompts[rows], cfg.max_new_tokens, seed, cfg.temperature)
                    break
                except WorkerDied:
                    restarts += 1
                    if restarts > cfg.max_restarts:
                        raise RuntimeError(f"step {step}: rollout workers died {restarts} times") from None
                    self.workers[w] = self._new_worker(w)
            StepWriter(self.store, step).write({int(r): t.records for r, t in zip(rows, out, strict=True)})
            trajs += out
        finalize_step(self.store, step)
        stored = len(RecordReader(self.store, step).trajectories())
        if stored != len(trajs):
            raise RuntimeError(f"step {step}: {stored} trajectories in the record store, {len(trajs)} generated")
        version = self.workers[0].engine.version
        if any(wk.engine.version != version for wk in self.workers):
            raise RuntimeError("rollout workers hold different policy versions")
        return RolloutBatch(step, version, operands, trajs, restarts)

    # ----------------------------------------------------------------- the loop
    def train_step(self) -> dict:
        """Fill the rollout pipeline, train on its oldest batch, sync weights; returns the step's metrics."""
        start = time.perf_counter()
        while len(self.pending) <= self.cfg.async_lag and self.step + len(self.pending) < self.cfg.steps:
            self.pending.append(self.rollout(self.step + len(self.pending)))
        batch = self.pending.popleft()
        rewards = self.task.reward(batch.operands.repeat_interleave(self.cfg.group_size, 0), batch_responses(batch))
        reader = RecordReader(self.store, batch.step)
        metrics = self.trainer.step(batch.trajectories, rewards, self.cfg.group_size, reader, batch.version)
        weights = self.trainer.hf_weights()
        for worker in self.workers:
            worker.engine.load_weights(weights, self.trainer.version)
        apply_retention(self.store, self.cfg.keep_record_steps, protect=[b.step for b in self.pending])
        metrics |= {
            "step": self.step,
            "mode": self.cfg.mode,
            "reward/mean": float(rewards.mean()),
            "rollout/response_len": sum(len(t.response) for t in batch.trajectories) / len(batch.trajectories),
            "rollout/restarts": float(batch.restarts),
            "rollout/records_missing": float(reader.stats.fallback_rows),
            "time/step_s": time.perf_counter() - start,
        }
        self.history.append(metrics)
        self.step += 1
        with open(self.out / METRICS, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps:
            self.save_checkpoint()
        return metrics

    def run(self, desc: str | None = None) -> list[dict]:
        self.out.mkdir(parents=True, exist_ok=True)
        bar = tqdm(range(self.step, self.cfg.steps), desc=desc or self.cfg.mode, unit="step")
        for _ in bar:
            m = self.train_step()
            bar.set_postfix(reward=f"{m['reward/mean']:.2f}", dlogp=f"{m['train_rollout_logprob_abs_diff']:.4f}")
        return self.history

    # ----------------------------------------------------------------- checkpoint
    def save_checkpoint(self) -> Path:
        """Trainer state, pending rollout batches (their records stay in the store) and metrics, atomically."""
        pending = [
            {
                "step": b.step,
                "version": b.version,
                "operands": b.operands,
                "restarts": b.restarts,
                "trajectories": [(t.tokens, t.prompt_len, t.logprobs) for t in b.trajectories],
            }
            for b in self.pending
        ]
        state = {
            "config": asdict(self.cfg),
            "step": self.step,
            "trainer": self.trainer.state_dict(),
            "pending": pending,
            "history": self.history,
        }
        path = self.out / CHECKPOINT
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    def _load_checkpoint(self) -> None:
        path = self.out / CHECKPOINT
        state = torch.load(path, weights_only=True)
        saved = state["config"]
        for key in ("mode", "model_dir", "prompts_per_step", "group_size", "seed", "record_bits", "async_lag"):
            if saved[key] != getattr(self.cfg, key):
                raise ValueError(
                    f"checkpoint {path} was written with {key}={saved[key]!r}, the config has {getattr(self.cfg, key)!r}"
                )
        self.trainer.load_state_dict(state["trainer"])
        self.step, self.history = state["step"], state["history"]
        self.pending = deque(
            RolloutBatch(
                p["step"],
                p["version"],
                p["operands"],
                [Trajectory(*t, records=None) for t in p["trajectories"]],
                p["restarts"],
            )  # fmt: skip
            for p in state["pending"]
        )
        if self.trainer.version > 0:
            weights = self.trainer.hf_weights()
            for worker in self.workers:
                worker.engine.load_weights(weights, self.trainer.version)
        with open(self.out / METRICS, "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in self.history)


def batch_responses(batch: RolloutBatch) -> list[torch.Tensor]:
    return [t.response for t in batch.trajectories]
