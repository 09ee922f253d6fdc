"""TRACE grouped experts for megatron-core 0.19.2: a grouped linear on `torch.nn.functional.grouped_mm` that plugs
into Megatron's `TEGroupedMLP` through its `GroupedLinearFc1Builder` / `GroupedLinearFc2Builder` protocols (its
non-fused forward needs no TransformerEngine), and the layer spec that builds it.

- All local experts of a linear are one parameter `weight [E, out, in]`: one grouped GEMM per linear, and the NVFP4
  weight fake-quant of all experts is one launch, once per optimizer step, reused by every micro-batch and
  recompute. Either kept as a copy (`SiteNumerics.expert_weights`, straight-through to `weight`), or, with
  `TraceConfig.expert_weights_in_place`, written into `weight` itself after the FP32 masters are copied in
  (no copy: the GEMM reads the parameter, whose gradient is the straight-through gradient the masters take).
- FC2's input goes through `SiteNumerics.fc2_input` (the trainer's site code) inside the FC2 linear, and the FC2
  linear applies the router's top-k weights to its output rows (`row_scaled_grouped_mm`: where the rollout applies
  them, without keeping the FC2 output for their gradient).
- Checkpoints: `state_dict()` names the experts `weight0 .. weight{E-1}` like TE's `GroupedLinear`, and
  `sharded_state_dict()` gives the keys, shapes and expert offsets of `TEGroupedMLP` / `SequentialMLP`
  (`...experts.linear_fc1.weight` sharded over the global expert axis), so distributed checkpoints interchange;
  `grouped_expert_names` maps a grouped weight's rows to SequentialMLP's parameter names (full state dicts).
`TraceSession` wires the sites in (`GroupedSites`); without a session, or in `bf16`, the linear is a plain
grouped GEMM.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F

from megatron_trace.sites import expert_weight_fake_quant
from trace_core.numerics.guided import straight_through

Quantizer = Callable[[torch.Tensor], torch.Tensor]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (grouped_mm's backward refuses expanded
    gradients such as the one of `y.sum()`)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def group_offsets(tokens_per_expert: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """int32 end offset of each expert's rows on `device`, for `grouped_mm(offs=...)`. A device tensor of counts
    stays on the device; a host list is copied without blocking the host (pinned buffer on CUDA)."""
    if isinstance(tokens_per_expert, torch.Tensor) and tokens_per_expert.device == device:
        return torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
    counts = torch.as_tensor(tokens_per_expert, dtype=torch.int64, device="cpu")
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    if device.type == "cuda":
        return offs.pin_memory().to(device, non_blocking=True)
    return offs.to(device)


class _RowScaledGroupedMM(torch.autograd.Function):
    """FC2 with the router's top-k weights on its output, `(grouped_mm(x, w^T) * scale[:, None]).to(x.dtype)`, as
    the rollout applies them (after FC2, so the FC2 input is the unweighted row the FP4 convention quantizes).

    Autograd of the unfused product would keep the `[rows, out]` FC2 output for the gradient of `scale`; this keeps
    only what the GEMM keeps anyway (`x`, `w`) and takes that gradient on the input side: with `u = g @ w[e]`,
    `d scale = sum(u * x)` and `dx = u * scale` (the same values in exact arithmetic; the rounding of `dx` differs from
    `(g * scale) @ w[e]`). `dw` is what autograd gives, bit for bit. Twin: `row_scaled_grouped_mm_reference`.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        y = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
        ctx.save_for_backward(x, w, offs, scale)
        return _scale_rows(y, scale, out=y)  # y is not kept: scaled in place

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w, offs, scale = ctx.saved_tensors
        g = g.contiguous()
        dw = None
        if ctx.needs_input_grad[1]:  # the gradient autograd would pass to the GEMM's output (g may be shared)
            dw = F.grouped_mm(_scale_rows(g, scale).t(), x, offs=offs)
        u = F.grouped_mm(g, w, offs=offs)
        dx = _scale_rows(u, scale, dtype=x.dtype)
        dscale = None
        if ctx.needs_input_grad[3]:
            wide = torch.promote_types(x.dtype, scale.dtype)  # the product's dtype in the forward
            dscale = (u.to(wide) * x.to(wide)).sum(-1).to(scale.dtype)
        return dx, dw, None, dscale


