"""R3 (Rollout Routing Replay): turn the rollout's routes into the per-router top-k indices Megatron's
`RouterReplay` replays, with the checks the pitfalls call for.

Duplicate expert ids in a row collapse in the routing map (allgather) or crash the alltoall dispatcher, so they are
rejected. A real token without a route is an error, except a trajectory's final token: the rollout never routes
it (it generates no successor) and, under causal attention, nothing else depends on it. Such rows and padding rows
get distinct placeholder experts and are counted.
"""

from __future__ import annotations

import torch

from megatron_trace.rows import TokenRows


def _describe(rows: TokenRows, bad: torch.Tensor) -> str:
    i = int(bad.nonzero()[0])
    return f"{int(bad.sum())} rows, first (trajectory {int(rows.traj[i])}, position {int(rows.pos[i])})"


def replay_indices(
    layer: int, routes: torch.Tensor, has_route: torch.Tensor, rows: TokenRows, num_experts: int, topk: int
) -> tuple[torch.Tensor, int]:
    """int64 `[N, topk]` indices for `RouterReplay.set_target_indices` and the number of placeholder rows."""
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
    if bool(missing.any()):
        raise ValueError(f"MoE layer {layer}: rollout routes missing for {_describe(rows, missing)}")
    real = routes[has_route]
    if real.numel():
        if int(real.min()) < 0 or int(real.max()) >= num_experts:
            raise ValueError(f"MoE layer {layer}: expert id out of range [0, {num_experts})")
        ordered = real.sort(dim=-1).values
        dup = torch.zeros(n, dtype=torch.bool, device=routes.device)
        dup[has_route] = (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1)
        if bool(dup.any()):
            raise ValueError(f"MoE layer {layer}: duplicate expert ids in the routes of {_describe(rows, dup)}")
    row = torch.arange(n, device=routes.device)[:, None]
    placeholder = (row + torch.arange(topk, device=routes.device)) % num_experts
    return torch.where(has_route[:, None], routes, placeholder), int((~has_route).sum())
