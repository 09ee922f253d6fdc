"""Rollout emulation inside Megatron: run the model the way the FP4 rollout does (RTN at every FP4 site, native
routing) and keep what the rollout would record — per-token `Record`s of the captured sites (through
`trace_core.numerics.quant.quantize` and `Record.from_quantized`) and the top-k routes of every MoE layer.

Used by the tests, the step benchmark and single-machine runs without an inference engine. Like SGLang, it keeps
no route for a trajectory's final token (the rollout never routes the token it does not feed back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from megatron_trace.config import TraceConfig
from megatron_trace.rows import MicroBatch, TokenRows
from megatron_trace.session import TraceSession
from megatron_trace.source import Site, TensorRolloutSource
from trace_core.modes import Mode
from trace_core.numerics.formats import FP4Format
from trace_core.numerics.recipe import PrecisionRecipe, Role
from trace_core.numerics.role_quant import quantize_role
from trace_core.records.spec import Record, RecordSpec, packed_len


class _Table:
    """Per-site record rows scattered into `[T, P, ...]` tables."""

    def __init__(self, spec: RecordSpec, role: Role, width: int, shape: tuple[int, int], device):
        t, p = shape
        if not isinstance(role.fmt, FP4Format):  # a recorded role is FP4 (`Role` refuses anything else)
            raise ValueError(f"{role.fmt.name} is not an FP4 format; records hold FP4 codes only")
        self.role, self.fmt, self.bits, self.width = role, role.fmt, spec.bits, width
        self.low = torch.zeros(t, p, packed_len(width, spec.bits), dtype=torch.uint8, device=device)
        self.scales = torch.zeros(t, p, width // role.fmt.block, dtype=torch.uint8, device=device)
        has_gs = role.fmt.has_global_scale  # per token, or static repeated
        self.gs = torch.ones(t, p, 1, dtype=torch.float32, device=device) if has_gs else None
        self.has = torch.zeros(t, p, dtype=torch.bool, device=device)

    def put(self, rows: TokenRows, x: torch.Tensor) -> None:
        keep = ~rows.is_pad
        q = quantize_role(self.role, x.detach()[keep])
        rec = Record.from_quantized(q, self.bits)
        t, p = rows.traj[keep], rows.pos[keep]
        self.low[t, p], self.scales[t, p], self.has[t, p] = rec.low_bits, rec.scales, True
        if self.gs is not None:
            if rec.global_scale is None:
                raise RuntimeError(f"{self.fmt.name} records carry a global scale, this one has none")
            self.gs[t, p] = rec.global_scale

    def record(self) -> tuple[Record, torch.Tensor]:
        rec = Record(self.fmt, self.bits, self.width, self.low, self.scales, self.gs)
        return rec, self.has


def emulate_rollout(
    model: torch.nn.Module,
    batches: Sequence[MicroBatch],
    spec: RecordSpec,
    *,
    num_trajectories: int,
    max_positions: int,
    recipe: PrecisionRecipe | str | None = None,
) -> TensorRolloutSource:
    """Forward `batches` through `model` with RTN at every FP4 site and native routing (no grad); return the
    records of `spec`'s sites and the routes of every MoE layer, indexed by (trajectory, position). `recipe`:
    the precision recipe (None: the spec's, else the default)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    cfg = TraceConfig(mode=Mode.QAT, spec=spec, replay_routes=False, measure=False, recipe=recipe)
    tables: dict[Site, _Table] = {}
    shape = (num_trajectories, max_positions)
    wanted = set(spec.sites())

    def tap(site: Site, rows: TokenRows, x: torch.Tensor, y: torch.Tensor) -> None:
        if site not in wanted:
            return
        if site not in tables:
            tables[site] = _Table(spec, cfg.role(site[1]), x.shape[-1], shape, x.device)
        tables[site].put(rows, x)

    session = TraceSession(model, cfg, tap=tap)
    topk = cast(Any, model).config.moe_router_topk  # a megatron-core GPTModel (untyped)
    device = next(model.parameters()).device
    routes = {
        i: (
            torch.zeros(*shape, topk, dtype=torch.int64, device=device),
            torch.zeros(*shape, dtype=torch.bool, device=device),
        )
        for i in session.moe_layers
    }
    replays = {i: moe.router.router_replay for i, moe in session.moe_layers.items()}
    try:
        with torch.no_grad():
            for mb in batches:
                mb = mb.to(device)
                for r in replays.values():
                    if r is not None:
                        r.set_router_replay_action(RouterReplayAction.RECORD)
                session.begin_microbatch(mb.rows)
                model(mb.input_ids, mb.position_ids, mb.attention_mask)
                rows = mb.rows
                keep = ~rows.is_pad & ~rows.last
                for i, r in replays.items():
                    if r is None:
                        raise ValueError("emulate_rollout records routes through RouterReplay: build with replay on")
                    idx, has = routes[i]
                    idx[rows.traj[keep], rows.pos[keep]] = r.get_recorded_indices()[keep].long()
                    has[rows.traj[keep], rows.pos[keep]] = True
                session.end_step()
    finally:
        for r in replays.values():
            if r is not None:
                r.clear_indices()
                r.clear_router_replay_action()
        session.remove()
    missing = wanted - set(tables)
    if missing:
        raise ValueError(f"record spec sites not present in the model: {sorted(missing)}")
    return TensorRolloutSource({s: t.record() for s, t in tables.items()}, routes)
