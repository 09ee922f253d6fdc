"""Record capture on the rollout side: fixed staging rows and a record store keyed by KV slot, on the device.

Follows SGLang's routed-experts capturer (row-indexed static buffer written inside the forward, a buffer indexed
by KV slot, gather through the request's slots at finish), with the slot-keyed store kept on the forward's device
next to the KV cache it describes, so host memory never mirrors the KV pool (docs/sglang.md, "Memory"):
  * every captured site writes its record rows (packed low code bits, block scale bytes and, for nvfp4, the FP32
    token scale) into views of one staging buffer `[max_tokens, row_bytes]` allocated once: fixed addresses, a
    `copy_` per write, so writes are CUDA-graph safe (`stage`, or a kernel writing into `staging_rows` directly);
    R3 routes `[tokens, route_layers, topk]` live in the same rows, as the narrowest integer dtype that holds the
    expert ids and an unset marker (`route_dtype`: uint8 for up to 255 experts), widened to int32 when read;
  * `on_forward_end(out_cache_loc)` copies rows [0, T) into the store at rows `out_cache_loc[i]` (one
    `index_copy_` on the forward's stream: no host work, no host sync);
  * `gather(slots, length)` returns the request's `TrajectoryRecords` for positions [0, length) from the slots of
    its `req_to_token` row; `read` checks and splits rows gathered elsewhere (e.g. copied to the host in one batch).
    Prefix-cache hits, chunked prefill and retraction need nothing special: a slot holds whatever the last forward
    that wrote it computed.
One scheduler thread drives a capturer; it is not thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trace_core.numerics.formats import get_format
from trace_core.numerics.quant import Quantized
from trace_core.records.layout import SiteLayout, TrajectoryRecords, site_layout
from trace_core.records.spec import ModelShape, Record, RecordSpec, pack_low_bits, packed_len
from trace_core.sites import Site

# Rows are padded to whole 8-byte words: the store and staging are copied and gathered through int64 views (one
# element per 8 bytes; PyTorch's index kernels run one thread-element per element of the dtype, so a byte view
# costs 8x the elements). Fields: fp32 / int32 ones first (4-aligned, read through dtype views), then the bytes.
ALIGN, WORD = 8, torch.int64
MARK_SET = 1  # a hook marker's byte once its hook ran; a reset sets every sentinel byte to 0xFF


def route_dtype(num_experts: int | None) -> torch.dtype:
    """The dtype of the routes in the record rows for a model of `num_experts` routed experts: the narrowest integer
    whose all-0xFF bytes (what the reset after every forward writes: `route_unset`) is no expert id. uint8 for up to
    255 experts (255 is the unset marker, so 256 experts need int16), int16 for up to 32,768 (-1), else int32 (-1);
    None (the expert count unknown): int32. Rows are widened to int32 when read (`RowReader.read`), the dtype of
    `TrajectoryRecords.routes`, the store and R3's answer; a staged id must be below `num_experts` (the copy into a
    narrow dtype does not check, so that staging stays CUDA-graph safe)."""
    if num_experts is None:
        return torch.int32
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int or None, got {num_experts!r}")
    if num_experts <= 0xFF:
        return torch.uint8
    if num_experts <= 1 << 15:
        return torch.int16
    return torch.int32


def route_unset(routes: torch.Tensor) -> torch.Tensor:
    """bool mask of the route entries still holding the reset value (all bytes 0xFF: 255 in uint8, -1 in int16 and
    int32; any negative id counts as unset in the signed dtypes, as it did in int32)."""
    return routes == 0xFF if routes.dtype == torch.uint8 else routes < 0


@dataclass
class CaptureStats:
    """forwards / rows / bytes: forwards stored, token rows and bytes copied into the slot-keyed store."""

    forwards: int = 0
    rows: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class SiteBuffers:
    """Fixed-address views of one site in a `[rows, row_bytes]` byte buffer (staging or store).

    low_bits: uint8 `[rows, packed_len(n, bits)]`; scales: uint8 `[rows, n // block]`; global_scale: FP32
    `[rows, 1]` for nvfp4 (the per-token `S_enc`, or the static scale repeated per row), else None.
    """

    low_bits: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class RowLayout:
    """Byte offsets of every field inside a token row; fp32/int32 fields first, so all of them are aligned. Every
    row carries a `written` byte (1 in staging, so a stored row is marked written; `release` clears it). The routes
    (`route_dtype`, after the 4-byte fields, padded to 4 bytes) and the hook markers (first narrow field, padded to 4
    bytes) are adjacent: `sentinels` is their 4-aligned byte range, which one int32 fill resets after every forward
    (`RecordCapturer.on_forward_end`)."""

    fields: dict[tuple[str, str], tuple[int, int]]  # (owner, field) -> (offset, bytes)
    row_bytes: int
    route_dtype: torch.dtype = torch.int32

    @classmethod
    def build(
        cls,
        sites: dict[Site, SiteLayout],
        routes: tuple[int, int] | None,
        marks: int = 0,
        version: bool = False,
        route_dtype: torch.dtype = torch.int32,
    ) -> RowLayout:
        wide: list[tuple[tuple[str, str], int]] = []
        narrow: list[tuple[tuple[str, str], int]] = []
        if version:
            wide.append((("meta", "version"), 4))
        if marks:
            narrow.append((("meta", "marks"), marks))
        narrow.append((("meta", "written"), 1))
        for (layer, kind), (fmt_name, bits, n) in sites.items():
            fmt, owner = get_format(fmt_name), f"{layer}.{kind}"
            if fmt.has_global_scale:
                wide.append(((owner, "global_scale"), 4))
            narrow.append(((owner, "low_bits"), packed_len(n, bits)))
            narrow.append(((owner, "scales"), n // fmt.block))
        if routes is not None:
            wide.append((("routes", "routes"), route_dtype.itemsize * routes[0] * routes[1]))
        fields, offset = {}, 0
        for key, size in wide + narrow:
            fields[key] = (offset, size)
            offset += size
            if key in (("routes", "routes"), ("meta", "marks")):
                offset = _round_up(offset, 4)  # the sentinel range ends on a 4-byte boundary
        return cls(fields=fields, row_bytes=_round_up(offset, ALIGN), route_dtype=route_dtype)

    @property
    def sentinels(self) -> slice:
        """Byte range of the routes and the hook markers (empty when the row has neither)."""
        owners = [key for key in (("routes", "routes"), ("meta", "marks")) if key in self.fields]
        if not owners:
            return slice(0, 0)
        start = self.fields[owners[0]][0]
        end = _round_up(sum(self.fields[owners[-1]]), 4)
        return slice(start, end)

    def view(self, rows: torch.Tensor, owner: str, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        offset, size = self.fields[(owner, name)]
        return rows[:, offset : offset + size].view(dtype)


def record_row_layout(
    spec: RecordSpec,
    shape: ModelShape,
    sites: Sequence[Site] | None = None,
    routes: tuple[int, int] | None = None,
    marks: int = 0,
    versioned: bool = False,
    num_experts: int | None = None,
) -> tuple[dict[Site, SiteLayout], RowLayout]:
    """The captured sites' layouts and the token row of a `RecordCapturer` built with these arguments (its store
    costs `row_bytes` per KV slot: what an engine adds to its per-token KV memory; the routes take
    `route_dtype(num_experts)`'s bytes per id)."""
    full = site_layout(spec, shape)
    chosen: list[Site] = list(full) if sites is None else [(layer, kind) for layer, kind in sites]
    unknown = [s for s in chosen if s not in full]
    if unknown:
        raise ValueError(f"sites {unknown} are not captured by the record spec (sites {list(full)})")
    if routes is not None and (len(routes) != 2 or min(routes) < 1):
        raise ValueError(f"routes must be (route_layers >= 1, topk >= 1), got {routes!r}")
    if marks < 0:
        raise ValueError(f"marks must be >= 0, got {marks}")
    layouts = {s: full[s] for s in chosen}
    return layouts, RowLayout.build(layouts, routes, marks, versioned, route_dtype(num_experts))


