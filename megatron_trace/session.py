"""Install TRACE on a megatron-core 0.19.2 model with hooks (no file patch) and drive it per micro-batch.

Sites and how they are reached (docs/megatron.md says why no hunk is needed):
- MoE input: `MoELayer.preprocess(hidden, probs, routing_map)` runs right after the router and right before the
  dispatcher; an instance wrapper fake-quantizes `hidden` there (the router has seen BF16, shared experts too).
- K / V: a forward-pre-hook on `core_attention` (K after QK-norm and RoPE, V final).
- Expert weights: the expert linears' `_forward_impl(input, weight, ...)` gets the STE fake-quantized weight;
  TRACE grouped experts (`megatron_trace.grouped`) take it, and the FC2-input site, from `GroupedSites`.
- FC2 input: the experts run with probabilities 1 (pre-hook) and the output is scaled by the probabilities after
  FC2 (forward hook), as SGLang does; a forward-pre-hook on each expert's `linear_fc2` fake-quantizes its input.
- R3: each router's `RouterReplay` gets the rollout's routes.

Per micro-batch, call `begin_microbatch(rows, source)` before the forward. Site state is keyed by micro-batch: a
forward with grad keeps its micro-batch's records and routes until that micro-batch's backward starts (a hook on
the model output), and activation recomputation inside that backward reads exactly them, whatever the schedule's
order (1F1B, interleaved) and whatever forward-only passes (`logp_old`, evaluation) ran in between: those keep
nothing. `end_step()` returns the step's metrics, refuses micro-batches forwarded with grad but never backwarded,
and clears all state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from megatron_trace.config import TraceConfig, check_megatron_config
from megatron_trace.grouped import GroupedSites, is_trace_grouped
from megatron_trace.r3 import RouteChecks, raise_route_errors, replay_indices
from megatron_trace.rows import TokenRows
from megatron_trace.sites import SiteNumerics
from megatron_trace.source import RolloutSource, Site, SiteRows, take_columns

Tap = Callable[[Site, TokenRows, torch.Tensor, torch.Tensor], None]


@dataclass
class _MicroBatchState:
    """What the sites of one micro-batch read: its token identity, records and replayed routes."""

    key: int
    attn_rows: TokenRows
    moe_rows: TokenRows
    records: dict[Site, SiteRows] = field(default_factory=dict)
    routes: dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> [N, topk] replay indices
    forwarded: bool = False


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (activation recomputation happens there)."""
    return torch._C._current_graph_task_id() != -1


def _parallel() -> tuple[int, int, bool]:
    """(tp rank, tp size) of the attention tensor-parallel group; single rank when Megatron is not initialised."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1, False
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size(), True


def _check_experts(layer_id: int, experts: torch.nn.Module) -> None:
    """NotImplementedError, naming the classes, for experts whose weight and FC2-input sites are not wired."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import SequentialMLP

    if is_trace_grouped(experts):
        return
    if not isinstance(experts, SequentialMLP):
        linears = [type(getattr(experts, n, None)).__name__ for n in ("linear_fc1", "linear_fc2")]
        raise NotImplementedError(
            f"layer {layer_id}: experts {type(experts).__name__} with linears {linears}; weight and FC2-input fake "
            "quant are wired for the TRACE grouped experts (megatron_trace.grouped.with_grouped_experts) and for "
            "SequentialMLP with Megatron's local linears, not for TE's GroupedLinear or TE linears (no TE wrapper)"
        )
    for expert in experts.local_experts:
        for lin in (expert.linear_fc1, expert.linear_fc2):
            if type(lin) not in (ColumnParallelLinear, RowParallelLinear):
                raise NotImplementedError(
                    f"layer {layer_id}: SequentialMLP expert linear {type(lin).__name__}; only Megatron's local "
                    "ColumnParallelLinear / RowParallelLinear are wired (TE linears are not)"
                )