def _scale_rows(
    t: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`(t * scale[:, None]).to(dtype or t.dtype)` in one pass: the product is taken in the promoted dtype and
    rounded once on store (the same values as the two eager ops, without their promoted-dtype temporary); into `out`
    if given (may be `t`)."""
    if out is None:
        out = torch.empty_like(t, dtype=dtype or t.dtype)
    return torch.mul(t, scale.unsqueeze(-1), out=out)


def row_scaled_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`(grouped_mm(x, w^T, offs) * scale[:, None]).to(x.dtype)` keeping only `x`, `w` for the backward
    (`_RowScaledGroupedMM`)."""
    return _RowScaledGroupedMM.apply(x, w, offs, scale)


def row_scaled_grouped_mm_reference(
    x: torch.Tensor, w: torch.Tensor, counts: list[int], scale: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Pure-torch twin of `_RowScaledGroupedMM` (a loop of per-expert matmuls): `(out, dx, dw, dscale)` for the
    output gradient `g`."""
    wide = torch.promote_types(x.dtype, scale.dtype)
    outs, dxs, dws, dss = [], [], [], []
    for e, (xe, ge, se) in enumerate(zip(x.split(counts), g.split(counts), scale.split(counts), strict=True)):
        s = se.unsqueeze(-1)
        outs.append(((xe @ w[e].T) * s).to(x.dtype))
        u = (ge @ w[e]).to(wide)
        dxs.append((u * s).to(x.dtype))
        dws.append((ge.to(wide) * s).to(g.dtype).T @ xe)
        dss.append((u * xe.to(wide)).sum(-1).to(scale.dtype))
    return torch.cat(outs), torch.cat(dxs), torch.stack(dws), torch.cat(dss)


class TraceGroupedLinear(torch.nn.Module):
    """The local experts' linear of one kind (FC1 or FC2) as one grouped GEMM, `y[rows of e] = x @ weight[e].T`.

    `weight_quant` (all experts' weights -> their fake-quantized values) and `input_quant` (rows -> fake-quantized
    rows, straight-through) are set by `install`; None means BF16.
    """

    def __init__(
        self,
        num_local_experts: int,
        input_size: int,
        output_size: int,
        /,
        *,
        parallel_mode: str,
        config,
        init_method: Callable[[torch.Tensor], None],
        bias: bool,
        skip_bias_add: bool,
        is_expert: bool,
        tp_comm_buffer_name: str | None,
        pg_collection=None,
        name: str | None = None,
    ):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
        from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection

        super().__init__()
        del skip_bias_add, tp_comm_buffer_name, name  # no bias, no TE comm overlap
        if bias:
            raise NotImplementedError("TraceGroupedLinear: expert biases (add_bias_linear) are not supported")
        if not is_expert:
            raise ValueError("TraceGroupedLinear builds routed experts only (is_expert=True)")
        if config.delay_wgrad_compute or config.overlap_dispatch_backward_with_experts_wgrad:
            raise NotImplementedError("TraceGroupedLinear computes weight gradients in the backward (no delay_wgrad)")
        pgs = pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()
        if pgs.expt_tp is not None and pgs.expt_tp.size() > 1:
            raise NotImplementedError("TraceGroupedLinear: expert tensor parallelism (ETP > 1) is not supported")
        self.config = config
        self.num_local_experts = num_local_experts
        self.in_features, self.out_features = input_size, output_size
        self.parallel_mode = parallel_mode
        self._pg_collection = pgs
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(num_local_experts, output_size, input_size, dtype=config.params_dtype, device=device)
        )
        set_tensor_model_parallel_attributes(self.weight, True, 0 if parallel_mode == "column" else 1, 1)
        # Reduced over the expert-data-parallel group under expert parallelism (as Megatron's expert linears).
        self.weight.allreduce = not (config.expert_model_parallel_size > 1)  # type: ignore[attr-defined]
        if config.perform_initialization:
            with torch.no_grad():
                if config.use_cpu_initialization:  # as Megatron's CPU init: an FP32 master per matrix, then cast
                    for e in range(num_local_experts):
                        master = torch.empty(output_size, input_size, dtype=torch.float32)
                        init_method(master)
                        self.weight[e].copy_(master)
                else:
                    with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                        for e in range(num_local_experts):
                            init_method(self.weight[e])
        self.weight_quant: Quantizer | None = None
        self.input_quant: Quantizer | None = None
        self.row_scale: torch.Tensor | None = None  # per-row output scale for the next forward (`GroupedSites`)
        # In-place weights (`GroupedSites(in_place=True)`): `weight._version` right after its fake-quant was written
        # (-1: not yet); the forward refuses weights written since.
        self.quantized_version: int | None = None
        self._register_state_dict_hook(_split_experts)
        self._register_load_state_dict_pre_hook(partial(_stack_experts, num_local_experts))

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int] | torch.Tensor) -> tuple[torch.Tensor, None]:
        """`x [N, in]` rows grouped by local expert (`tokens_per_expert` rows each) -> `([N, out], None)`; a pending
        `row_scale [N]` (taken by this call) multiplies the output rows (`_RowScaledGroupedMM`)."""
        scale, self.row_scale = self.row_scale, None
        if self.input_quant is not None:
            x = self.input_quant(x)
        w: torch.Tensor = self.weight
        if self.quantized_version is not None and w._version != self.quantized_version:
            raise RuntimeError(
                "TraceGroupedLinear: the expert weights were written after their in-place fake-quant (or never "
                "quantized): call TraceSession.quantize_weights_in_place() after copying the masters in"
            )
        if self.weight_quant is not None:
            w = straight_through(w, self.weight_quant(w))
        offs = group_offsets(tokens_per_expert, x.device)
        if scale is not None:
            if tuple(scale.shape) != (x.shape[0],):
                raise ValueError(f"row_scale {tuple(scale.shape)} does not match the {x.shape[0]} input rows")
            return row_scaled_grouped_mm(x, w, offs, scale), None
        y = F.grouped_mm(x, w.transpose(-2, -1), offs=offs)
        return _ContiguousGrad.apply(y), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward (no delayed wgrad)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Per expert `{prefix}weight{i}` -> ShardedTensor `{prefix}weight` at global expert index
        `ep_rank * E + i` of `ep_size * E`: the keys and offsets of TE's grouped linear and SequentialMLP."""
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        metadata = metadata or {}
        singleton = metadata.get("singleton_local_shards", False)
        ep = self._pg_collection.ep
        num_global = ep.size() * self.num_local_experts
        offset = ep.rank() * self.num_local_experts
        tp_axis = 0 if self.parallel_mode == "column" else 1
        out = {}
        for i in range(self.num_local_experts):
            g = offset + i
            if singleton:
                expert_prefix, offsets = f"{g}.{prefix}", sharded_offsets
            else:
                expert_prefix, offsets = prefix, (*sharded_offsets, (len(sharded_offsets), g, num_global))
            sub = make_sharded_tensors_for_checkpoint(
                {f"{i}.weight": self.weight[i]},
                "",
                {f"{i}.weight": tp_axis},
                offsets,
                tp_group=self._pg_collection.expt_tp,
                dp_cp_group=metadata.get("dp_cp_group"),
            )
            replace_prefix_for_sharding(sub, f"{i}.", expert_prefix)
            sh = sub[f"{i}.weight"]
            sh.replica_id = (*sh.replica_id[:2], self._pg_collection.expt_dp.rank())
            out[f"{prefix}weight{i}"] = sh
        return out


_GROUPED_WEIGHT = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight$")


def grouped_expert_names(name: str, first_expert: int, num_experts: int) -> list[str] | None:
    """SequentialMLP's parameter names for the experts that rows `0 .. num_experts - 1` of a TRACE grouped weight
    hold (`...mlp.experts.linear_fc1.weight` -> `...mlp.experts.local_experts.{first_expert + i}.linear_fc1.weight`),
    or None when `name` is not a grouped expert weight. One global naming for both kinds of experts, as their
    sharded state dicts have: a full single-rank state dict in SequentialMLP names serves either model, with
    `first_expert = ep_rank * num_local_experts` for this EP rank's rows."""
    m = _GROUPED_WEIGHT.search(name)
    if m is None:
        return None
    head = name[: m.start()]
    return [f"{head}.mlp.experts.local_experts.{first_expert + i}.{m.group(1)}.weight" for i in range(num_experts)]


def _split_experts(module: TraceGroupedLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    w = state_dict.pop(prefix + "weight")
    for i in range(module.num_local_experts):
        state_dict[f"{prefix}weight{i}"] = w[i]


def _stack_experts(num_local_experts: int, state_dict: dict, prefix: str, *args) -> None:
    keys = [f"{prefix}weight{i}" for i in range(num_local_experts)]
    if all(k in state_dict for k in keys):
        state_dict[prefix + "weight"] = torch.stack([state_dict.pop(k) for k in keys])


TraceColumnGroupedLinear = partial(TraceGroupedLinear, parallel_mode="column")
"""`GroupedLinearFc1Builder`: FC1 (gate and up stacked, `[E, 2 * ffn, hidden]` with a gated unit)."""
TraceRowGroupedLinear = partial(TraceGroupedLinear, parallel_mode="row")
"""`GroupedLinearFc2Builder`: FC2 (`[E, hidden, ffn]`)."""


def grouped_experts_spec():
    """The experts builder for `MoESubmodules.experts`: Megatron's `TEGroupedMLP` with TRACE grouped linears."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    return partial(
        TEGroupedMLP,
        submodules=GroupedMLPSubmodules(linear_fc1=TraceColumnGroupedLinear, linear_fc2=TraceRowGroupedLinear),
    )


def with_grouped_experts(layer_spec):
    """A copy of a GPT layer spec (e.g. `get_gpt_layer_local_spec(num_experts=...)`) whose MoE layer runs the
    TRACE grouped experts; attention, router, dispatcher and shared experts are unchanged."""
    mlp = layer_spec.submodules.mlp
    if not isinstance(mlp, partial) or "submodules" not in mlp.keywords:
        raise ValueError(f"layer spec has no MoE builder with submodules: {mlp!r}")
    moe_submodules = dataclasses.replace(mlp.keywords["submodules"], experts=grouped_experts_spec())
    new_mlp = partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": moe_submodules})
    submodules = dataclasses.replace(layer_spec.submodules, mlp=new_mlp)
    return dataclasses.replace(layer_spec, submodules=submodules)


def is_trace_grouped(experts: torch.nn.Module) -> bool:
    """Whether `experts` is a `TEGroupedMLP` built with the TRACE grouped linears."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    return (
        isinstance(experts, TEGroupedMLP)
        and isinstance(experts.linear_fc1, TraceGroupedLinear)
        and isinstance(experts.linear_fc2, TraceGroupedLinear)
    )


class GroupedSites:
    """The weight and FC2-input sites of one TRACE grouped-experts module, and the router's top-k weights moved
    from the activation (where Megatron applies them) to FC2's output rows (where the rollout does, so FC2's input
    is unweighted); `remove()` restores BF16 (in place: the parameters keep their values until the masters are
    copied in again).

    Expert weights: a fake-quantized copy per step (`numerics.expert_weights`, straight-through), or with
    `in_place` the fake-quantized values written into the parameters by `write_fake_quant`."""

    def __init__(self, experts: torch.nn.Module, numerics, *, in_place: bool = False):
        # `experts` passed `is_trace_grouped`: both linears are TRACE grouped linears.
        fc1 = cast(TraceGroupedLinear, experts.linear_fc1)
        fc2 = cast(TraceGroupedLinear, experts.linear_fc2)
        self.linears = (fc1, fc2)
        self.role = numerics.cfg.role("weights")
        for lin in self.linears:
            lin.weight_quant = None if in_place else numerics.expert_weights
            lin.quantized_version = -1 if in_place else None
        fc2.input_quant = numerics.fc2_input
        self._hook = experts.register_forward_pre_hook(self._probs_to_fc2_output)

    def _probs_to_fc2_output(self, experts: torch.nn.Module, args: tuple) -> tuple:
        """Megatron still multiplies its activation by the probabilities it gets: ones in the activation's dtype
        (the product is the activation exactly, in one pass, where FP32 ones would promote it to FP32 and back)."""
        hidden, tokens_per_expert, probs, *rest = args
        cast(TraceGroupedLinear, experts.linear_fc2).row_scale = probs
        return (hidden, tokens_per_expert, torch.ones_like(probs, dtype=hidden.dtype), *rest)

    def write_fake_quant(self) -> None:
        """Overwrite each linear's weights with their fake-quantized values (all experts in one launch per linear,
        the values the copy path uses). Every call quantizes: re-quantizing already quantized NVFP4 weights is not
        the identity for blocks with a subnormal E4M3 scale, so call it once after each write of the masters."""
        if self.linears[0].quantized_version is None:
            raise RuntimeError("GroupedSites: weights are fake-quantized in place only with in_place=True")
        with torch.no_grad():
            for lin in self.linears:
                expert_weight_fake_quant(lin.weight, self.role, out=lin.weight)

    def mark_quantized(self) -> None:
        """Record the weights' versions after `write_fake_quant` of every grouped module (a parameter made from a
        view shares its base's version counter), so a later write through the parameter is refused by the forward.
        Writes that reach the storage another way (into a buffer the parameter's `.data` was set to) do not move
        the counter: after those, the call to `quantize_weights_in_place` is the only guard."""
        for lin in self.linears:
            lin.quantized_version = lin.weight._version

    def remove(self) -> None:
        self._hook.remove()
        for lin in self.linears:
            lin.weight_quant = lin.input_quant = lin.row_scale = lin.quantized_version = None