def shard_layers(layers: Sequence[int], recorded: Sequence[int], tp_size: int) -> list[tuple[int, ...]]:
    """The MoE layers each of `tp_size` TP ranks keeps in its record store (rank order, each in layer order):
    round-robin over the ranks, the `recorded` layers first and then the others (hook markers and routes only), so
    every rank keeps about 1 / tp_size of the record bytes."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    order = list(recorded) + [layer for layer in layers if layer not in recorded]
    owner = {layer: k % tp_size for k, layer in enumerate(order)}
    return [tuple(layer for layer in layers if owner[layer] == rank) for rank in range(tp_size)]


@dataclass(frozen=True)
class RowReader:
    """Checks and splits store rows of one row layout (`record_row_layout`'s output and the capturer's options)
    without the capturer's buffers: what a process reading another process's rows needs (e.g. the rank that merges
    the record shards of several TP ranks)."""

    layouts: dict[Site, SiteLayout]
    row: RowLayout
    routes_shape: tuple[int, int] | None = None
    marks: int = 0
    versioned: bool = False

    def buffers(self, rows: torch.Tensor, site: Site) -> SiteBuffers:
        """Views of `site`'s fields in byte rows of this layout."""
        if site not in self.layouts:
            raise ValueError(f"site {site} is not captured; captured sites: {list(self.layouts)}")
        owner = f"{site[0]}.{site[1]}"
        has_gs = get_format(self.layouts[site][0]).has_global_scale
        return SiteBuffers(
            low_bits=self.row.view(rows, owner, "low_bits"),
            scales=self.row.view(rows, owner, "scales"),
            global_scale=self.row.view(rows, owner, "global_scale", torch.float32) if has_gs else None,
        )

    def read(self, rows: torch.Tensor, version: int | None = None) -> TrajectoryRecords:
        """The records of gathered store rows `[length, row_bytes]` (any device), as views of `rows` (the routes
        widened to int32: a copy unless the rows hold int32 routes); raises ValueError for unwritten rows, unset
        hook markers, unset routes or another weight version (see `RecordCapturer.gather`)."""
        if rows.dim() != 2 or rows.dtype != torch.uint8 or rows.shape[1] != self.row.row_bytes:
            raise ValueError(f"rows must be uint8 [length, {self.row.row_bytes}], got {rows.dtype} {tuple(rows.shape)}")
        length = rows.shape[0]
        unwritten = (self.row.view(rows, "meta", "written").flatten() == 0).nonzero().flatten()
        if unwritten.numel():
            raise ValueError(
                f"{unwritten.numel()} of {length} positions have no captured record (first positions "
                f"{unwritten[:8].tolist()})"
            )
        if self.marks:
            missing = (self.row.view(rows, "meta", "marks") != MARK_SET).nonzero()
            if missing.numel():
                raise ValueError(
                    f"{missing[:, 0].unique().numel()} of {length} positions were written by a forward in which a "
                    f"hook did not run (first (position, marker) {missing[:4].tolist()}); records refused"
                )
        routes = None
        if self.routes_shape is not None:
            routes = self.row.view(rows, "routes", "routes", self.row.route_dtype).view(length, *self.routes_shape)
            unrouted = route_unset(routes).any(dim=2).nonzero()
            if unrouted.numel():
                raise ValueError(
                    f"{unrouted[:, 0].unique().numel()} of {length} positions were written by a forward in which "
                    f"the routes of a layer were not staged (first (position, route layer) {unrouted[:4].tolist()}): "
                    "its route capture or the hook that stages them did not run; a hook did not run, records refused"
                )
            routes = routes.to(torch.int32)
        if version is not None:
            if not self.versioned:
                raise ValueError("gather(version=...) needs a capturer built with versioned=True")
            versions = self.row.view(rows, "meta", "version", torch.int32).flatten()
            if length and not bool((versions == version).all()):
                raise ValueError(
                    f"positions were computed under weight versions {versions.unique().tolist()}, not {version} only "
                    "(a weight update without a cache flush, or an in-place pause across an update); records refused"
                )
        records = {}
        for site, (fmt_name, bits, n) in self.layouts.items():
            buf = self.buffers(rows, site)
            records[site] = Record(get_format(fmt_name), bits, n, buf.low_bits, buf.scales, buf.global_scale)
        return TrajectoryRecords(num_tokens=length, records=records, routes=routes)


