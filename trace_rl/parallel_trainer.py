"""The RL trainer over a parallel layout: one `RankTrainer` per rank (TP with sequence parallelism, EP, PP, DP), the
ranks as Ray actors of a `trace_rl.trainer_group.TrainerGroup`, driven by the controller through `GroupTrainer`
(the `MegatronTrainer` interface).

A step on each rank: its data-parallel share of the rollout batch (contiguous trajectories) is read from the record
store, only the records of its pipeline stage's sites (`MegatronTrainer.prepare`); the session of each model chunk
slices the KV records to the rank's KV heads and the MoE-input records to the rows of its sequence-parallel chunk,
checked against the activation at the site. The micro-batch runs through Megatron's schedule
(`megatron_trace.parallel.forward_backward`: per-token loss over the step and DP, gradients reduced by Megatron's DDP
and `finalize_model_grads`), then AdamW on FP32 masters of the rank's shards after clipping by the global gradient
norm. Megatron's distributed optimizer (`megatron_trace.parallel.make_optimizer`) is not used here: it allocates on
CUDA by name and its state needs Megatron's distributed checkpointing, which this trainer does not write yet; every
DP replica keeps the full masters of its shards, as the single-rank trainer does.
"""

from __future__ import annotations

import math

import torch

from megatron_trace.config import TraceConfig
from megatron_trace.export import export_hf
from megatron_trace.loss import grpo_advantages, grpo_loss_terms, token_logprobs
from megatron_trace.parallel import Layout, MicroBatchInput, build_chunks, forward_backward, load_full_state, wrap_ddp
from megatron_trace.session import TraceSession
from megatron_trace.tiny import TinyMoEConfig, build_tiny_moe
from trace_core.records import RecordSpec
from trace_rl.engine import Trajectory
from trace_rl.trainer import MegatronTrainer

MAX_KEYS = ("train_rollout_logprob_diff_max",)
MIN_KEYS = ("train_rollout_logprob_diff_min",)


def check_layout(tiny: TinyMoEConfig, layout: Layout, dp: int) -> None:
    """Refuse a layout the model's dimensions cannot be split into, naming the dimension."""
    errors = [
        f"{name}={value} is not divisible by {key}={size}"
        for name, value, key, size in (
            ("heads", tiny.heads, "tp", layout.tp),
            ("kv_heads", tiny.kv_heads, "tp", layout.tp),
            ("vocab", tiny.vocab, "tp", layout.tp),
            ("experts", tiny.experts, "ep", layout.ep),
            ("layers", tiny.layers, "pp", layout.pp * layout.chunks),
        )
        if value % size
    ]
    if (dp * layout.tp) % layout.ep:
        errors.append(f"ep={layout.ep} must divide dp * tp = {dp * layout.tp}")
    if errors:
        raise ValueError(f"trainer layout tp={layout.tp} ep={layout.ep} pp={layout.pp} dp={dp}: " + "; ".join(errors))


