"""The trainer worker: the tiny Megatron Qwen3-MoE under a `TraceSession` (bf16 / qat / trace, R3), one GRPO update
per rollout batch, records and routes read back from the record store.

BF16 parameters as in production (`dtype`), with FP32 master weights for AdamW (the parameters are the BF16 copy of
the masters after every step). The experts are the TRACE grouped experts (`megatron_trace.grouped`, `experts =
"grouped"`) or Megatron's SequentialMLP (`"sequential"`); with `expert_weights_in_place` the grouped expert weights
hold their fake-quantized values after every master write (`TraceSession.quantize_weights_in_place`), so export,
checkpoints and evaluation copy the masters back in first (`_master_weights`). One micro-batch per step: the
rollout batch is small on the embedded default. This is one rank; `trace_rl.parallel_trainer` runs the same step
over a parallel layout (TP, EP, PP, DP) as a Ray group.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from megatron_trace import checkpoint
from megatron_trace.config import TraceConfig
from megatron_trace.cpu import init_single_rank
from megatron_trace.export import export_hf
from megatron_trace.loss import (
    LossConfig,
    grpo_advantages,
    grpo_loss,
    mismatch_metrics,
    token_entropy,
    token_logprobs,
)
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.parallel import gather_full_state, load_full_state, refuse_non_finite
from megatron_trace.rows import MicroBatch, pack_microbatch
from megatron_trace.session import Tap, TraceSession
from megatron_trace.sites import expert_weight_fake_quant
from megatron_trace.source import TensorRolloutSource, source_from_store
from trace_core.records.reader import RecordReader
from trace_core.records.spec import Binding, RecordSpec, token_digest
from trace_rl.config import check_trainer_experts
from trace_rl.optim import LRSchedule
from trace_rl.rollout.engine import Trajectory


@dataclass(frozen=True)
class TrainBatch:
    """One rollout batch ready for the trainer: the micro-batch and rollout source on the trainer's device, the
    response-token mask and rollout log-probs `[B, S - 1]`, and the counts the fallback metrics need."""

    mb: MicroBatch
    source: TensorRolloutSource
    mask: torch.Tensor
    logp_rollout: torch.Tensor
    widths: dict[tuple[int, str], int]  # record elements per token of each site in the store
    missing_rows: dict[tuple[int, str], int]  # real tokens without a record, per site (RTN fallback)
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
        tiny: MoEModelConfig,
        state: dict[str, torch.Tensor],
        *,
        mode: str,
        spec: RecordSpec,
        lr: float,
        max_version_diff: int,
        clip_grad: float = 1.0,
        dtype: torch.dtype = torch.bfloat16,
        experts: str = "grouped",
        expert_weights_in_place: bool = True,
        loss: LossConfig | None = None,
        weight_decay: float = 0.0,
        lr_schedule: LRSchedule | None = None,
    ):
        check_trainer_experts(experts, expert_weights_in_place)
        init_single_rank()
        self.model = build_moe_model(tiny, dtype=dtype, routing_replay=True, grouped=experts == "grouped")
        names = set(gather_full_state([self.model]))  # the full state's names (SequentialMLP's for either experts)
        missing, unexpected = sorted(names - set(state)), sorted(set(state) - names)
        if missing or unexpected:
            raise ValueError(f"trainer state does not match the model: missing {missing}, unexpected {unexpected}")
        load_full_state(self.model, state)
        self.cfg = TraceConfig(
            mode=mode, spec=spec, replay_routes=True, expert_weights_in_place=expert_weights_in_place
        )
        self.session = TraceSession(self.model, self.cfg)
        self.chunks = [self.model]
        self._set_algorithm(loss, weight_decay, lr, lr_schedule)
        self._init_optimizer(list(self.model.parameters()), lr, max_version_diff, clip_grad)
        self.moe_layers = sorted(self.session.moe_layers)
        self.ref: list | None = None  # the reference policy's chunks, only for a KL term (`_build_reference`)
        if self.loss.needs_reference:
            self._build_reference(
                lambda: [build_moe_model(tiny, dtype=dtype, routing_replay=True, grouped=experts == "grouped")], state
            )

    def _set_algorithm(
        self, loss: LossConfig | None, weight_decay: float, lr: float, lr_schedule: LRSchedule | None
    ) -> None:
        """The loss settings, AdamW's weight decay and the learning-rate schedule (peak `lr`) of both trainers
        (None: the defaults, today's loss and a constant rate)."""
        self.loss = LossConfig() if loss is None else loss
        self.lr_schedule = LRSchedule() if lr_schedule is None else lr_schedule
        self.weight_decay, self.peak_lr = weight_decay, lr
        self.ref_bytes = 0

    def _build_reference(self, build, state: dict[str, torch.Tensor]) -> None:
        """The frozen reference policy of the KL term: `build()`'s chunks loaded with the initial `state`, each under
        a session of the training mode (its own fake-quantized expert weights per step, never in place), no
        gradients; its parameter bytes are reported (`memory/reference_bytes`)."""
        cfg = dataclasses.replace(self.cfg, expert_weights_in_place=False)
        self.ref, self.ref_sessions = build(), []
        for c in self.ref:
            load_full_state(c, state)
            c.requires_grad_(False)
            self.ref_sessions.append(TraceSession(c, cfg))
        self.ref_bytes = sum(p.numel() * p.element_size() for c in self.ref for p in c.parameters())

    @torch.no_grad()
    def _reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The reference policy's log-probs of `batch` (one rank), routes and records replayed as the policy's; its
        session's site counters are dropped."""
        (model,), (session,) = self.ref, self.ref_sessions
        mb = batch.mb
        session.begin_microbatch(mb.rows, batch.source)
        logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)
        session.end_step()
        return token_logprobs(logits[:, :-1], mb.input_ids[:, 1:])

    def _scheduled_lr(self) -> float:
        """The learning rate of the next update (`lr_schedule` at the policy version), set on the optimizer's
        parameter groups unless the schedule is constant (then the optimizer's own rate is never touched)."""
        if self.lr_schedule.is_constant:
            return self.peak_lr
        lr = self.peak_lr * self.lr_schedule.factor(self.version)
        inner = (
            [self.opt]
            if isinstance(self.opt, torch.optim.Optimizer)
            else [o.optimizer for o in getattr(self.opt, "chained_optimizers", [self.opt]) if o.optimizer is not None]
        )
        for group in (g for o in inner for g in o.param_groups):
            group["lr"] = lr
        return lr

    def _loss_kwargs(self) -> dict:
        return dataclasses.asdict(self.loss)

    def training_sessions(self) -> list[TraceSession]:
        """The training session of each model chunk."""
        return [self.session]

    def _init_optimizer(self, params: list, lr: float, max_version_diff: int, clip_grad: float) -> None:
        """AdamW over FP32 masters of `params` (this rank's parameters; the model keeps its own `dtype`)."""
        self.params = [p for p in params if p.requires_grad]
        self.device = self.params[0].device
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        # weight_decay: decoupled, in `_update` (not AdamW's own: it would decay the norms too; Megatron's does not)
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.0)
        self.max_version_diff, self.clip_grad = max_version_diff, clip_grad
        self.version = 0
        self._quantize_in_place()

    def _masters_to_params(self) -> None:
        """The model's parameters become the (`dtype`) copy of the FP32 masters."""
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m)

    def _quantize_in_place(self) -> None:
        """With `expert_weights_in_place`: fake-quantize the grouped expert weights in place, from the parameters
        the masters were just copied into (once per master write: re-quantizing is not the identity)."""
        if self.cfg.expert_weights_in_place:
            for s in self.training_sessions():
                s.quantize_weights_in_place()

    def verify_in_place_weights(self) -> int:
        """With `expert_weights_in_place`: check that every grouped expert weight holds the fake-quantized copy of
        its FP32 master (in the parameters' dtype) and that the master is not itself that copy (a master the
        fake-quant overwrote, as an optimizer whose masters are views of FP32 parameters would let it). Collective:
        the distributed optimizer's masters are assembled over DP. Returns the number of weights checked; a
        RuntimeError names the first that fails."""
        if not self.cfg.expert_weights_in_place:
            raise ValueError("verify_in_place_weights needs expert_weights_in_place")
        master, _, _ = checkpoint.adam_state(self.params, self.opt)
        index = {id(p): i for i, p in enumerate(self.params)}
        names = {id(p): n for c in self.chunks for n, p in c.named_parameters()}
        weights = [w for s in self.training_sessions() for w in s.in_place_weights()]
        for w in weights:
            copy = master[index[id(w)]].to(w.dtype)
            if not torch.equal(expert_weight_fake_quant(copy, self.cfg.role("weights")), w.detach()):
                raise RuntimeError(f"{names[id(w)]}: the parameter is not the fake-quantized copy of its master")
            if torch.equal(copy, w.detach()):
                raise RuntimeError(f"{names[id(w)]}: the FP32 master holds the fake-quantized weight (overwritten)")
        return len(weights)

    @contextmanager
    def _master_weights(self) -> Iterator[None]:
        """Inside: the parameters are the masters' copy (the policy), not the in-place fake-quantized expert weights;
        after: quantized in place again. What export, checkpoints and evaluation read."""
        if not self.cfg.expert_weights_in_place:
            yield
            return
        self._masters_to_params()
        try:
            yield
        finally:
            self._quantize_in_place()

    def _export(self, chunks: list, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """`export_hf` of the masters' weights on `device`. On the parameters' device the exported tensors can be the
        parameters themselves: with in-place expert weights they are copied before the parameters are quantized
        again."""
        with self._master_weights():
            weights = export_hf(chunks, device=device)
            if self.cfg.expert_weights_in_place:
                weights = {k: w.clone() for k, w in weights.items()}
        return weights

    def hf_weights(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The policy as HF Qwen3-MoE checkpoint tensors (BF16) on `device`, for the rollout engines: the CPU, or the
        trainer's GPU for a colocated server (`update_weights_from_tensor` then gets CUDA IPC handles)."""
        return self._export([self.model], device)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy as a single-rank Megatron state dict (SequentialMLP names, the masters' weights in the model's
        dtype, on the CPU; `megatron_trace.parallel.load_full_state` loads it into any layout). Collective."""
        with self._master_weights():
            return {k: t.clone() for k, t in gather_full_state(self.chunks).items()}

    def prepare(
        self,
        trajs: list[Trajectory],
        store: str,
        step: int,
        version: int,
        *,
        owned: range | None = None,
        seq_len: int | None = None,
        sites: set | None = None,
    ) -> TrainBatch:
        """Pack `trajs` into one micro-batch on the trainer's device with their records and routes from rollout
        step `step` of the record store `store`, generated by policy `version`. Every trajectory's records must be
        bound to this step, version, trajectory id (its index), attempt and token ids (`BindingMismatchError`).

        A rank of a parallel trainer reads only what it owns: the trajectories `owned` (its data-parallel share,
        batch slots 0..len-1) padded to `seq_len` positions, and the records of `sites` (its pipeline stage's)."""
        owned = range(len(trajs)) if owned is None else owned
        mine = [trajs[i] for i in owned]
        mb = pack_microbatch([(j, t.tokens) for j, t in enumerate(mine)], seq_len=seq_len)
        s = mb.input_ids.shape[1]
        reader = RecordReader(store, step)
        pairs = list(zip(owned, mine, strict=True))
        reader.check_bindings(
            {
                str(i): Binding(step, version, str(i), t.attempt or "", token_digest(t.tokens), self.cfg.recipe.name)
                for i, t in pairs
            }
        )
        spans = [(i, 0, len(t.tokens) if t.recorded is None else t.recorded) for i, t in pairs]
        recs = reader.load(spans, pad_to=s)
        if sites is not None:
            recs = dataclasses.replace(
                recs,
                records={site: r for site, r in recs.records.items() if site in sites},
                has_record={site: m for site, m in recs.has_record.items() if site in sites},
            )
        trajs = mine
        for i, t in enumerate(trajs):
            if t.recorded is not None and t.recorded != len(t.tokens) - 1:
                raise ValueError(f"trajectory {i}: {t.recorded} recorded positions of {len(t.tokens)} tokens")
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
            source_from_store(recs, self.moe_layers, [len(t.tokens) for t in trajs]),
            mask.to(self.device),
            logp_rollout.to(self.device),
            {site: rec.n for site, rec in recs.records.items()},
            {site: int((~has).sum()) - no_record for site, has in recs.has_record.items()},
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
        metrics against the rollout and the session's site metrics, on the masters' weights (`_master_weights`).
        The training session is restored after."""
        with self._master_weights():
            self.session.remove()
            session = TraceSession(self.model, cfg, tap=tap)
            try:
                if cfg.expert_weights_in_place:
                    session.quantize_weights_in_place()
                logp = self._logprobs(batch, session)
                metrics = mismatch_metrics(logp, batch.logp_rollout, batch.mask) | session.end_step()
                metrics |= batch.fallback_on_real_tokens(metrics, session.numerics.captured)
            finally:
                session.remove()
                if cfg.expert_weights_in_place:
                    self._masters_to_params()
                self.session = TraceSession(self.model, self.cfg)
        return metrics

    def _staleness(self, version: int) -> int:
        """Policy versions between the rollout batch and the trainer; `StaleRolloutError` beyond the bound."""
        staleness = self.version - version
        if not 0 <= staleness <= self.max_version_diff:
            raise StaleRolloutError(
                f"rollout batch of policy version {version} is {staleness} versions behind the trainer "
                f"({self.version}); max_version_diff={self.max_version_diff}"
            )
        return staleness

    def step(
        self, trajs: list[Trajectory], rewards: torch.Tensor, group_size: int, store: str, step: int, version: int
    ) -> dict[str, float]:
        """One GRPO update on rollout step `step` of the record store `store`, generated by policy `version`;
        returns the step's metrics."""
        staleness = self._staleness(version)
        reading = time.perf_counter()
        batch = self.prepare(trajs, store, step, version)
        read_s = time.perf_counter() - reading
        mb = batch.mb
        self.session.begin_microbatch(mb.rows, batch.source)
        logits = self.model(mb.input_ids, mb.position_ids, mb.attention_mask)
        logp = token_logprobs(logits[:, :-1], mb.input_ids[:, 1:])
        entropy = token_entropy(logits[:, :-1]) if self.loss.needs_entropy else None
        logp_ref = self._reference_logprobs(batch) if self.ref is not None else None
        adv = grpo_advantages(rewards.to(self.device), group_size)
        loss, metrics = grpo_loss(
            logp,
            logp.detach(),
            batch.logp_rollout,
            adv,
            batch.mask,
            **self._loss_kwargs(),
            logp_ref=logp_ref,
            entropy=entropy,
        )
        metrics |= self._sample_metrics(logp.detach(), batch)
        loss.backward()
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        with self._refusable(step):
            metrics["actor/grad_norm"] = self._clip_gradients()
            self.session.check_routes()  # refuse the update if a bad route was replayed as placeholders
        metrics["actor/lr"] = self._scheduled_lr()
        self._update()
        metrics |= self.session.end_step()
        metrics |= batch.fallback_on_real_tokens(metrics, self.session.numerics.captured)
        metrics["rollout/staleness"] = float(staleness)
        metrics["rollout/records_missing"] = float(batch.records_missing)
        metrics["time/record_read_s"] = read_s  # records and routes read from the store, unpacked, moved to the device
        if self.ref is not None:
            metrics["memory/reference_bytes"] = float(self.ref_bytes)
        self.version += 1
        return metrics

    @staticmethod
    def _sample_metrics(logp: torch.Tensor, batch: TrainBatch, first: int = 0) -> dict:
        """`samples/logprob_abs_diff`: each trajectory's mean |train - rollout| log-prob over its response tokens,
        by trajectory index from `first` (a dict, popped by the controller for the sample log)."""
        m = batch.mask
        diff = torch.where(m, (logp.float() - batch.logp_rollout).abs(), 0.0).sum(1) / m.sum(1).clamp_min(1)
        return {"samples/logprob_abs_diff": {first + i: float(d) for i, d in enumerate(diff.tolist())}}

    @contextmanager
    def _refusable(self, step: int) -> Iterator[None]:
        """The checks that may refuse rollout step `step` before its update (a bad replayed route, a non-finite
        gradient norm: `megatron_trace.parallel.refuse_non_finite`), in either trainer. A refused step drops its
        gradients and ends every session's step, so that none of its gradients, site counters or routes reach the
        next step; parameters, masters and optimizer state are not touched yet. The error names the step."""
        try:
            yield
        except Exception as e:
            self.opt.zero_grad()
            for s in self.training_sessions():
                s.end_step()
            e.add_note(f"rollout step {step} refused: its gradients are dropped and its sessions' step is ended")
            raise

    def _clip_gradients(self) -> float:
        """Clip the masters' gradients by their global norm, returned; a non-finite norm refuses the step before
        any gradient changes."""
        norm = torch.nn.utils.get_total_norm([m.grad for m in self.master if m.grad is not None])
        refuse_non_finite(float(norm))
        torch.nn.utils.clip_grads_with_norm_(self.master, self.clip_grad, norm)  # clip_grad_norm_'s two steps
        return float(norm)

    def _update(self) -> None:
        """AdamW on the masters (gradients set), then the model's parameters follow them (expert weights quantized
        in place after, with `expert_weights_in_place`). Weight decay is AdamW's decoupled decay `(1 - lr * wd)`
        applied before the step to the matrices only, as Megatron's optimizer applies it (1-D norms undecayed)."""
        if self.weight_decay:
            lr = self.opt.param_groups[0]["lr"]
            with torch.no_grad():
                for m in self.master:
                    if m.dim() > 1 and m.grad is not None:
                        m.mul_(1 - lr * self.weight_decay)
        self.opt.step()
        self.opt.zero_grad()
        self._masters_to_params()
        self._quantize_in_place()

    def policy_version(self) -> int:
        return self.version

    def layout_name(self) -> str:
        return "tp=1 ep=1 pp=1 dp=1"

    def save_sharded(self, path: str) -> None:
        """Save the trainer (parameters, FP32 masters, AdamW state, policy version) as a Megatron distributed
        checkpoint in the new directory `path` (`megatron_trace.checkpoint`; any layout can load it). Collective."""
        with self._master_weights():  # the parameters' entries hold the masters' copy, not in-place fake-quant
            checkpoint.save(path, self.chunks, self.params, self.opt, version=self.version, layout=self.layout_name())

    def load_sharded(self, path: str, lr: float | None = None) -> None:
        """Restore `save_sharded`'s directory, saved at any layout. `lr` replaces the saved learning rate (a forced
        resume with another `lr`). Collective."""
        self.version = checkpoint.load(path, self.chunks, self.params, self.opt, lr=lr)["version"]
        if self.cfg.expert_weights_in_place:
            self._masters_to_params()
            self._quantize_in_place()


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

        from trace_rl.rollout.workers import init_ray

        init_ray()
        self._actor = ray.remote(_TrainerProcess).options(num_cpus=0, max_restarts=0).remote(*args, **kwargs)

    def __getattr__(self, name: str):
        import ray

        method = getattr(self._actor, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))