class TraceSession:
    """TRACE hooks on one model chunk (a GPTModel or anything with `.decoder.layers` of TransformerLayers)."""

    def __init__(self, model: torch.nn.Module, cfg: TraceConfig, *, tap: Tap | None = None):
        from megatron.core.transformer.moe.moe_layer import MoELayer

        if getattr(model, "_trace_session", None) is not None:
            raise RuntimeError("a TraceSession is already installed on this model; remove() it first")
        gpt: Any = model  # a megatron-core GPTModel (untyped): `.config`, `.decoder.layers`
        self.cfg = cfg
        self.model = model
        self.config: Any = gpt.config  # megatron-core TransformerConfig
        check_megatron_config(self.config, cfg)
        self.numerics = SiteNumerics(cfg)
        self.tap = tap
        self._handles: list = []
        self._restore: list[tuple[object, str]] = []
        self._current: _MicroBatchState | None = None  # the micro-batch the next forward runs
        self._pending: dict[int, _MicroBatchState] = {}  # forwarded with grad, backward not started
        self._backward: _MicroBatchState | None = None  # the micro-batch whose backward runs (recomputation)
        self._keys = 0
        self._route_checks: list[RouteChecks] = []
        self._routes_checked = 0
        self.tp_rank, self.tp_size, _ = _parallel()
        self.sequence_parallel = bool(self.config.sequence_parallel)
        self.moe_layers: dict[int, Any] = {}  # megatron-core MoELayer
        self.attn_layers: dict[int, Any] = {}  # megatron-core SelfAttention
        for layer in gpt.decoder.layers:
            layer_id = layer.layer_number - 1
            attn = getattr(layer, "self_attention", None)
            if attn is not None and hasattr(attn, "core_attention"):
                self.attn_layers[layer_id] = attn
            if isinstance(layer.mlp, MoELayer):
                self.moe_layers[layer_id] = layer.mlp
        if cfg.replay_routes and not self.moe_layers:
            raise ValueError("R3 requested but the model has no MoE layers")
        # A pipeline stage holds some layers only (layer numbers are global): keep the sites this chunk has.
        present = {(i, "moe_in") for i in self.moe_layers} | {(i, k) for i in self.attn_layers for k in ("k", "v")}
        self.numerics.captured &= present
        self.numerics.track(present)
        self.sites = present
        if cfg.quantized:  # refused before any hook is installed
            for layer_id, moe in self.moe_layers.items():
                _check_experts(layer_id, moe.experts)
                if cfg.expert_weights_in_place and not is_trace_grouped(moe.experts):
                    raise NotImplementedError(
                        f"layer {layer_id}: expert_weights_in_place needs the TRACE grouped experts, not "
                        f"{type(moe.experts).__name__}"
                    )
        gpt._trace_session = self
        self._handles.append(model.register_forward_pre_hook(self._model_forward_begins, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._model_forward_ends))
        if cfg.replay_routes:
            for layer_id, moe in self.moe_layers.items():
                self._handles.append(moe.router.register_forward_pre_hook(self._replay_hook(layer_id)))
        # BF16 has no FP4 site; with a tap the activation sites still run (identity) so the tap sees them.
        if cfg.quantized or tap is not None:
            for layer_id, moe in self.moe_layers.items():
                self._wrap(moe, "preprocess", self._moe_preprocess(layer_id, moe.preprocess))
            for layer_id, attn in self.attn_layers.items():
                hook = self._kv_hook(layer_id, attn)
                self._handles.append(attn.core_attention.register_forward_pre_hook(hook, with_kwargs=True))
        if not cfg.quantized:
            return
        for moe in self.moe_layers.values():
            if is_trace_grouped(moe.experts):  # probabilities after FC2: inside the grouped FC2 (GroupedSites)
                self._handles.append(GroupedSites(moe.experts, self.numerics, in_place=cfg.expert_weights_in_place))
                continue
            self._handles.append(moe.experts.register_forward_pre_hook(self._probs_to_one))
            self._handles.append(moe.experts.register_forward_hook(self._probs_after_fc2))
            for expert in moe.experts.local_experts:
                for lin in (expert.linear_fc1, expert.linear_fc2):
                    self._wrap(lin, "_forward_impl", self._weight_fq(lin._forward_impl))
                self._handles.append(expert.linear_fc2.register_forward_pre_hook(self._fc2_input))

    # ----------------------------------------------------------------- installation helpers
    def _wrap(self, obj: object, name: str, fn: Callable) -> None:
        self._restore.append((obj, name))
        setattr(obj, name, fn)

    def remove(self) -> None:
        """Remove every hook and wrapper; the model behaves as before `TraceSession`."""
        for h in self._handles:
            h.remove()
        for obj, name in self._restore:
            delattr(obj, name)
        self._handles.clear()
        self._restore.clear()
        cast(Any, self.model)._trace_session = None
        self.end_step()

    def quantize_weights_in_place(self) -> None:
        """`expert_weights_in_place`: write the fake-quantized values of every grouped expert weight into the
        parameter (one launch per linear). Call it once after each copy of the FP32 masters into the parameters
        (the optimizer step, a checkpoint load) and before the next forward; the masters stay the weights (export
        and checkpoints read them, never the parameters). No-op in `bf16`."""
        if not self.cfg.expert_weights_in_place:
            raise ValueError("quantize_weights_in_place needs TraceConfig(expert_weights_in_place=True)")
        sites = [h for h in self._handles if isinstance(h, GroupedSites)]
        for s in sites:
            s.write_fake_quant()
        for s in sites:
            s.mark_quantized()

    def in_place_weights(self) -> list[torch.nn.Parameter]:
        """The parameters `quantize_weights_in_place` writes: each TRACE grouped linear's `weight` (none in `bf16` or
        without `expert_weights_in_place`: the group trainer gives these, and only these, FP32 masters of their own)."""
        if not self.cfg.expert_weights_in_place:
            return []
        return [lin.weight for h in self._handles if isinstance(h, GroupedSites) for lin in h.linears]

    # ----------------------------------------------------------------- per micro-batch driving
    def begin_microbatch(self, rows: TokenRows, source: RolloutSource | None = None) -> None:
        """Set the token identity (all rows of the micro-batch, `[s, b]` order) and the rollout source of the next
        model forward."""
        moe_rows = rows.chunk(self.tp_rank, self.tp_size) if self.sequence_parallel else rows
        self._keys += 1
        state = _MicroBatchState(key=self._keys, attn_rows=rows, moe_rows=moe_rows)
        wanted = set(self.numerics.captured)
        if source is not None and self.cfg.measure and self.cfg.quantized:
            wanted |= set(source.sites()) & self.sites
        if wanted:
            if source is None:
                raise ValueError(f"trace mode needs a RolloutSource for the captured sites {sorted(wanted)}")
            for site in sorted(wanted):
                site_rows = source.records(site, moe_rows if site[1] == "moe_in" else rows)
                if site[1] != "moe_in" and self.tp_size > 1:
                    site_rows = self._local_heads(site_rows)
                state.records[site] = site_rows
        if self.cfg.replay_routes:
            state.routes = self._routes(moe_rows, source)
        self._current = state

    def check_routes(self) -> None:
        """Raise ValueError for a missing, duplicate or out-of-range rollout route given since the last check (one
        device read; `end_step` calls it too). Call it before the optimizer update to refuse a step that replayed
        placeholders in place of bad routes."""
        pending = self._route_checks[self._routes_checked :]
        self._routes_checked = len(self._route_checks)
        raise_route_errors(pending)

    def end_step(self) -> dict[str, float]:
        """Metrics of the step (site counters, R3 placeholders); clears records, routes and counters. Device
        counters are read here, once per step. A bad rollout route (`check_routes`) is an error, and so is a
        micro-batch forwarded with grad whose backward never ran (its state would otherwise leak into the next
        step)."""
        leftover = sorted(self._pending)
        try:
            self.check_routes()
            out = self.numerics.metrics()
            if self.cfg.replay_routes:
                counts = [c.placeholders for c in self._route_checks]
                out["r3/placeholder_rows"] = float(torch.stack(counts).sum()) if counts else 0.0
        finally:
            if self.cfg.replay_routes:
                for moe in self.moe_layers.values():
                    moe.router.router_replay.clear_indices()
                    moe.router.router_replay.clear_router_replay_action()
            self.numerics.reset()
            self._pending.clear()
            self._current = self._backward = None
            self._route_checks, self._routes_checked = [], 0
        if leftover:
            raise RuntimeError(
                f"end_step: {len(leftover)} micro-batch(es) were forwarded with grad but never backwarded; run their "
                "backward, or compute forward-only passes under torch.no_grad()"
            )
        return out

    # ----------------------------------------------------------------- which micro-batch a site belongs to
    def _model_forward_begins(self, module, args, kwargs) -> None:
        if kwargs.get("packed_seq_params") is not None:
            raise NotImplementedError("packed THD sequences (packed_seq_params): TRACE maps BSHD micro-batch rows only")
        if self._current is None or self._current.forwarded:
            raise RuntimeError("TRACE: call begin_microbatch() before each model forward")
        self._current.forwarded = True

    def _model_forward_ends(self, module, args, output) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if not (torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad):
            return
        state = self._current
        if state is None:
            raise RuntimeError("TRACE: a model forward ended without a micro-batch (begin_microbatch() not called)")
        self._pending[state.key] = state
        out.register_hook(lambda grad: self._backward_begins(state.key))

    def _backward_begins(self, key: int) -> None:
        """The gradient reached the output of micro-batch `key`: its backward (and any recomputation) starts."""
        if key in self._pending:
            self._backward = self._pending.pop(key)
        elif self._backward is None or self._backward.key != key:
            raise RuntimeError("TRACE: backward of a micro-batch whose state was already cleared (end_step ran)")

    def _state(self) -> _MicroBatchState:
        if _in_backward():
            if self._backward is None:
                raise RuntimeError("TRACE site recomputed in a backward that did not start at a micro-batch output")
            return self._backward
        if self._current is None:
            raise RuntimeError("TRACE site ran outside a micro-batch: call begin_microbatch() before the forward")
        return self._current

    def _replay_hook(self, layer_id: int) -> Callable:
        """Router forward-pre-hook: replay this micro-batch's routes (forward and recomputation alike)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        def hook(router, args):
            replay = router.router_replay
            replay.target_topk_idx = self._state().routes[layer_id]
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

        return hook

    def _routes(self, rows: TokenRows, source: RolloutSource | None) -> dict[int, torch.Tensor]:
        if source is None:
            raise ValueError("R3 needs a RolloutSource with the rollout's routes")
        routes = {}
        for layer_id, moe in self.moe_layers.items():
            if moe.router.router_replay is None:
                raise ValueError("R3 needs moe_enable_routing_replay=True when the model is built")
            got, has = source.routes(layer_id, rows)
            idx, checks = replay_indices(
                layer_id, got, has, rows, self.config.num_moe_experts, self.config.moe_router_topk
            )
            self._route_checks.append(checks)
            routes[layer_id] = idx
        return routes

    def _local_heads(self, site_rows: SiteRows) -> SiteRows:
        groups = self.config.num_query_groups or self.config.num_attention_heads
        if groups % self.tp_size:
            raise NotImplementedError(f"{groups} KV heads replicated over TP {self.tp_size}: record slicing undefined")
        width = site_rows.record.n // self.tp_size
        rec = take_columns(site_rows.record, self.tp_rank * width, (self.tp_rank + 1) * width)
        return SiteRows(rec, site_rows.has_record)

    # ----------------------------------------------------------------- the sites
    def _site(self, site: Site, rows: TokenRows, state: _MicroBatchState, x2d: torch.Tensor) -> torch.Tensor:
        if x2d.shape[0] != len(rows):
            raise ValueError(
                f"site {site}: activation has {x2d.shape[0]} rows but the micro-batch identity has {len(rows)}"
            )
        y2d = self.numerics.activation(site, x2d, state.records.get(site))
        if self.tap is not None:
            self.tap(site, rows, x2d, y2d)
        return y2d

    def _moe_preprocess(self, layer_id: int, original: Callable) -> Callable:
        def preprocess(hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
            state = self._state()
            x2d = hidden_states.reshape(-1, hidden_states.shape[-1])
            y2d = self._site((layer_id, "moe_in"), state.moe_rows, state, x2d)
            return original(y2d.view(hidden_states.shape), probs, routing_map)

        return preprocess

    def _kv_hook(self, layer_id: int, attn: torch.nn.Module) -> Callable:
        def hook(module, args, kwargs):
            if kwargs.get("packed_seq_params") is not None:
                raise NotImplementedError("packed THD sequences: TRACE maps BSHD micro-batch rows only")
            state = self._state()
            query, key, value, *rest = args
            out = []
            for kind, t in (("k", key), ("v", value)):
                y = self._site((layer_id, kind), state.attn_rows, state, t.reshape(t.shape[0] * t.shape[1], -1))
                out.append(y.view(t.shape))
            return (query, out[0], out[1], *rest), kwargs

        return hook

    def _probs_to_one(self, module, args):
        hidden, tokens_per_expert, probs = args
        module._trace_probs = probs
        return hidden, tokens_per_expert, torch.ones_like(probs)

    def _probs_after_fc2(self, module, args, output):
        out, bias = output
        if bias is not None:
            raise NotImplementedError("expert bias with probabilities applied after FC2")
        probs = module._trace_probs
        del module._trace_probs
        return (out * probs.unsqueeze(-1)).to(out.dtype), None

    def _fc2_input(self, module, args):
        x, *rest = args
        return (self.numerics.fc2_input(x), *rest)

    def _weight_fq(self, original: Callable) -> Callable:
        def forward_impl(*args, **kwargs):
            if "weight" in kwargs:
                kwargs["weight"] = self.numerics.weight(kwargs["weight"])
            else:
                args = (args[0], self.numerics.weight(args[1]), *args[2:])
            return original(*args, **kwargs)

        return forward_impl
