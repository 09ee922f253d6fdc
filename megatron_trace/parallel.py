"""Parallel layouts of the trainer: TP (+SP), EP, PP (and virtual PP), DP with Megatron's DDP and distributed
optimizer, all run through Megatron's own schedule (`get_forward_backward_func`).

- `Layout`: the parallel sizes and the TransformerConfig fields they set.
- `build_chunks`: this rank's model chunks (one per virtual pipeline stage), each under its own `TraceSession`.
- `load_full_state` / `gather_full_state`: a full (single-rank) state dict in and out of this rank's shards; the
  rules are `shard_rules` below (what issue-17-style importers of HF checkpoints use too).
- `wrap_ddp`, `make_optimizer`: Megatron DDP (FP32 grad buffers) and `get_megatron_optimizer` with FP32 master
  weights (distributed optimizer: each DP rank keeps its shard of the masters and Adam state).
- `forward_backward`: one step's micro-batches through `get_forward_backward_func` with the per-token loss (sum
  and token count per micro-batch, `calculate_per_token_loss`): gradients are normalised by the tokens of the whole
  step, over micro-batches and DP ranks.

Shard rules (global name = the single-rank GPTModel's parameter name):
- PP: stage `p` (virtual stage `v`) holds decoder layers by Megatron's `get_transformer_layer_offset`; the local
  `decoder.layers.{k}` is global layer `layer_number - 1`. The embedding lives on the first stage, the final norm
  and output layer on the last.
- EP: `mlp.experts.local_experts.{j}` of EP rank `r` is global expert `r * experts / EP + j`; so is row `j` of a
  TRACE grouped weight `mlp.experts.linear_fc{1,2}.weight [E / EP, out, in]` (named SequentialMLP's way in the full
  state: `megatron_trace.grouped.grouped_expert_names`).
- TP: a parameter with `tensor_model_parallel` is split in `TP` contiguous chunks along `partition_dim` (QKV rows
  grouped per KV head, vocab rows, attention output columns); every other parameter is replicated. Experts are not
  TP-split (expert tensor parallelism 1).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from megatron_trace.grouped import grouped_expert_names

if TYPE_CHECKING:
    from megatron_trace.rows import MicroBatch
    from megatron_trace.source import RolloutSource

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of the trainer. Data parallel is `world / (tp * pp)`; EP divides `dp * tp`."""

    tp: int = 1
    ep: int = 1
    pp: int = 1
    vpp: int | None = None  # virtual pipeline stages per rank (interleaved 1F1B)
    dispatcher: str = "alltoall"  # Megatron's token dispatcher: alltoall or allgather

    def __post_init__(self) -> None:
        if min(self.tp, self.ep, self.pp) < 1 or (self.vpp is not None and (self.vpp < 2 or self.pp < 2)):
            raise ValueError(f"invalid layout {self}: sizes >= 1, vpp >= 2 and only with pp >= 2")
        if self.dispatcher not in ("alltoall", "allgather"):
            raise ValueError(f"dispatcher {self.dispatcher!r}: use alltoall or allgather (flex is not wired)")

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    def dp(self, world: int) -> int:
        if world % (self.tp * self.pp) or (world // self.pp) % self.ep:
            raise ValueError(f"{world} ranks do not fit tp={self.tp} x pp={self.pp} with ep={self.ep}")
        return world // (self.tp * self.pp)

    def config_overrides(self) -> dict:
        """TransformerConfig fields of this layout (sequence parallelism whenever TP > 1: MoE needs it)."""
        return {
            "tensor_model_parallel_size": self.tp,
            "sequence_parallel": self.tp > 1,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": 1,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "moe_token_dispatcher_type": self.dispatcher,
            "calculate_per_token_loss": True,
            # gloo matches the sends of one batched p2p call to a peer by order only: with PP = 2 the previous and
            # the next stage are one rank, and the interleaved schedule's batched forward + backward exchanges got
            # mixed (wrong activations, observed on CPU). NCCL keeps Megatron's default.
            "batch_p2p_comm": torch.cuda.is_available(),
        }

    def init(self, seed: int = 1234) -> None:
        """torch.distributed and Megatron's parallel state for this layout (`megatron_trace.cpu.init_megatron`)."""
        from megatron_trace.cpu import init_megatron

        init_megatron(self.tp, self.ep, self.pp, self.vpp, seed=seed)


def unwrap(chunk: torch.nn.Module) -> Any:
    """The GPTModel inside a DDP / Float16 wrapper (a megatron-core module: untyped, hence Any)."""
    model: Any = chunk
    while hasattr(model, "module"):
        model = model.module
    return model


def build_chunks(build: Callable[[int | None], torch.nn.Module], layout: Layout) -> list[torch.nn.Module]:
    """This rank's model chunks: `build(vp_stage)` per virtual pipeline stage (`None` without virtual PP)."""
    return [build(v) for v in range(layout.vpp)] if layout.vpp else [build(None)]


# ----------------------------------------------------------------------------------------- shards of a full state
def _global_name(model: torch.nn.Module, name: str) -> str:
    from megatron.core import parallel_state

    gpt: Any = model  # a megatron-core GPTModel (untyped)
    m = _LAYER.match(name)
    if m:
        layer = gpt.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}." + name[m.end() :]
    e = _EXPERT.search(name)
    if e:
        local = len(gpt.decoder.layers[0].mlp.experts.local_experts)
        expert = parallel_state.get_expert_model_parallel_rank() * local + int(e.group(1))
        name = name[: e.start()] + f".mlp.experts.local_experts.{expert}." + name[e.end() :]
    return name


