"""The trainer worker: the tiny Megatron Qwen3-MoE under a `TraceSession` (bf16 / qat / trace, R3), one GRPO update
per rollout batch, records and routes read back from the record store.

BF16 parameters as in production, with FP32 master weights for AdamW (the parameters are the BF16 copy of the
masters after every step). One micro-batch per step: the rollout batch is small on the embedded default.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch

from megatron_trace.config import TraceConfig
from megatron_trace.cpu import init_single_rank
from megatron_trace.export import export_hf
from megatron_trace.loss import grpo_advantages, grpo_loss, mismatch_metrics, token_logprobs
from megatron_trace.rows import MicroBatch, pack_microbatch
from megatron_trace.session import Tap, TraceSession
from megatron_trace.source import TensorRolloutSource, source_from_store
from megatron_trace.tiny import TinyMoEConfig, build_tiny_moe
from trace_core.records import RecordSpec
from trace_core.store_reader import RecordReader
from trace_rl.engine import Trajectory


@dataclass(frozen=True)
class TrainBatch:
    """One rollout batch ready for the trainer: the micro-batch and rollout source on the trainer's device, the
    response-token mask and rollout log-probs `[B, S - 1]`, and the counts the fallback metrics need."""

    mb: MicroBatch
    source: TensorRolloutSource
    mask: torch.Tensor
    logp_rollout: torch.Tensor
    widths: dict[tuple[int, str], int]  # record elements per token of each site in the store
    no_record_rows: int  # rows without a record by construction (padding, SGLang's final token)
    records_missing: int  # rows the store had no record for (counted RTN fallback)

    def fallback_on_real_tokens(self, metrics: dict[str, float], captured: set) -> dict[str, float]:
        """`trace/rtn_fallback_real_tokens`: RTN fallbacks at the captured sites less those on rows that have no
        record by construction (not a missing record)."""
        if "trace/rtn_fallback" not in metrics:
            return {}
        width = sum(self.widths[site] for site in captured)
        return {"trace/rtn_fallback_real_tokens": metrics["trace/rtn_fallback"] - self.no_record_rows * width}


class StaleRolloutError(RuntimeError):
    """A rollout batch is older than `max_version_diff` policy versions."""


class MegatronTrainer:
    def __init__(
        self,
        tiny: TinyMoEConfig,
        state: dict[str, torch.Tensor],
        *,
        mode: str,
        spec: RecordSpec,
        lr: float,
        max_version_diff: int,
        clip_grad: float = 1.0,
    ):
        init_single_rank()
        self.model = build_tiny_moe(tiny, dtype=torch.bfloat16, routing_replay=True)
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"trainer state does not match the model: missing {missing}, unexpected {unexpected}")
        self.device = next(self.model.parameters()).device
        self.cfg = TraceConfig(mode=mode, spec=spec, replay_routes=True)
        self.session = TraceSession(self.model, self.cfg)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.0)
        self.max_version_diff, self.clip_grad = max_version_diff, clip_grad
        self.moe_layers = sorted(self.session.moe_layers)
        self.version = 0

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The policy as HF Qwen3-MoE checkpoint tensors (BF16), for the rollout engines."""
        return export_hf(self.model)

    def prepare(self, trajs: list[Trajectory], store: str, step: int) -> TrainBatch:
        """Pack `trajs` into one micro-batch on the trainer's device with their records and routes from rollout
        step `step` of the record store `store`."""
        mb = pack_microbatch([(i, t.tokens) for i, t in enumerate(trajs)])
        s = mb.input_ids.shape[1]
        reader = RecordReader(store, step)
        spans = [(i, 0, len(t.tokens) if t.recorded is None else t.recorded) for i, t in enumerate(trajs)]
        recs = reader.load(spans, pad_to=s)
        for i, t in enumerate(trajs):
            if t.recorded is None:
                continue
            if t.recorded != len(t.tokens) - 1:
                raise ValueError(f"trajectory {i}: {t.recorded} recorded positions of {len(t.tokens)} tokens")
            # An SGLang trajectory's final token was never fed back, so nothing is recorded there, while
            # `source_from_store` serves each trajectory's final recorded row without a route: mark that final
            # position as the (unused) placeholder row, so every real position keeps its route.
            if recs.routes is not None:
                recs.has_routes[i, t.recorded] = True
        recs = recs.to(self.device)
        mask = torch.zeros(len(trajs), s - 1, dtype=torch.bool)
        logp_rollout = torch.zeros(len(trajs), s - 1)
        for i, t in enumerate(trajs):
            p, n = t.prompt_len, len(t.response)
            mask[i, p - 1 : p - 1 + n] = True
            logp_rollout[i, p - 1 : p - 1 + n] = t.logprobs
        # Padding rows, and the never fed back final token of an SGLang trajectory, have no record by construction.
        no_record = int((~mb.valid).sum()) + sum(t.recorded is not None for t in trajs)
        return TrainBatch(
            mb.to(self.device),
            source_from_store(recs, self.moe_layers),
            mask.to(self.device),
            logp_rollout.to(self.device),
            {site: rec.n for site, rec in recs.records.items()},
            no_record,
            reader.stats.fallback_rows,
        )

    def _logprobs(self, batch: TrainBatch, session: TraceSession) -> torch.Tensor:
        mb = batch.mb
        session.begin_microbatch(mb.rows, batch.source)
        logits = self.model(mb.input_ids, mb.position_ids, mb.attention_mask)
        return token_logprobs(logits[:, :-1], mb.input_ids[:, 1:])

    @torch.no_grad()
    def evaluate(self, batch: TrainBatch, cfg: TraceConfig, tap: Tap | None = None) -> dict[str, float]:
        """Forward only under another `TraceConfig` (mode, record spec) on the current policy: the mismatch
        metrics against the rollout and the session's site metrics. The training session is restored after."""
        self.session.remove()
        session = TraceSession(self.model, cfg, tap=tap)
        try:
            logp = self._logprobs(batch, session)
            metrics = mismatch_metrics(logp, batch.logp_rollout, batch.mask) | session.end_step()
            metrics |= batch.fallback_on_real_tokens(metrics, session.numerics.captured)
        finally:
            session.remove()
            self.session = TraceSession(self.model, self.cfg)
        return metrics

    def step(
        self, trajs: list[Trajectory], rewards: torch.Tensor, group_size: int, store: str, step: int, version: int
    ) -> dict[str, float]:
        """One GRPO update on rollout step `step` of the record store `store`, generated by policy `version`;
        returns the step's metrics."""
        staleness = self.version - version
        if not 0 <= staleness <= self.max_version_diff:
            raise StaleRolloutError(
                f"rollout batch of policy version {version} is {staleness} versions behind the trainer "
                f"({self.version}); max_version_diff={self.max_version_diff}"
            )
        batch = self.prepare(trajs, store, step)
        logp = self._logprobs(batch, self.session)
        adv = grpo_advantages(rewards.to(self.device), group_size)
        loss, metrics = grpo_loss(logp, logp.detach(), batch.logp_rollout, adv, batch.mask)
        loss.backward()
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        metrics["actor/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.master, self.clip_grad))
        self.session.check_routes()  # refuse the update if a bad route was replayed as placeholders
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m)
        metrics |= self.session.end_step()
        metrics |= batch.fallback_on_real_tokens(metrics, self.session.numerics.captured)
        metrics["rollout/staleness"] = float(staleness)
        metrics["rollout/records_missing"] = float(batch.records_missing)
        self.version += 1
        return metrics

    def policy_version(self) -> int:
        return self.version

    def state_dict(self) -> dict:
        return {
            "master": [m.detach().clone() for m in self.master],
            "opt": self.opt.state_dict(),
            "version": self.version,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` (masters, optimizer, version); the BF16 parameters follow the masters."""
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.master, state["master"], strict=True):
                m.copy_(saved)
                p.copy_(saved)
        self.opt.load_state_dict(state["opt"])
        self.version = state["version"]


class _TrainerProcess(MegatronTrainer):
    """The trainer in its own process: a fresh rendezvous port (Ray workers inherit the driver's MASTER_PORT)."""

    def __init__(self, *args, **kwargs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        super().__init__(*args, **kwargs)


class RayTrainer:
    """A `MegatronTrainer` in a Ray actor process (one rank), with the same methods."""

    def __init__(self, *args, **kwargs):
        import ray

        from trace_rl.workers import init_ray

        init_ray()
        self._actor = ray.remote(_TrainerProcess).options(num_cpus=0, max_restarts=0).remote(*args, **kwargs)

    def __getattr__(self, name: str):
        import ray

        method = getattr(self._actor, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))
