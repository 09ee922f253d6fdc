"""The interface through which the trainer receives the rollout's records and routes for one micro-batch.

A `RolloutSource` answers, for the token rows of a micro-batch (`TokenRows`), the record of a site as a
`trace_core.records.spec.Record` with one row per token plus a `has_record` mask, and the routes of an MoE layer. The
record store plugs in by implementing the two methods; `TensorRolloutSource` is the in-memory implementation
(tests, benchmarks, the embedded default), and `source_from_store` serves a micro-batch loaded from the record
store (`trace_core.records.reader`) through it.

Sites are `(layer, kind)` with `layer` the 0-based decoder layer id (Megatron's `layer_number - 1`, the HF / SGLang
layer index) and kind in `trace_core.sites.SITE_KINDS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_trace.rows import TokenRows
from trace_core.records.spec import Record
from trace_core.sites import Site, check_site, routed


@dataclass(frozen=True)
class SiteRows:
    """A site's record for the rows of a micro-batch: `record` rows `[N, width]`, `has_record` bool `[N]`."""

    record: Record
    has_record: torch.Tensor

    def __post_init__(self) -> None:
        n = self.record.shape[:-1]
        if len(n) != 1 or self.has_record.dtype != torch.bool or tuple(self.has_record.shape) != tuple(n):
            raise ValueError(
                f"SiteRows needs a record of rows [N, width] and has_record bool [N]; got record "
                f"{tuple(self.record.shape)}, has_record {self.has_record.dtype} {tuple(self.has_record.shape)}"
            )


class RolloutSource(Protocol):
    """What the trainer asks of the rollout side for each micro-batch."""

    def sites(self) -> list[Site]:
        """The sites this source holds records for (the rollout may capture more than the trainer guides)."""
        ...

    def records(self, site: Site, rows: TokenRows) -> SiteRows:
        """The site's record for `rows`; rows without one (padding, not captured) have `has_record` False."""
        ...

    def routes(self, layer: int, rows: TokenRows) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 `[N, topk]` expert ids of `layer` for `rows` and a bool `[N]` mask of rows that have a route."""
        ...


def take_rows(record: Record, index: torch.Tensor) -> Record:
    """Rows `index` (int64 into the flattened leading dims) of a record, as a record of rows `[len(index), n]`."""
    rows = record.scales.shape[:-1]
    flat = rows.numel()
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= flat):
        raise ValueError(f"row index out of range for a record of {flat} rows")
    gs = record.global_scale
    if gs is not None and gs.dim():
        gs = gs.reshape(flat, 1)[index]
    return Record(
        fmt=record.fmt,
        bits=record.bits,
        n=record.n,
        low_bits=record.low_bits.reshape(flat, -1)[index],
        scales=record.scales.reshape(flat, -1)[index],
        global_scale=gs,
    )


def take_columns(record: Record, start: int, stop: int) -> Record:
    """Elements `[start, stop)` of every row (block-aligned, byte-aligned in the packed bits): a tensor-parallel
    rank's share of the KV heads."""
    block, bits = record.fmt.block, record.bits
    if start % block or stop % block or not 0 <= start < stop <= record.n or (start * bits) % 8:
        raise ValueError(f"cannot slice record columns [{start}, {stop}) of width {record.n} on block/byte bounds")
    if record.global_scale is not None and record.global_scale.dim() == 0 and (start, stop) != (0, record.n):
        raise ValueError("column slices of a per-tensor scaled record would change the tensor amax")
    return Record(
        fmt=record.fmt,
        bits=bits,
        n=stop - start,
        low_bits=record.low_bits[..., start * bits // 8 : (stop * bits + 7) // 8],
        scales=record.scales[..., start // block : stop // block],
        global_scale=record.global_scale,
    )


class TensorRolloutSource:
    """In-memory records and routes, indexed by (trajectory, position).

    `records[site] = (Record with rows [T, P, width], has_record bool [T, P])` and
    `routes[layer] = (int64 [T, P, topk], has_route bool [T, P])`, for T trajectories of up to P positions.
    """

    def __init__(
        self,
        records: dict[Site, tuple[Record, torch.Tensor]],
        routes: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        for site, (rec, has) in records.items():
            check_site(site)
            if len(rec.shape) != 3 or has.dtype != torch.bool or tuple(has.shape) != tuple(rec.shape[:2]):
                raise ValueError(f"site {site}: need a record [T, P, width] and has_record bool [T, P]")
        for layer, (idx, has) in (routes or {}).items():
            if idx.dim() != 3 or has.dtype != torch.bool or tuple(has.shape) != tuple(idx.shape[:2]):
                raise ValueError(f"routes of layer {layer}: need int [T, P, topk] and has_route bool [T, P]")
        self._records = records
        self._routes = routes or {}

    def sites(self) -> list[Site]:
        return list(self._records)

    @staticmethod
    def _index(rows: TokenRows, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat index into `[T, P]` per row, and whether the row falls inside the table (padding does not)."""
        t, p = shape
        inside = (rows.traj >= 0) & (rows.traj < t) & (rows.pos < p)
        flat = torch.where(inside, rows.traj * p + rows.pos, torch.zeros_like(rows.traj))
        return flat, inside

    def records(self, site: Site, rows: TokenRows) -> SiteRows:
        check_site(site)
        if site not in self._records:
            raise KeyError(f"no records for site {site}; this source holds {sorted(self._records)}")
        rec, has = self._records[site]
        flat, inside = self._index(rows.to(has.device), (rec.shape[0], rec.shape[1]))
        return SiteRows(take_rows(rec, flat), has.reshape(-1)[flat] & inside)

    def routes(self, layer: int, rows: TokenRows) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self._routes:
            raise KeyError(f"no routes for MoE layer {layer}; this source holds {sorted(self._routes)}")
        idx, has = self._routes[layer]
        flat, inside = self._index(rows.to(has.device), (idx.shape[0], idx.shape[1]))
        return idx.reshape(-1, idx.shape[-1])[flat], has.reshape(-1)[flat] & inside


def source_from_store(batch_records, moe_layers: Sequence[int], lengths: Sequence[int]) -> TensorRolloutSource:
    """A `RolloutSource` over one micro-batch loaded from the record store (`trace_core.records.reader.
    RecordReader.load(...)`, a `MicroBatchRecords` of `[B, T]` rows for ranges starting at position 0).

    Trajectory ids of this source are the batch slots 0..B-1: pack the micro-batch with the same slots. `routes`
    axis 2 follows `moe_layers` (the rollout's MoE-layer order). `lengths` are the slots' token counts: a route is
    served only where `trace_core.sites.routed` says the rollout has one (whatever the store holds at a
    trajectory's final token is padding).
    """
    records = {site: (rec, batch_records.has_record[site]) for site, rec in batch_records.records.items()}
    routes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if batch_records.routes is not None:
        r = batch_records.routes
        if r.shape[2] != len(moe_layers):
            raise ValueError(f"store routes hold {r.shape[2]} MoE layers, moe_layers names {len(moe_layers)}")
        if len(lengths) != r.shape[0]:
            raise ValueError(f"store routes hold {r.shape[0]} trajectories, lengths names {len(lengths)}")
        positions = torch.arange(r.shape[1], device=r.device)
        length = torch.tensor(list(lengths), device=r.device)[:, None]
        has = batch_records.has_routes & routed(positions, length)
        routes = {layer: (r[:, :, j].long(), has) for j, layer in enumerate(moe_layers)}
    return TensorRolloutSource(records, routes)
