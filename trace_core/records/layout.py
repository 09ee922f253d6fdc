"""Record layout on the device side: which sites a spec captures and how wide their rows are (`site_layout`), and
what one finished trajectory carries (`TrajectoryRecords`). Capture builds these; the store writes and reads them
(docs/design.md, "Records"); neither depends on the disk format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from trace_core.numerics.formats import get_format
from trace_core.records.spec import Binding, ModelShape, Record, RecordSpec
from trace_core.sites import Site, check_site

SiteLayout = tuple[str, int, int]  # (format name, bits, elements per row)


def site_layout(spec: RecordSpec, shape: ModelShape) -> dict[Site, SiteLayout]:
    """(format, bits, row width) of every site `spec` captures: MoE input rows are `hidden` wide, K and V rows
    `num_kv_heads * head_dim` (all heads of a token)."""
    out: dict[Site, SiteLayout] = {}
    for layer, kind in spec.sites():
        width = shape.hidden if kind == "moe_in" else shape.num_kv_heads * shape.head_dim
        out[(layer, kind)] = (spec.site_format(kind).name, spec.bits, width)
    for site, (fmt, _, n) in out.items():
        if n <= 0 or n % get_format(fmt).block:
            raise ValueError(f"site {site}: width {n} is not a positive multiple of the {fmt} block")
    return out


@dataclass(frozen=True)
class TrajectoryRecords:
    """Everything recorded for one trajectory: per-site records of positions [0, num_tokens) and R3 routes.

    Attributes:
        num_tokens: rows every record and the routes hold.
        records: site (layer, kind) -> `Record` with `[num_tokens, ...]` tensors (an nvfp4 global scale per row
            `[num_tokens, 1]`, or 0-d for a static scale).
        routes: int32 `[num_tokens, moe_layers, topk]` expert ids, or None when routes are not recorded.
        binding: what produced the records (checked by the trainer), or None (an unbound shard, refused there).
    """

    num_tokens: int
    records: Mapping[Site, Record]
    routes: torch.Tensor | None = None
    binding: Binding | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or self.num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative int, got {self.num_tokens!r}")
        for site, rec in self.records.items():
            check_site(site)
            if not isinstance(rec, Record):
                raise ValueError(f"site {site}: expected a Record, got {type(rec).__name__}")
            if tuple(rec.scales.shape[:-1]) != (self.num_tokens,):
                raise ValueError(f"site {site}: record rows {tuple(rec.scales.shape[:-1])} != ({self.num_tokens},)")
            gs = rec.global_scale
            if gs is not None and gs.dim() and tuple(gs.shape) != (self.num_tokens, 1):
                raise ValueError(f"site {site}: global_scale must be 0-d or [{self.num_tokens}, 1], got {gs.shape}")
        r = self.routes
        if r is not None and (r.dtype != torch.int32 or r.dim() != 3 or r.shape[0] != self.num_tokens):
            raise ValueError(f"routes must be int32 [{self.num_tokens}, moe_layers, topk], got {r.dtype} {r.shape}")
        if self.binding is not None and not isinstance(self.binding, Binding):
            raise ValueError(f"binding must be a Binding, got {type(self.binding).__name__}")
