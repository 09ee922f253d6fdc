"""The RL trainer over a parallel layout: one `RankTrainer` per rank (TP with sequence parallelism, EP, PP, DP), the
ranks as Ray actors of a `trace_rl.trainer_group.TrainerGroup`, driven by the controller through `GroupTrainer`
(the `MegatronTrainer` interface).

A step on each rank: its data-parallel share of the rollout batch (contiguous trajectories) is read from the record
store, only the records of its pipeline stage's sites (`MegatronTrainer.prepare`); the session of each model chunk
slices the KV records to the rank's KV heads and the MoE-input records to the rows of its sequence-parallel chunk,
checked against the activation at the site. The micro-batch runs through Megatron's schedule
(`megatron_trace.parallel.forward_backward`: per-token loss over the step and DP, gradients reduced by Megatron's DDP
and `finalize_model_grads`), then Megatron's distributed optimizer (`megatron_trace.parallel.make_optimizer`, on
GPUs and, with `patches/megatron` applied, on CPUs): clipping by the global gradient norm, AdamW on FP32 masters
(each DP rank keeping its range of every parameter's masters and moments, gradients reduce-scattered by DDP),
parameters all-gathered after the step. It is the single-rank trainer's update (torch's AdamW, betas 0.9 / 0.999,
eps 1e-8, no weight decay, clipping coefficient `clip / (norm + 1e-6)`). Checkpoints are Megatron distributed
checkpoints (`megatron_trace.checkpoint`): any layout, and the single-rank trainer, restore any other's.

With `expert_weights_in_place` the grouped expert weights are fake-quantized in place after every all-gather of
the updated parameters. The masters must stay the unquantized weights: for BF16 parameters they are the
optimizer's own FP32 copies; for FP32 parameters Megatron's masters are views of the parameters, so the in-place
expert weights get FP32 masters of their own (`RankTrainer._separate_fp32_masters`).
"""

from __future__ import annotations

import torch

from megatron_trace.config import TraceConfig
from megatron_trace.loss import LossConfig, grpo_advantages, grpo_loss_terms, token_entropy, token_logprobs
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.parallel import (
    Layout,
    MicroBatchInput,
    build_chunks,
    forward_backward,
    load_full_state,
    make_optimizer,
    step_optimizer,
    wrap_ddp,
)
from megatron_trace.session import TraceSession
from trace_core.records.spec import RecordSpec
from trace_rl.config import RLConfig, check_trainer_experts
from trace_rl.optim import LRSchedule
from trace_rl.rollout.engine import Trajectory
from trace_rl.trainer import MegatronTrainer

MAX_KEYS = ("train_rollout_logprob_diff_max",)
MIN_KEYS = ("train_rollout_logprob_diff_min",)
LOSS_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy")  # per loss unit (tokens or sequences)
REPORT_ONLY = ("tokens", "units", "samples")  # what `loss_terms` reports besides the metrics


