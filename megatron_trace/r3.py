"""R3 (Rollout Routing Replay): turn the rollout's routes into the per-router top-k indices Megatron's
`RouterReplay` replays, with the checks the pitfalls call for.

Duplicate expert ids in a row collapse in the routing map (allgather) or crash the alltoall dispatcher, so they are
rejected. A real token without a route is an error, except a trajectory's final token: the rollout never routes
it (it generates no successor) and, under causal attention, nothing else depends on it. Such rows and padding rows
get distinct placeholder experts and are counted.

The indices are built on the device without reading anything back (no host round-trip per layer): the checks
become device masks (`RouteChecks`), offending rows replay placeholders so the forward stays in range, and
`raise_route_errors` reads the masks of a whole step at once and raises with the first offending row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_trace.rows import TokenRows


def _describe(rows: TokenRows, bad: torch.Tensor) -> str:
    i = int(bad.nonzero()[0])
    return f"{int(bad.sum())} rows, first (trajectory {int(rows.traj[i])}, position {int(rows.pos[i])})"


@dataclass(frozen=True)
class RouteChecks:
    """Device-side verdicts on one layer's routes for one micro-batch: rows missing a route, rows with duplicate
    expert ids, rows with ids out of range (bool `[N]`), and the number of placeholder rows (0-d)."""

    layer: int
    rows: TokenRows
    missing: torch.Tensor
    duplicate: torch.Tensor
    out_of_range: torch.Tensor
    placeholders: torch.Tensor


def replay_indices(
    layer: int, routes: torch.Tensor, has_route: torch.Tensor, rows: TokenRows, num_experts: int, topk: int
) -> tuple[torch.Tensor, RouteChecks]:
    """int64 `[N, topk]` indices for `RouterReplay.set_target_indices` and the checks of the routes (device only:
    shapes and dtypes are checked here, values by `raise_route_errors`). Rows without a valid route replay
    distinct placeholder experts."""
    n = len(rows)
    if tuple(routes.shape) != (n, topk) or tuple(has_route.shape) != (n,) or has_route.dtype != torch.bool:
        raise ValueError(
            f"MoE layer {layer}: routes must be [{n}, {topk}] with has_route bool [{n}], got "
            f"{tuple(routes.shape)} and {has_route.dtype} {tuple(has_route.shape)}"
        )
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(f"MoE layer {layer}: routes must be integer expert ids, got {routes.dtype}")
    routes = routes.long()
    missing = ~has_route & ~rows.is_pad & ~rows.last
    out_of_range = has_route & ((routes < 0) | (routes >= num_experts)).any(dim=-1)
    ordered = routes.sort(dim=-1).values
    duplicate = has_route & (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1)
    valid = has_route & ~out_of_range & ~duplicate
    # By position, not by row of the micro-batch: the same under every layout and micro-batching (the rows are
    # unused, but their values reach the site counters of later layers).
    pos = rows.pos.to(routes.device)[:, None]
    placeholder = (pos + torch.arange(topk, device=routes.device)) % num_experts
    checks = RouteChecks(layer, rows, missing, duplicate, out_of_range, (~has_route).sum())
    return torch.where(valid[:, None], routes, placeholder), checks


def raise_route_errors(checks: list[RouteChecks]) -> None:
    """Read the verdicts of `checks` in one transfer; raise ValueError for the first layer with a bad route."""
    if not checks:
        return
    flags = torch.stack([torch.stack([c.missing.any(), c.duplicate.any(), c.out_of_range.any()]) for c in checks])
    for c, (missing, duplicate, out_of_range) in zip(checks, flags.tolist(), strict=True):
        if missing:
            raise ValueError(f"MoE layer {c.layer}: rollout routes missing for {_describe(c.rows, c.missing)}")
        if out_of_range:
            raise ValueError(
                f"MoE layer {c.layer}: expert id out of range (first: {_describe(c.rows, c.out_of_range)})"
            )
        if duplicate:
            raise ValueError(
                f"MoE layer {c.layer}: duplicate expert ids in the routes of {_describe(c.rows, c.duplicate)}"
            )
