"""Token identity: which (trajectory, position) each row of a Megatron micro-batch holds.

Megatron's activations are `[s, b, h]`; flattened, row `r = s * B + b` (the router and the MoE layer see this
order). With sequence parallelism the MoE layer sees only the tensor-parallel rank's contiguous chunk of those rows.
Rows of padding carry trajectory -1 and never have a record or a route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trace_core.sites import routed

PAD = -1


@dataclass(frozen=True)
class TokenRows:
    """Identity of token rows in Megatron row order.

    Attributes:
        traj: int64 `[N]` trajectory id per row (`PAD` for padding).
        pos: int64 `[N]` token position inside its trajectory (prompt included).
        last: bool `[N]` whether the row is its trajectory's final token (the rollout has no route for it).
    """

    traj: torch.Tensor
    pos: torch.Tensor
    last: torch.Tensor

    def __post_init__(self) -> None:
        n = self.traj.shape
        if self.traj.dim() != 1 or self.pos.shape != n or self.last.shape != n:
            raise ValueError(
                f"TokenRows fields must be 1-D of one length, got traj {tuple(self.traj.shape)}, pos "
                f"{tuple(self.pos.shape)}, last {tuple(self.last.shape)}"
            )
        if self.traj.dtype != torch.int64 or self.pos.dtype != torch.int64 or self.last.dtype != torch.bool:
            raise ValueError("TokenRows needs int64 traj and pos and a bool last mask")

    def __len__(self) -> int:
        return self.traj.shape[0]

    @property
    def is_pad(self) -> torch.Tensor:
        return self.traj == PAD

    def chunk(self, rank: int, size: int) -> TokenRows:
        """The rows a sequence-parallel rank holds: the `rank`-th of `size` contiguous chunks."""
        if size < 1 or not 0 <= rank < size or len(self) % size:
            raise ValueError(f"cannot split {len(self)} rows into {size} sequence-parallel chunks (rank {rank})")
        step = len(self) // size
        sl = slice(rank * step, (rank + 1) * step)
        return TokenRows(self.traj[sl], self.pos[sl], self.last[sl])

    def to(self, device: torch.device | str) -> TokenRows:
        return TokenRows(self.traj.to(device), self.pos.to(device), self.last.to(device))


@dataclass(frozen=True)
class MicroBatch:
    """Model inputs of one micro-batch (`[B, S]`, right-padded) and the identity of its rows."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    valid: torch.Tensor
    rows: TokenRows

    def to(self, device: torch.device | str) -> MicroBatch:
        return MicroBatch(
            self.input_ids.to(device),
            self.position_ids.to(device),
            self.attention_mask.to(device),
            self.valid.to(device),
            self.rows.to(device),
        )


def pack_microbatch(trajectories: Sequence[tuple[int, torch.Tensor]], seq_len: int | None = None) -> MicroBatch:
    """Right-pad trajectories `(trajectory id, token ids [L])` into one BSHD micro-batch.

    `attention_mask` is Megatron's bool `[B, 1, S, S]` (True = masked): causal, and padding keys masked.
    `rows` lists each row's (trajectory, position) in Megatron's `[s, b]` order.
    """
    if not trajectories:
        raise ValueError("pack_microbatch needs at least one trajectory")
    ids = [torch.as_tensor(t, dtype=torch.int64).flatten() for _, t in trajectories]
    traj_ids = [int(t) for t, _ in trajectories]
    if any(t < 0 for t in traj_ids) or len(set(traj_ids)) != len(traj_ids):
        raise ValueError(f"trajectory ids must be distinct and non-negative, got {traj_ids}")
    lengths = [len(x) for x in ids]
    if min(lengths) == 0:
        raise ValueError("empty trajectory in micro-batch")
    s = max(lengths) if seq_len is None else seq_len
    if s < max(lengths):
        raise ValueError(f"seq_len {s} is shorter than the longest trajectory ({max(lengths)} tokens)")
    b = len(ids)
    input_ids = torch.zeros(b, s, dtype=torch.int64)
    valid = torch.zeros(b, s, dtype=torch.bool)
    for i, x in enumerate(ids):
        input_ids[i, : len(x)] = x
        valid[i, : len(x)] = True
    position_ids = torch.arange(s).expand(b, s).contiguous()
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)
    attention_mask = (causal[None] | ~valid[:, None, :]).unsqueeze(1)
    length = torch.tensor(lengths)[:, None]
    traj = torch.where(valid, torch.tensor(traj_ids)[:, None], torch.full_like(input_ids, PAD))
    last = valid & ~routed(position_ids, length)
    # Megatron rows are [s, b]-major.
    rows = TokenRows(traj.t().reshape(-1), torch.where(valid, position_ids, 0).t().reshape(-1), last.t().reshape(-1))
    return MicroBatch(input_ids, position_ids, attention_mask, valid, rows)