def check_layout(tiny: MoEModelConfig, layout: Layout, dp: int) -> None:
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
    Megatron's distributed optimizer. A step's trajectories of this DP rank run as micro-batches of `micro_batch`
    trajectories (0: one micro-batch), gradients accumulated through Megatron's schedule. Construct it in every rank
    of a torch.distributed launch (torchrun or a `TrainerGroup`); every method is collective."""

    def __init__(
        self,
        tiny: MoEModelConfig,
        state: dict[str, torch.Tensor],
        *,
        layout: Layout,
        mode: str,
        spec: RecordSpec,
        lr: float,
        max_version_diff: int,
        clip_grad: float = 1.0,
        dtype: torch.dtype = torch.bfloat16,
        micro_batch: int = 0,
        experts: str = "grouped",
        expert_weights_in_place: bool = True,
        loss: LossConfig | None = None,
        weight_decay: float = 0.0,
        lr_schedule: LRSchedule | None = None,
    ):
        from megatron.core import parallel_state as ps

        check_trainer_experts(experts, expert_weights_in_place)
        layout.init()
        check_layout(tiny, layout, ps.get_data_parallel_world_size())
        self.layout, self.tiny, self.micro_batch = layout, tiny, micro_batch
        self.cfg = TraceConfig(
            mode=mode, spec=spec, replay_routes=True, expert_weights_in_place=expert_weights_in_place
        )
        grouped = experts == "grouped"

        def build():
            return build_chunks(
                lambda v: build_moe_model(
                    tiny, dtype=dtype, routing_replay=True, vp_stage=v, grouped=grouped, **layout.config_overrides()
                ),
                layout,
            )

        chunks = build()
        self.sessions = []
        for c in chunks:
            load_full_state(c, state)
            self.sessions.append(TraceSession(c, self.cfg))
        self.sites = {site for s in self.sessions for site in s.numerics.stats}
        self.chunks = wrap_ddp(chunks)
        self._set_algorithm(loss, weight_decay, lr, lr_schedule)
        self._init_optimizer([p for c in self.chunks for p in c.parameters()], lr, max_version_diff, clip_grad)
        self.moe_layers = list(range(tiny.layers))  # the rollout records routes of every MoE layer
        self.ref = None
        if self.loss.needs_reference:
            self._build_reference(build, state)  # this rank's shards of the reference, unwrapped (no gradients)

    def training_sessions(self) -> list[TraceSession]:
        return self.sessions

    def _init_optimizer(self, params: list, lr: float, max_version_diff: int, clip_grad: float) -> None:
        """Megatron's distributed optimizer over the DDP chunks (it holds its own FP32 ranges of the masters)."""
        self.params = [p for p in params if p.requires_grad]
        self.device = self.params[0].device
        self.master = []
        self.opt = make_optimizer(self.chunks, lr=lr, clip_grad=clip_grad, weight_decay=self.weight_decay)
        self.max_version_diff, self.clip_grad = max_version_diff, clip_grad
        self.version = 0
        self._separate_fp32_masters()
        self._quantize_in_place()  # after make_optimizer: its FP32 masters are made from the parameters

    def _separate_fp32_masters(self) -> None:
        """Megatron's distributed optimizer steps FP32 parameters in place: its masters of them
        (`shard_fp32_groups`) are views of the parameters, which the in-place fake-quant would overwrite. Each
        in-place expert weight's range gets an FP32 master of its own instead (with the view's attributes, which
        clipping reads), in the optimizer's group and shard lists alike; the optimizer then copies it into the
        parameters as it copies the masters of BF16 parameters (`_copy_main_params_to_model_params`)."""
        weights = {id(w) for s in self.sessions for w in s.in_place_weights()}
        for o in getattr(self.opt, "chained_optimizers", [self.opt]):
            if o.is_stub_optimizer:  # no parameters of this kind (dense / expert) on this rank
                continue
            for group, models, shards in zip(
                o.optimizer.param_groups, o.model_fp32_groups, o.shard_fp32_groups, strict=True
            ):
                for i, (p, view) in enumerate(zip(models, shards, strict=True)):
                    if id(p) not in weights:
                        continue
                    own = view.detach().clone().requires_grad_(view.requires_grad)
                    own.__dict__.update(view.__dict__)
                    shards[i] = own
                    (k,) = [k for k, t in enumerate(group["params"]) if t is view]
                    group["params"][k] = own

    def _masters_to_params(self) -> None:
        """Each rank copies its FP32 ranges into the parameters and the DP ranks all-gather them (collective)."""
        for o in getattr(self.opt, "chained_optimizers", [self.opt]):
            o._copy_main_params_to_model_params()
        for c in self.chunks:
            c.start_param_sync(force_sync=True)

    def hf_weights(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The policy as HF tensors on `device`, gathered across the shards (on the first pipeline stage; `{}`
        elsewhere)."""
        return self._export(list(self.chunks), device)

    def layout_name(self) -> str:
        from megatron.core import parallel_state as ps

        lay = self.layout
        return f"tp={lay.tp} ep={lay.ep} pp={lay.pp} vpp={lay.vpp} dp={ps.get_data_parallel_world_size()}"

    def evaluate(self, *args, **kwargs):
        raise NotImplementedError("evaluate() runs on the single-rank trainer only (tp = ep = pp = dp = 1)")

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
        size = self.micro_batch or per
        if per % size:
            raise ValueError(f"{per} trajectories per DP rank do not split into micro-batches of {size}")
        tp = self.layout.tp  # sequence parallelism splits the sequence: a multiple of TP
        seq = -(-max(len(t.tokens) for t in trajs) // tp) * tp  # one shape for every micro-batch of the step
        adv = grpo_advantages(rewards.to(self.device), group_size)
        items = []
        for lo in range(dp_rank * per, (dp_rank + 1) * per, size):
            batch = self.prepare(trajs, store, step, version, owned=range(lo, lo + size), seq_len=seq, sites=self.sites)
            extra = {"batch": batch, "adv": adv[lo : lo + size], "first": lo}
            items.append(MicroBatchInput(batch.mb, batch.source, extra))
        tp_group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        loss_kwargs = self._loss_kwargs()

        def reference_terms(logits, item):
            """The reference policy's log-probs, kept for the policy's loss of the same micro-batch (last stage)."""
            ids = item.mb.input_ids
            item.extra["logp_ref"] = logp = token_logprobs(logits[:, :-1], ids[:, 1:], tp_group)
            return logp.sum() * 0, item.extra["batch"].mask.sum(), {}

        def loss_terms(logits, item):
            ids, batch = item.mb.input_ids, item.extra["batch"]
            logp = token_logprobs(logits[:, :-1], ids[:, 1:], tp_group)
            entropy = token_entropy(logits[:, :-1], tp_group) if self.loss.needs_entropy else None
            total, n, report = grpo_loss_terms(
                logp,
                logp.detach(),
                batch.logp_rollout,
                item.extra["adv"],
                batch.mask,
                **loss_kwargs,
                logp_ref=item.extra.get("logp_ref"),
                entropy=entropy,
            )
            samples = self._sample_metrics(logp.detach(), batch, item.extra["first"])["samples/logprob_abs_diff"]
            return total, n, report | {"tokens": float(batch.mask.sum()), "units": float(n), "samples": samples}

        if self.ref is not None:
            with torch.no_grad():
                forward_backward(self.ref, items, reference_terms, forward_only=True)
            for s in self.ref_sessions:
                s.end_step()
        for c in self.chunks:
            c.zero_grad_buffer()
        reports = forward_backward(self.chunks, items, loss_terms)
        with self._refusable(step):
            self._check_routes()  # refuse the update if a bad route was replayed as placeholders, on every rank
            lr = self._scheduled_lr()
            norm = step_optimizer(self.opt)  # clips by the global norm, steps its ranges, all-gathers the parameters
        self.opt.zero_grad()
        self._quantize_in_place()
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
        batches = [item.extra["batch"] for item in items]
        own = {
            "losses": reports,
            "sites": sites,
            "real_fallback": sum(b.missing_rows[x] * b.widths[x] for b in batches for x in captured) if tp0 else 0,
            "records_missing": sum(b.records_missing for b in batches)
            if tp0 and ps.is_pipeline_first_stage(ignore_virtual=True)
            else 0,
            "reference_bytes": self.ref_bytes,
        }
        everyone: list[dict] = [{}] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, own)
        self.version += 1
        metrics = _combine(everyone)
        metrics["actor/grad_norm"] = float(norm)
        metrics["actor/lr"] = lr
        metrics["rollout/staleness"] = float(staleness)
        if self.ref is not None:
            metrics["memory/reference_bytes"] = float(sum(r["reference_bytes"] for r in everyone))
        return metrics

    def _check_routes(self) -> None:
        """Every session's replayed routes checked (`TraceSession.check_routes`) and the verdict shared: a bad route
        on any rank refuses the step on every rank (collective). Ranks hold other trajectories and layers, so only
        some may see it, and the others would wait in the optimizer's reductions for ranks that had left."""
        error = None
        try:
            for s in self.sessions:
                s.check_routes()
        except ValueError as e:
            error = e
        bad = torch.tensor([float(error is not None)], device=self.device)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        if error is not None:
            raise error
        if bad.item():
            raise ValueError("a bad rollout route on another rank: the step is refused on every rank")


def _combine(ranks: list[dict]) -> dict[str, float]:
    """The step's metrics from every rank's part: loss metrics token-weighted over the last stage's DP ranks (max /
    min where they are extremes), site counters summed (sites and rows are split between ranks), code-flip rates
    from the summed counts, RTN fallbacks on real tokens as the single-rank trainer counts them."""
    losses = [report for r in ranks for report in r["losses"]]
    metrics: dict = {}
    for key in {k for r in losses for k in r} - set(REPORT_ONLY):
        weight = "units" if key in LOSS_KEYS else "tokens"
        values = [(r[key], r[weight]) for r in losses if key in r]
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
    metrics["samples/logprob_abs_diff"] = {i: d for r in losses for i, d in r.get("samples", {}).items()}
    return metrics


class GroupTrainer:
    """The controller's trainer over a layout of `world` ranks: a `RankTrainer` in each actor of a `TrainerGroup`
    (one CPU, and one GPU with `gpus_per_rank`, per rank; all on one node when `world <= gpus_per_node`), with the
    `MegatronTrainer` methods the controller calls. The full initial state goes to every rank through Ray's object
    store once; each rank copies its shards out of it. Checkpoints are Megatron distributed checkpoints, which any
    layout (or the single-rank trainer) restores."""

    def __init__(
        self,
        tiny: MoEModelConfig,
        state: dict,
        *,
        layout: Layout,
        world: int,
        gpus_per_rank: float,
        gpus_per_node: int,
        **kw,
    ):
        import ray

        from trace_rl.trainer_group import TrainerGroup

        self.layout, self.world = layout, world
        # One node when the ranks fit on one (TP groups are consecutive ranks: Megatron's order puts TP innermost).
        strategy = "STRICT_PACK" if gpus_per_rank and world <= gpus_per_node else "PACK"
        self.group = TrainerGroup(world, gpus_per_rank=gpus_per_rank, strategy=strategy)
        self.group.start(RankTrainer, tiny, ray.put(state), layout=layout, **kw)

    @classmethod
    def from_config(cls, tiny: MoEModelConfig, state: dict, cfg: RLConfig, **kw) -> GroupTrainer:
        """The group of `cfg`'s layout keys (tp, ep, pp, dp, gpus_per_node, train_micro_batch); one GPU per rank with
        device = "cuda"."""
        layout = Layout(tp=cfg.tp, ep=cfg.ep, pp=cfg.pp)
        check_layout(tiny, layout, cfg.dp)
        return cls(
            tiny,
            state,
            layout=layout,
            world=cfg.trainer_world(),
            gpus_per_rank=1 if cfg.device == "cuda" else 0,
            gpus_per_node=cfg.gpus_per_node,
            micro_batch=cfg.train_micro_batch,
            **kw,
        )

    def step(self, *args) -> dict[str, float]:
        return self.group.call("step", *args)[0]

    def hf_weights(self) -> dict[str, torch.Tensor]:
        return self.group.call("hf_weights")[0]  # rank 0 is on the first pipeline stage

    def policy_version(self) -> int:
        return self.group.call("policy_version")[0]

    def save_sharded(self, path: str) -> None:
        """Every rank writes its shards of the trainer into the directory `path` (Megatron's distributed
        checkpointing: loadable at any layout, a single rank included). All ranks must see `path`: one node, or a
        shared file system."""
        self.group.call("save_sharded", path)

    def load_sharded(self, path: str, lr: float | None = None) -> None:
        """Every rank loads its shards of a checkpoint saved at any layout."""
        self.group.call("load_sharded", path, lr=lr)

    def shutdown(self) -> None:
        self.group.shutdown()