class RecordCapturer:
    """Captures records (and optionally R3 routes) of every forward into a store keyed by KV slot.

    Args:
        spec, shape: which sites are captured and their widths (`store.site_layout`).
        max_tokens: most token rows one forward stages (SGLang: max(chunked prefill size, max running requests)).
        num_slots: KV slots of the pool (SGLang: max_total_num_tokens + page_size); store rows.
        sites: the subset of `spec.sites()` staged per forward (default all; KV sites may instead be gathered from
            an FP4 KV pool at request finish).
        routes: `(route_layers, topk)` to capture R3 routes, layer ids 0..route_layers-1; None to skip.
        num_experts: the model's routed experts: the routes are kept as `route_dtype(num_experts)` (uint8 up to 255
            experts; None: int32) and widened to int32 when read.
        device: where staging and the store live (the forward's device).
        marks: hook markers per row (`mark`): every forward must set all of them on its rows, inside a CUDA graph
            too. After storing a forward's rows `on_forward_end` resets the markers and the staged routes (to -1,
            never a valid expert id) in one fill, so a replay in which a hook, or a layer's route capture, did not
            run leaves an unset marker or an unset route (all bytes 0xFF: 255 in uint8, -1 in int16 / int32, never
            an expert id), and every gather through those rows fails (a stale row is never stored). The route
            capture needs no marker of its own.
        versioned: keep the weight version of the forward that wrote each row (`on_forward_end(version=...)`);
            `gather(version=v)` refuses rows written under another version.
    """

    def __init__(
        self,
        spec: RecordSpec,
        shape: ModelShape,
        *,
        max_tokens: int,
        num_slots: int,
        sites: Sequence[Site] | None = None,
        routes: tuple[int, int] | None = None,
        device: torch.device | str = "cpu",
        marks: int = 0,
        versioned: bool = False,
        num_experts: int | None = None,
    ) -> None:
        if max_tokens < 1 or num_slots < 1:
            raise ValueError(f"max_tokens and num_slots must be >= 1, got {max_tokens}, {num_slots}")
        self.layouts, self.row = record_row_layout(spec, shape, sites, routes, marks, versioned, num_experts)
        self.reader = RowReader(self.layouts, self.row, routes, marks, versioned)
        self.routes_shape = routes
        self.marks, self.versioned = marks, versioned
        self.max_tokens, self.num_slots = max_tokens, num_slots
        self.staging = torch.zeros(max_tokens, self.row.row_bytes, dtype=torch.uint8, device=device)
        self.device = self.staging.device  # resolved: "cuda" becomes "cuda:<current>", as the forward's tensors are
        self.row.view(self.staging, "meta", "written").fill_(1)
        self.store = torch.zeros(num_slots, self.row.row_bytes, dtype=torch.uint8, device=self.device)
        # word views: the forward's copy into the store and the finish gather move 8-byte words, not bytes
        self._staging_words, self._store_words = self.staging.view(WORD), self.store.view(WORD)
        # the hooks' staging views, built once (fixed addresses): a hook call only slices its rows
        self._site_views = {site: self.reader.buffers(self.staging, site) for site in self.layouts}
        self._route_view = None
        if routes is not None:
            self._route_view = self.row.view(self.staging, "routes", "routes", self.row.route_dtype).view(-1, *routes)
        sentinels = self.row.sentinels
        self._sentinel_words = self.staging.view(torch.int32)[:, sentinels.start // 4 : sentinels.stop // 4]
        self._reset_sentinels()
        self.stats = CaptureStats()
        self._version: int | None = None  # the weight version the staging rows carry
        self._staged: dict[Site | int, int] = {}  # site or route layer -> rows staged in this forward

    @property
    def written(self) -> torch.Tensor:
        """bool `[num_slots]`: which KV slots hold a stored row (a forward wrote them since their last release)."""
        return self.row.view(self.store, "meta", "written").flatten().bool()

    def site_buffers(self, site: Site) -> SiteBuffers:
        """Staging views of `site` (`[max_tokens, ...]`, fixed addresses) for a kernel to write rows into."""
        if site not in self._site_views:
            raise ValueError(f"site {site} is not captured; captured sites: {list(self.layouts)}")
        return self._site_views[site]

    def staging_rows(self, site: Site, rows: int) -> SiteBuffers:
        """Staging views of rows [0, rows) of `site` for a kernel to write into (e.g. the `out`-style buffers of
        `trace_core.kernels.quantize_record`); the site counts as staged for this forward. CUDA-graph safe."""
        if not 0 <= rows <= self.max_tokens:
            raise ValueError(f"site {site}: {rows} rows outside [0, max_tokens={self.max_tokens}]")
        buf = self.site_buffers(site)
        self._staged[site] = rows
        gs = None if buf.global_scale is None else buf.global_scale[:rows]
        return SiteBuffers(low_bits=buf.low_bits[:rows], scales=buf.scales[:rows], global_scale=gs)

    def route_buffer(self) -> torch.Tensor:
        """Staging view of the routes, `[max_tokens, route_layers, topk]` of `row.route_dtype`."""
        if self._route_view is None:
            raise ValueError("this capturer was built without routes")
        return self._route_view

    def stage(
        self, site: Site, low_bits: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None = None
    ) -> None:
        """Copy one forward's records of `site` (rows 0..T-1) into staging. CUDA-graph safe: shape checks and
        `copy_` into fixed buffers only. `global_scale` (nvfp4): `[T, 1]` per token or a 0-d static scale."""
        buf = self.site_buffers(site)
        rows = low_bits.shape[0] if low_bits.dim() else 0
        if rows > self.max_tokens:
            raise ValueError(f"site {site}: {rows} rows exceed max_tokens={self.max_tokens}")
        for name, src, dst in (("low_bits", low_bits, buf.low_bits), ("scales", scales, buf.scales)):
            if src.dtype != torch.uint8 or tuple(src.shape) != (rows, dst.shape[1]):
                want = f"uint8 [{rows}, {dst.shape[1]}]"
                raise ValueError(f"site {site}: {name} must be {want}, got {src.dtype} {tuple(src.shape)}")
        if (global_scale is None) != (buf.global_scale is None):
            raise ValueError(f"site {site}: global_scale presence must match the format {self.layouts[site][0]}")
        if global_scale is not None and global_scale.dim() and tuple(global_scale.shape) != (rows, 1):
            raise ValueError(f"site {site}: global_scale must be 0-d or [{rows}, 1], got {global_scale.shape}")
        buf.low_bits[:rows].copy_(low_bits)
        buf.scales[:rows].copy_(scales)
        if global_scale is not None and buf.global_scale is not None:  # both or neither (checked above)
            buf.global_scale[:rows].copy_(global_scale.expand(rows, 1))
        self._staged[site] = rows

    def stage_quantized(self, site: Site, q: Quantized) -> None:
        """Reference path: stage a `Quantized` `[T, n]` from `trace_core.numerics.quant.quantize` (packs its low
        bits)."""
        fmt_name, bits, n = self.layouts.get(site, (None, 0, 0))
        if q.fmt.name != fmt_name or q.codes.dim() != 2 or q.codes.shape[1] != n:
            got = f"{q.fmt.name} {tuple(q.codes.shape)}"
            raise ValueError(f"site {site}: expected {fmt_name} codes [T, {n}], got {got}")
        self.stage(site, pack_low_bits(q.codes, bits), q.scales, q.global_scale)

    def stage_routes(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Copy one layer's top-k expert ids `[T, topk]` (any integer dtype, each below the capturer's
        `num_experts`) into the routes staging, cast to `row.route_dtype` (CUDA-graph safe)."""
        buf = self.route_buffer()
        if not 0 <= layer < buf.shape[1] or topk_ids.dim() != 2 or topk_ids.shape[1] != buf.shape[2]:
            raise ValueError(
                f"routes: layer {layer} of {buf.shape[1]} with ids [T, {buf.shape[2]}] expected, got {topk_ids.shape}"
            )
        if topk_ids.shape[0] > self.max_tokens:
            raise ValueError(f"routes: {topk_ids.shape[0]} rows exceed max_tokens={self.max_tokens}")
        buf[: topk_ids.shape[0], layer].copy_(topk_ids)
        self._staged[layer] = topk_ids.shape[0]

    def mark(self, index: int, rows: int) -> None:
        """Set hook marker `index` on staging rows [0, rows): the hook ran in this forward. CUDA-graph safe (a
        fill of a fixed view), so a replay sets it exactly when the captured hook runs."""
        if not 0 <= index < self.marks or not 0 <= rows <= self.max_tokens:
            raise ValueError(f"marker {index} of {self.marks} on {rows} rows (max_tokens {self.max_tokens})")
        self.row.view(self.staging, "meta", "marks")[:rows, index].fill_(MARK_SET)

    def on_forward_end(
        self,
        out_cache_loc: torch.Tensor,
        *,
        row_start: int = 0,
        graph_replay: bool = False,
        version: int | None = None,
    ) -> int:
        """Store staging rows [row_start, row_start + T) at KV slots `out_cache_loc` `[T]` (one `index_copy_` on the
        current stream), then reset the routes and hook markers of every staging row (one fill); returns the
        forward id (0, 1, ...).

        In eager mode every captured site and route layer must have staged at least row_start + T rows since the
        last call (a hook that did not fire would otherwise store stale rows); pass `graph_replay=True` after
        replaying a CUDA graph, whose staging writes run without Python (the markers catch a hook missing there).
        `version`: the weight version the forward ran with (required when built `versioned`; written into the
        staging rows only when it changes, so a forward costs two launches: the copy and the reset). CPU slots are
        range-checked here; on CUDA an out-of-range slot fails `index_copy_`'s device-side bounds check.
        """
        if self.versioned != (version is not None):
            raise ValueError(f"version {version!r}: pass one exactly when the capturer is versioned")
        rows = out_cache_loc.shape[0] if out_cache_loc.dim() == 1 else -1
        if rows < 0 or out_cache_loc.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"out_cache_loc must be a 1-D int tensor, got {out_cache_loc.dtype} {out_cache_loc.shape}")
        if out_cache_loc.device != self.device:
            raise ValueError(f"out_cache_loc is on {out_cache_loc.device}, the capturer on {self.device}")
        if row_start < 0 or row_start + rows > self.max_tokens:
            raise ValueError(f"rows [{row_start}, {row_start + rows}) exceed the staging buffer of {self.max_tokens}")
        staged, self._staged = self._staged, {}
        if not graph_replay:
            need = row_start + rows
            expected = list(self.layouts) + list(range(self.routes_shape[0] if self.routes_shape else 0))
            short = [key for key in expected if staged.get(key, 0) < need]
            if short:
                raise ValueError(
                    f"forward ended with rows [{row_start}, {need}) but {short} (site, or route layer) staged "
                    f"{[staged.get(k, 0) for k in short]} rows; nothing was captured"
                )
        slots = out_cache_loc.long()
        if self.device.type == "cpu":
            self._check_range(slots)
        span = slice(row_start, row_start + rows)
        if version is not None and version != self._version:
            self.row.view(self.staging, "meta", "version", torch.int32).fill_(version)
            self._version = version
        self._store_words.index_copy_(0, slots, self._staging_words[span])
        self._reset_sentinels()  # after the rows were stored, on the same stream
        self.stats.forwards += 1
        self.stats.rows += rows
        self.stats.bytes += rows * self.row.row_bytes
        return self.stats.forwards - 1

    def _reset_sentinels(self) -> None:
        """Every staging row's routes and hook markers to unset: one int32 fill (each sentinel byte 0xFF)."""
        self._sentinel_words.fill_(-1)

    def _check_range(self, slots: torch.Tensor) -> None:
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            lo, hi = int(slots.min()), int(slots.max())
            raise ValueError(f"KV slots out of range [0, {self.num_slots}): min {lo}, max {hi}")

    def release(self, slots: torch.Tensor) -> None:
        """Mark KV slots freed (the slots handed back to the KV allocator, not those the prefix cache keeps) so a
        gather through them before they are written again fails instead of returning another request's records.
        Ordered after every forward on the current stream; no host sync on CUDA."""
        slots = slots.to(self.device).long()
        if self.device.type == "cpu":
            self._check_range(slots)
        self.row.view(self.store, "meta", "written")[slots] = 0

    def gather_rows(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Store rows at `slots` (1-D int32 or int64, on the capturer's device) as one uint8 `[len, row_bytes]`
        tensor (written into `out`, contiguous and 8-byte aligned, when given): one `index_select` of 8-byte words on
        the current stream, no host sync. `read` checks and splits them."""
        if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be a 1-D int tensor, got {slots.dtype} {tuple(slots.shape)}")
        slots = slots.to(self.device)
        if self.device.type == "cpu":
            self._check_range(slots)
        if out is None:
            return self._store_words.index_select(0, slots).view(torch.uint8)
        shape = (slots.shape[0], self.row.row_bytes)
        if out.dtype != torch.uint8 or out.shape != shape or not out.is_contiguous() or out.data_ptr() % ALIGN:
            raise ValueError(
                f"out must be contiguous uint8 {list(shape)} at an {ALIGN}-byte aligned address, got {out.dtype} "
                f"{tuple(out.shape)} at address offset {out.data_ptr() % ALIGN} (mod {ALIGN})"
            )
        torch.index_select(self._store_words, 0, slots, out=out.view(WORD))
        return out

    def gather(self, slots: torch.Tensor, length: int, *, version: int | None = None) -> TrajectoryRecords:
        """Records of positions [0, length) of a request whose position i lives in KV slot `slots[i]`, on the
        capturer's device. `version` (versioned capturers): every row must have been written under that weight
        version. Raises ValueError for unwritten rows, rows whose hook markers are not all set, or another
        version."""
        if not 0 <= length <= slots.shape[0]:
            raise ValueError(f"length {length} is outside [0, {slots.shape[0]}] request slots")
        self._check_range(slots[:length].long())  # before the device index (a sync; `read` syncs anyway)
        return self.read(self.gather_rows(slots[:length]), version)

    def read(self, rows: torch.Tensor, version: int | None = None) -> TrajectoryRecords:
        """The records of gathered store rows `[length, row_bytes]` (any device), as views of `rows`
        (`RowReader.read`)."""
        return self.reader.read(rows, version)