class RankTrainer(MegatronTrainer):
    """One rank of the parallel trainer: this rank's model chunks (Megatron DDP, one `TraceSession` each) and
    AdamW on FP32 masters of its shards. Construct it in every rank of a torch.distributed launch (torchrun or a
    `TrainerGroup`); every method is collective."""

    def __init__(
        self,
        tiny: TinyMoEConfig,
        state: dict[str, torch.Tensor],
        *,
        layout: Layout,
        mode: str,
        spec: RecordSpec,
        lr: float,
        max_version_diff: int,
        clip_grad: float = 1.0,
        dtype: torch.dtype = torch.bfloat16,
    ):
        from megatron.core import parallel_state as ps

        layout.init()
        check_layout(tiny, layout, ps.get_data_parallel_world_size())
        self.layout, self.tiny = layout, tiny
        self.cfg = TraceConfig(mode=mode, spec=spec, replay_routes=True)
        chunks = build_chunks(
            lambda v: build_tiny_moe(tiny, dtype=dtype, routing_replay=True, vp_stage=v, **layout.config_overrides()),
            layout,
        )
        self.sessions = []
        for c in chunks:
            load_full_state(c, state)
            self.sessions.append(TraceSession(c, self.cfg))
        self.sites = {site for s in self.sessions for site in s.numerics.stats}
        self.chunks = wrap_ddp(chunks, distributed_optimizer=False)
        self._init_optimizer([p for c in self.chunks for p in c.parameters()], lr, max_version_diff, clip_grad)
        self.moe_layers = list(range(tiny.layers))  # the rollout records routes of every MoE layer

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The policy as HF tensors, gathered across the shards (on the first pipeline stage; `{}` elsewhere)."""
        return export_hf(list(self.chunks))

    def evaluate(self, *args, **kwargs):
        raise NotImplementedError("evaluate() runs on the single-rank trainer only (tp = ep = pp = dp = 1)")

    def _copies(self, p: torch.nn.Parameter) -> int:
        """Ranks that hold the same shard of `p` with the same gradient (it is counted once in the norm)."""
        from megatron.core import parallel_state as ps

        if not getattr(p, "allreduce", True):  # an expert (expert tensor parallelism is 1)
            return ps.get_expert_data_parallel_world_size()
        split = getattr(p, "tensor_model_parallel", False)
        return ps.get_data_parallel_world_size() * (1 if split else ps.get_tensor_model_parallel_world_size())

    def _clip_gradients(self) -> float:
        """Set the masters' gradients from the reduced `main_grad`s, clipped as `clip_grad_norm_` clips on one
        rank (coefficient `clip / (norm + 1e-6)`, at most 1) by the norm over the whole model. Returns the norm."""
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params:
            sq += p.main_grad.double().square().sum() / self._copies(p)
        torch.distributed.all_reduce(sq)
        norm = math.sqrt(float(sq))
        coef = min(1.0, self.clip_grad / (norm + 1e-6))
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = p.main_grad.float() * coef
        return norm

    def step(
        self, trajs: list[Trajectory], rewards: torch.Tensor, group_size: int, store: str, step: int, version: int
    ) -> dict[str, float]:
        """One GRPO update over the ranks (collective); every rank returns the metrics of the whole step."""
        from megatron.core import parallel_state as ps

        staleness = self._staleness(version)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if len(trajs) % dp:
            raise ValueError(f"{len(trajs)} trajectories do not split over dp={dp} ranks")
        per = len(trajs) // dp
        owned = range(dp_rank * per, (dp_rank + 1) * per)
        tp = self.layout.tp  # sequence parallelism splits the sequence: a multiple of TP
        seq = -(-max(len(t.tokens) for t in trajs) // tp) * tp
        batch = self.prepare(trajs, store, step, version, owned=owned, seq_len=seq, sites=self.sites)
        adv = grpo_advantages(rewards.to(self.device), group_size)[owned.start : owned.stop]
        tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None

        def loss_terms(logits, item):
            ids = item.mb.input_ids
            logp = token_logprobs(logits[:, :-1], ids[:, 1:], tp_group)
            total, n, report = grpo_loss_terms(logp, logp.detach(), batch.logp_rollout, adv, batch.mask)
            return total, n, report | {"tokens": float(n)}

        for c in self.chunks:
            c.zero_grad_buffer()
        reports = forward_backward(self.chunks, [MicroBatchInput(batch.mb, batch.source, {})], loss_terms)
        norm = self._clip_gradients()
        for s in self.sessions:
            s.check_routes()  # refuse the update if a bad route was replayed as placeholders
        self._update()
        sites: list[dict[str, float]] = []  # counters of each chunk's session (summed over all in `_combine`)
        for s in self.sessions:
            raw = {
                f"trace/L{layer}.{kind}/{name}": float(getattr(st, name))
                for (layer, kind), st in s.numerics.stats.items()
                for name in ("flipped", "compared")
            }
            sites.append({k: v for k, v in s.end_step().items() if not k.endswith("/code_flip_rate")} | raw)
        # Each DP rank's trajectories and each stage's sites once: on TP rank 0 (EP ranks hold other trajectories).
        tp0 = ps.get_tensor_model_parallel_rank() == 0
        captured = {site for s in self.sessions for site in s.numerics.captured}
        own = {
            "loss": reports[0] if reports else None,
            "sites": sites,
            "real_fallback": sum(batch.missing_rows[x] * batch.widths[x] for x in captured) if tp0 else 0,
            "records_missing": batch.records_missing if tp0 and ps.is_pipeline_first_stage(ignore_virtual=True) else 0,
        }
        everyone: list[dict] = [{}] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, own)
        self.version += 1
        metrics = _combine(everyone)
        metrics["actor/grad_norm"] = norm
        metrics["rollout/staleness"] = float(staleness)
        return metrics


def _combine(ranks: list[dict]) -> dict[str, float]:
    """The step's metrics from every rank's part: loss metrics token-weighted over the last stage's DP ranks (max /
    min where they are extremes), site counters summed (sites and rows are split between ranks), code-flip rates
    from the summed counts, RTN fallbacks on real tokens as the single-rank trainer counts them."""
    losses = [r["loss"] for r in ranks if r["loss"] is not None]
    metrics: dict[str, float] = {}
    for key in {k for r in losses for k in r} - {"tokens"}:
        values = [(r[key], r["tokens"]) for r in losses if key in r]
        if key in MAX_KEYS:
            metrics[key] = max(v for v, _ in values)
        elif key in MIN_KEYS:
            metrics[key] = min(v for v, _ in values)
        else:
            metrics[key] = sum(v * n for v, n in values) / sum(n for _, n in values)
    counts: dict[str, float] = {}
    for chunk in (c for r in ranks for c in r["sites"]):
        for k, v in chunk.items():
            counts[k] = counts.get(k, 0.0) + v
    for k, v in counts.items():
        if k.endswith("/compared"):
            site = k.removesuffix("compared")
            if v:
                metrics[site + "code_flip_rate"] = counts[site + "flipped"] / v
        elif not k.endswith("/flipped"):
            metrics[k] = v
    if "trace/rtn_fallback" in metrics:
        metrics["trace/rtn_fallback_real_tokens"] = float(sum(r["real_fallback"] for r in ranks))
    metrics["rollout/records_missing"] = float(sum(r["records_missing"] for r in ranks))
    return metrics


class GroupTrainer:
    """The controller's trainer over a layout of `world` ranks: a `RankTrainer` in each actor of a `TrainerGroup`
    (one CPU, and one GPU with `gpus_per_rank`, per rank), with the `MegatronTrainer` methods the controller calls.
    Checkpoints are per-rank states and restore at the same layout only."""

    def __init__(self, tiny: TinyMoEConfig, state: dict, *, layout: Layout, world: int, gpus_per_rank: float, **kw):
        import ray

        from trace_rl.trainer_group import TrainerGroup

        self.layout, self.world = layout, world
        self.group = TrainerGroup(world, gpus_per_rank=gpus_per_rank)
        self.group.start(RankTrainer, tiny, ray.put(state), layout=layout, **kw)

    def step(self, *args) -> dict[str, float]:
        return self.group.call("step", *args)[0]

    def hf_weights(self) -> dict[str, torch.Tensor]:
        return self.group.call("hf_weights")[0]  # rank 0 is on the first pipeline stage

    def policy_version(self) -> int:
        return self.group.call("policy_version")[0]

    def state_dict(self) -> dict:
        return {"layout": repr((self.layout, self.world)), "ranks": self.group.call("state_dict")}

    def load_state_dict(self, state: dict, lr: float | None = None) -> None:
        """Restore `state_dict()` of a run at this layout (another layout is refused by name)."""
        here = repr((self.layout, self.world))
        if state.get("layout") != here:
            saved = state.get("layout", "single rank")
            raise ValueError(f"checkpoint of trainer layout {saved} cannot restore at {here}")
        self.group.call_each("load_state_dict", [((s,), {"lr": lr}) for s in state["ranks"]])

    def shutdown(self) -> None:
        self.group.shutdown()