def _tp_split(param: torch.Tensor) -> int | None:
    """The dimension a parameter is tensor-parallel split along, or None (replicated, or an expert with ETP 1)."""
    if not getattr(param, "tensor_model_parallel", False) or not getattr(param, "allreduce", True):
        return None
    return param.partition_dim  # type: ignore[attr-defined]  # set by megatron-core with tensor_model_parallel


def load_full_state(model: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy this rank's shard of every parameter of `model` (one chunk) out of the single-rank state dict `full`."""
    from megatron.core import parallel_state

    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    model = unwrap(model)
    with torch.no_grad():
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        for name, p in model.named_parameters():
            g = _global_name(model, name)
            rows = grouped_expert_names(g, ep_rank * p.shape[0], p.shape[0])  # grouped experts: SequentialMLP names
            src = torch.stack([full[n] for n in rows]) if rows else full[g]
            dim = _tp_split(p)
            if dim is not None and size > 1:
                src = src.chunk(size, dim=dim)[rank]
            if src.shape != p.shape:
                raise ValueError(f"{name}: full-state shard {tuple(src.shape)} does not fit {tuple(p.shape)}")
            p.copy_(src)


def _all_gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def gather_full_state(
    chunks: Sequence[torch.nn.Module],
    tensors: Callable[[torch.nn.Parameter], torch.Tensor] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The single-rank state dict (global names, full shapes, on `device`: default the CPU) of the model spread over
    all ranks: gathered across TP and EP with all-gathers, then across PP to the first pipeline stage. Every rank of
    the first stage returns it, the others `{}`. `tensors(param)` picks what to gather (default the parameter; e.g.
    its `main_grad`). A tensor already on `device` may be the parameter itself. Collective: every rank must call
    it. The PP gather goes through the CPU, so with PP > 1 only the CPU is accepted."""
    from megatron.core import parallel_state

    if torch.device(device).type != "cpu" and parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(f"gather_full_state(device={device!r}) with PP > 1: the pipeline gather is on the CPU")
    pick = tensors or (lambda p: p.detach())
    tp_group = parallel_state.get_tensor_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        model = unwrap(chunk)
        experts = parallel_state.get_expert_model_parallel_world_size()
        for name, p in model.named_parameters():
            t = pick(p)
            dim = _tp_split(p)
            if dim is not None and torch.distributed.get_world_size(tp_group) > 1:
                t = _all_gather(t, tp_group, dim)
            rows = grouped_expert_names(_global_name(model, name), 0, t.shape[0] * experts)
            if rows:  # grouped experts [E_local, out, in]: all EP ranks' rows, under SequentialMLP names
                t = _all_gather(t, ep_group, 0) if experts > 1 else t
                out |= {n: w.to(device) for n, w in zip(rows, t, strict=True)}
                continue
            e = _EXPERT.search(name)
            if e and experts > 1:
                gathered = _all_gather(t[None], ep_group, 0)
                local = len(model.decoder.layers[0].mlp.experts.local_experts)
                for r in range(experts):
                    g = _global_name(model, name)
                    g = _EXPERT.sub(f".mlp.experts.local_experts.{r * local + int(e.group(1))}.", g)
                    out[g] = gathered[r].to(device)
            else:
                out[_global_name(model, name)] = t.to(device)
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return out
    stages: list[dict[str, torch.Tensor] | None] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(stages, out, group=parallel_state.get_pipeline_model_parallel_group())
    if not parallel_state.is_pipeline_first_stage(ignore_virtual=True):
        return {}
    by_stage = cast(list[dict[str, torch.Tensor]], stages)  # all_gather_object filled every stage's entry
    return {k: v for stage in by_stage for k, v in stage.items()}


# ----------------------------------------------------------------------------------------- DDP and optimizer
def wrap_ddp(chunks: Sequence[torch.nn.Module], *, distributed_optimizer: bool = True) -> list[torch.nn.Module]:
    """Megatron DDP around each chunk (FP32 gradient buffers, reduce after the backward) and the schedule hooks
    (`no_sync`, `finalize_model_grads`) in the model config."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    wrapped = [
        DistributedDataParallel(unwrap(c).config, ddp_config, unwrap(c), disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]
    config = unwrap(wrapped[0]).config
    config.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapped


def make_optimizer(
    chunks: Sequence[torch.nn.Module],
    *,
    lr: float,
    optimizer: str = "adam",
    clip_grad: float = 0.0,
    distributed: bool = True,
    weight_decay: float = 0.0,
):
    """Megatron's optimizer over DDP-wrapped chunks: FP32 master weights (the model's BF16 parameters are copies),
    sharded over DP with `distributed`. On CPU parameters (gloo) megatron-core 0.19.2 needs TRACE's patch stack
    (`patches/megatron/`, applied by `make setup`): its optimizers sort parameters by CUDA tensor type and allocate on
    'cuda'; without the stack a ValueError says so."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    devices = {p.device.type for c in chunks for p in c.parameters()}
    if devices != {"cuda"} and "device='cuda'" in inspect.getsource(MixedPrecisionOptimizer.__init__):
        raise ValueError(
            f"Megatron's optimizers got parameters on {sorted(devices)} and megatron-core is not patched for them "
            "(they sort parameters by CUDA tensor type, distrib_optimizer.py:401, and allocate on 'cuda', "
            "optimizer.py:690-702): apply patches/megatron (`make setup`, or "
            "`python scripts/megatron_patches.py apply`)"
        )
    config = unwrap(chunks[0]).config
    opt_config = OptimizerConfig(
        optimizer=optimizer,
        lr=lr,
        weight_decay=weight_decay,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=distributed,
        clip_grad=clip_grad,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
    )
    return get_megatron_optimizer(opt_config, list(chunks))


def refuse_non_finite(norm: float) -> None:
    """Refuse an optimizer step whose global gradient norm is not finite (FloatingPointError naming it), before
    anything changes: the one check of both trainers (the single rank's norm of its masters' gradients,
    `step_optimizer`'s of the distributed optimizer's)."""
    if not math.isfinite(norm):
        raise FloatingPointError(
            f"non-finite gradient norm {norm}: the optimizer step is refused (parameters, masters and optimizer state "
            "unchanged)"
        )


def step_optimizer(optimizer) -> float:
    """One step of `make_optimizer`'s optimizer, refused before the update when the global gradient norm is not
    finite (`refuse_non_finite`): without a loss scaler (BF16, FP32) megatron-core 0.19.2 checks no gradient for
    inf / NaN (`MixedPrecisionOptimizer.prepare_grads`) and steps anyway, so a NaN gradient element would become a
    NaN master. The step is Megatron's own (`ChainedOptimizer.step`) taken in its public pieces, with the check
    between them and each done once: the main gradients (`prepare_grads`), the global norm (`get_grad_norm`),
    clipping by it (`clip_grad_by_total_norm_fp32`), the update and the parameters' all-gather
    (`step_with_ready_grads`). For the settings `make_optimizer` gives, that is all `ChainedOptimizer.step` does; the
    settings that add to it are refused by name. Collective (the norm is reduced over every rank, so every rank
    refuses together); returns the norm."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.optimizer.optimizer import MTP_GRAD_NORM_GROUP

    config, parts = optimizer.config, getattr(optimizer, "chained_optimizers", [optimizer])
    unsupported = {
        "a loss scaler": any(getattr(o, "grad_scaler", None) for o in parts),
        "grad_norm_skip_threshold": math.isfinite(config.grad_norm_skip_threshold),
        "log_num_zeros_in_grad": config.log_num_zeros_in_grad,
        "use_precision_aware_optimizer": config.use_precision_aware_optimizer,
        "a separate MTP gradient norm": optimizer.has_grad_norm_group(MTP_GRAD_NORM_GROUP),
    }
    if any(unsupported.values()):
        named = ", ".join(k for k, on in unsupported.items() if on)
        raise ValueError(f"step_optimizer takes the step of make_optimizer's settings; this optimizer has {named}")
    optimizer.prepare_grads()  # the main gradients (views of the reduced gradient buffers) that the norm reads
    norm = float(optimizer.get_grad_norm())
    refuse_non_finite(norm)
    for o in parts:
        params = [] if getattr(o, "is_stub_optimizer", False) else o.get_parameters()
        if params and o.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=o.config.clip_grad, total_norm=norm)
    if not optimizer.step_with_ready_grads():
        raise RuntimeError(f"Megatron's optimizer did not step (gradient norm {norm})")
    return norm


# ----------------------------------------------------------------------------------------- one step
@dataclass
class MicroBatchInput:
    """What a forward step needs: the packed micro-batch, its rollout source and the loss terms' inputs."""

    mb: MicroBatch
    source: RolloutSource | None
    extra: dict


def forward_backward(
    chunks: Sequence[torch.nn.Module],
    micro_batches: Sequence[MicroBatchInput],
    loss_terms: Callable[[torch.Tensor, MicroBatchInput], tuple[torch.Tensor, torch.Tensor, dict]],
    *,
    forward_only: bool = False,
    force_all_reduce: bool = False,
) -> list[dict]:
    """Run `micro_batches` (one shape: pack them with one `seq_len`) through Megatron's schedule for this layout.

    `loss_terms(logits, micro_batch)` gets the vocab-parallel logits `[B, S, V / TP]` on the last stage and returns
    `(loss sum, token count, report)`; with `calculate_per_token_loss` Megatron divides the gradients by the token
    count of the whole step (all micro-batches, all DP ranks). Each chunk's `TraceSession` gets its micro-batch in
    the forward step. `force_all_reduce` all-reduces the gradients over DP even with the distributed optimizer (every
    rank then holds the whole gradient). Returns the reports of the last stage's micro-batches (empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("forward_backward needs at least one micro-batch")
    shape = tuple(micro_batches[0].mb.input_ids.shape)
    if any(tuple(m.mb.input_ids.shape) != shape for m in micro_batches):
        raise ValueError("micro-batches of one step must share one [B, S] shape (pack with one seq_len)")

    def step(data_iterator, model):
        item = next(data_iterator)
        mb = item.mb
        session = unwrap(model)._trace_session
        if session is None:
            raise RuntimeError("every model chunk needs a TraceSession (bf16 mode for none of the FP4 sites)")
        session.begin_microbatch(mb.rows, item.source)
        logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)

        def loss_func(output):
            total, tokens, report = loss_terms(output, item)
            return total, tokens.to(torch.int), report

        return logits, loss_func

    iterators = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iterators,
        model=list(chunks) if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=shape[1],
        micro_batch_size=shape[0],
        forward_only=forward_only,
        force_all_reduce=force_all_reduce,
    )
