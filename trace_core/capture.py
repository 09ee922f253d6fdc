"""Record capture on the rollout side: fixed staging buffers, an async host ring and a host store keyed by KV slot.

Follows SGLang's routed-experts capturer (row-indexed static GPU buffer written inside the forward, host buffer
indexed by KV slot, gather through the request's slots at finish), made asynchronous (docs/design.md, "Records"):
  * every captured site writes its record rows (packed low code bits, block scale bytes and, for nvfp4, the FP32
    token scale) into views of one staging buffer `[max_tokens, row_bytes]` allocated once: fixed addresses, a
    `copy_` per write, so writes are CUDA-graph safe (`stage`, or a kernel writing into `staging_rows` directly);
    R3 routes `[tokens, route_layers, topk]` int32 live in the same rows;
  * `on_forward_end(out_cache_loc)` hands rows [0, T) to the host ring (`trace_core.host_ring`), which lands them
    in the host store at row `out_cache_loc[i]`;
  * `gather(slots, length)` (or `gather_async`, which copies on the drain thread) returns the request's
    `TrajectoryRecords` for positions [0, length) from the slots of its `req_to_token` row. Prefix-cache hits,
    chunked prefill and retraction need nothing special: a slot holds whatever the last forward that wrote it
    computed.
One scheduler thread drives a capturer; it is not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from trace_core.formats import get_format
from trace_core.host_ring import AsyncHostRing, RingStats, SyncHostRing
from trace_core.quant import Quantized
from trace_core.records import ModelShape, Record, RecordSpec, pack_low_bits, packed_len
from trace_core.store import Site, SiteLayout, TrajectoryRecords, site_layout

ALIGN = 4  # fp32 / int32 fields are read through dtype views of the byte rows


@dataclass(frozen=True)
class SiteBuffers:
    """Fixed-address views of one site in a `[rows, row_bytes]` byte buffer (staging or host store).

    low_bits: uint8 `[rows, packed_len(n, bits)]`; scales: uint8 `[rows, n // block]`; global_scale: FP32
    `[rows, 1]` for nvfp4 (the per-token `S_enc`, or the static scale repeated per row), else None.
    """

    low_bits: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None


@dataclass(frozen=True)
class RowLayout:
    """Byte offsets of every field inside a token row; fp32/int32 fields first, so all of them are aligned."""

    fields: dict[tuple[str, str], tuple[int, int]]  # (owner, field) -> (offset, bytes)
    row_bytes: int

    @classmethod
    def build(
        cls, sites: dict[Site, SiteLayout], routes: tuple[int, int] | None, marks: int = 0, version: bool = False
    ) -> RowLayout:
        wide: list[tuple[tuple[str, str], int]] = []
        narrow: list[tuple[tuple[str, str], int]] = []
        if routes is not None:
            wide.append((("routes", "routes"), 4 * routes[0] * routes[1]))
        if version:
            wide.append((("meta", "version"), 4))
        if marks:
            narrow.append((("meta", "marks"), marks))
        for (layer, kind), (fmt_name, bits, n) in sites.items():
            fmt, owner = get_format(fmt_name), f"{layer}.{kind}"
            if fmt.has_global_scale:
                wide.append(((owner, "global_scale"), 4))
            narrow.append(((owner, "low_bits"), packed_len(n, bits)))
            narrow.append(((owner, "scales"), n // fmt.block))
        fields, offset = {}, 0
        for key, size in wide + narrow:
            fields[key] = (offset, size)
            offset += size
        return cls(fields=fields, row_bytes=-(-offset // ALIGN) * ALIGN)

    def view(self, rows: torch.Tensor, owner: str, name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        offset, size = self.fields[(owner, name)]
        return rows[:, offset : offset + size].view(dtype)


class RecordCapturer:
    """Captures records (and optionally R3 routes) of every forward into a host store keyed by KV slot.

    Args:
        spec, shape: which sites are captured and their widths (`store.site_layout`).
        max_tokens: most token rows one forward stages (SGLang: max(chunked prefill size, max running requests)).
        num_slots: KV slots of the pool (SGLang: max_total_num_tokens + page_size); host store rows.
        sites: the subset of `spec.sites()` staged per forward (default all; KV sites may instead be gathered from
            an FP4 KV pool at request finish).
        routes: `(route_layers, topk)` to capture R3 routes, layer ids 0..route_layers-1; None to skip.
        device: where staging lives; CUDA uses the async ring, CPU writes the host store synchronously.
        ring_depth: forwards whose copies may be in flight at once (CUDA).
        drain_thread: scatter finished copies into the host store on a background thread (CUDA), keeping that
            CPU work off the scheduler thread; otherwise the calling thread does it in `on_forward_end`/`flush`.
        marks: hook markers per row (`mark`): every forward must set all of them on its rows, inside a CUDA graph
            too; `on_forward_end` clears them after shipping the rows, so a replay in which a hook did not run
            leaves its marker at 0 and every gather through those rows fails (a stale row is never stored).
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
        ring_depth: int = 4,
        drain_thread: bool = True,
        marks: int = 0,
        versioned: bool = False,
    ) -> None:
        if max_tokens < 1 or num_slots < 1:
            raise ValueError(f"max_tokens and num_slots must be >= 1, got {max_tokens}, {num_slots}")
        full = site_layout(spec, shape)
        chosen: list[Site] = list(full) if sites is None else [(layer, kind) for layer, kind in sites]
        unknown = [s for s in chosen if s not in full]
        if unknown:
            raise ValueError(f"sites {unknown} are not captured by the record spec (sites {list(full)})")
        if routes is not None and (len(routes) != 2 or min(routes) < 1):
            raise ValueError(f"routes must be (route_layers >= 1, topk >= 1), got {routes!r}")
        self.layouts: dict[Site, SiteLayout] = {s: full[s] for s in chosen}
        self.routes_shape = routes
        if marks < 0:
            raise ValueError(f"marks must be >= 0, got {marks}")
        self.marks, self.versioned = marks, versioned
        self.row = RowLayout.build(self.layouts, routes, marks, versioned)
        self.max_tokens, self.num_slots = max_tokens, num_slots
        self.device = torch.device(device)
        self.staging = torch.zeros(max_tokens, self.row.row_bytes, dtype=torch.uint8, device=self.device)
        self.host = torch.zeros(num_slots, self.row.row_bytes, dtype=torch.uint8)
        self.written = torch.zeros(num_slots, dtype=torch.bool)
        if self.device.type == "cuda":
            self.ring: AsyncHostRing | SyncHostRing = AsyncHostRing(
                self.staging, self.host, self.written, ring_depth, drain_thread
            )
        elif self.device.type == "cpu":
            self.ring = SyncHostRing(self.staging, self.host, self.written)
        else:
            raise ValueError(f"capture runs on CUDA or CPU, got device {self.device}")
        self._staged: dict[Site | int, int] = {}  # site or route layer -> rows staged in this forward

    @property
    def stats(self) -> RingStats:
        return self.ring.stats

    def _buffers(self, rows: torch.Tensor, site: Site) -> SiteBuffers:
        if site not in self.layouts:
            raise ValueError(f"site {site} is not captured; captured sites: {list(self.layouts)}")
        owner = f"{site[0]}.{site[1]}"
        has_gs = get_format(self.layouts[site][0]).has_global_scale
        return SiteBuffers(
            low_bits=self.row.view(rows, owner, "low_bits"),
            scales=self.row.view(rows, owner, "scales"),
            global_scale=self.row.view(rows, owner, "global_scale", torch.float32) if has_gs else None,
        )

    def site_buffers(self, site: Site) -> SiteBuffers:
        """Staging views of `site` (`[max_tokens, ...]`, fixed addresses) for a kernel to write rows into."""
        return self._buffers(self.staging, site)

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
        """Staging view of the routes, int32 `[max_tokens, route_layers, topk]`."""
        if self.routes_shape is None:
            raise ValueError("this capturer was built without routes")
        return self.row.view(self.staging, "routes", "routes", torch.int32).view(-1, *self.routes_shape)

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
        """Reference path: stage a `Quantized` `[T, n]` from `trace_core.quant.quantize` (packs its low bits)."""
        fmt_name, bits, n = self.layouts.get(site, (None, 0, 0))
        if q.fmt.name != fmt_name or q.codes.dim() != 2 or q.codes.shape[1] != n:
            got = f"{q.fmt.name} {tuple(q.codes.shape)}"
            raise ValueError(f"site {site}: expected {fmt_name} codes [T, {n}], got {got}")
        self.stage(site, pack_low_bits(q.codes, bits), q.scales, q.global_scale)

    def stage_routes(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Copy one layer's top-k expert ids `[T, topk]` into the routes staging (CUDA-graph safe)."""
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
        self.row.view(self.staging, "meta", "marks")[:rows, index].fill_(1)

    def on_forward_end(
        self,
        out_cache_loc: torch.Tensor,
        *,
        row_start: int = 0,
        graph_replay: bool = False,
        version: int | None = None,
    ) -> int:
        """Send staging rows [row_start, row_start + T) to the host store at KV slots `out_cache_loc` `[T]`;
        returns the forward id (0, 1, ...) to pass as `after_forward` to `gather` / `flush`.

        In eager mode every captured site and route layer must have staged at least row_start + T rows since the
        last call (a hook that did not fire would otherwise ship stale rows); pass `graph_replay=True` after
        replaying a CUDA graph, whose staging writes run without Python (the markers catch a hook missing there).
        `version`: the weight version the forward ran with (required when built `versioned`).
        """
        if self.versioned != (version is not None):
            raise ValueError(f"version {version!r}: pass one exactly when the capturer is versioned")
        staged, self._staged = self._staged, {}
        if not graph_replay:
            need = row_start + out_cache_loc.shape[0]
            expected = list(self.layouts) + list(range(self.routes_shape[0] if self.routes_shape else 0))
            short = [key for key in expected if staged.get(key, 0) < need]
            if short:
                raise ValueError(
                    f"forward ended with rows [{row_start}, {need}) but {short} (site, or route layer) staged "
                    f"{[staged.get(k, 0) for k in short]} rows; nothing was captured"
                )
        rows = slice(row_start, row_start + out_cache_loc.shape[0])
        if version is not None:
            self.row.view(self.staging, "meta", "version", torch.int32)[rows].fill_(version)
        forward = self.ring.submit(row_start, out_cache_loc)
        if self.marks:  # after the ring's snapshot of the rows, on the same stream
            self.row.view(self.staging, "meta", "marks").zero_()
        return forward

    def poll(self) -> None:
        """Move completed copies into the host store without blocking (also done by every `on_forward_end`)."""
        self.ring.poll()

    def flush(self, upto: int | None = None) -> None:
        """Wait until forwards up to id `upto` (default: every submitted forward) are in the host store."""
        self.ring.flush(upto)

    def close(self) -> None:
        """Finish every copy in flight and stop the drain thread; the host store stays readable."""
        self.ring.close()

    def release(self, slots: torch.Tensor) -> None:
        """Mark KV slots freed (the slots handed back to the KV allocator, not those the prefix cache keeps) so a
        gather through them before they are written again fails instead of returning another request's records.
        Ordered after every forward submitted so far; does not wait on the CUDA path with a drain thread."""
        resolve = self._slot_index(slots, slots.shape[0] if slots.dim() == 1 else -1)

        def clear() -> None:
            self.written[resolve()] = False

        self.ring.run_after(clear, report=True)

    def _slot_index(self, slots: torch.Tensor, length: int) -> Callable[[], torch.Tensor]:
        """Check `slots[:length]` and start moving it to the host; the returned function waits for the move and
        returns the int64 CPU index. A CUDA tensor is copied on the current stream into pinned memory, so only the
        function's caller (the drain thread, for `gather_async`) waits for that stream."""
        if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be a 1-D int tensor, got {slots.dtype} {tuple(slots.shape)}")
        if not 0 <= length <= slots.shape[0]:
            raise ValueError(f"length {length} is outside [0, {slots.shape[0]}] request slots")
        if slots.device.type == "cuda":
            host = torch.empty(length, dtype=slots.dtype, pin_memory=True)
            host.copy_(slots[:length], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host, copied = slots[:length], None

        def resolve() -> torch.Tensor:
            if copied is not None:
                copied.synchronize()
            idx = host.long()
            if length and (int(idx.min()) < 0 or int(idx.max()) >= self.num_slots):
                lo, hi = int(idx.min()), int(idx.max())
                raise ValueError(f"slots out of range [0, {self.num_slots}): min {lo}, max {hi}")
            return idx

        if copied is None:
            resolve()  # CPU slots: bad input fails here, on the caller's thread
        return resolve

    def gather(
        self, slots: torch.Tensor, length: int, after_forward: int | None = None, *, version: int | None = None
    ) -> TrajectoryRecords:
        """Records of positions [0, length) of a request whose position i lives in KV slot `slots[i]`.

        `after_forward`: id of the last forward that wrote the request's rows (the batch whose results are being
        processed). Only copies up to it are waited for, so a forward already launched by an overlap scheduler is
        not; default: wait for every submitted forward. Pass `slots` on the CPU to avoid waiting for the current
        CUDA stream. `version` (versioned capturers): every row must have been written under that weight version.
        Raises ValueError for unwritten rows, rows whose hook markers are not all set, or another version."""
        idx = self._slot_index(slots, length)()
        self.flush(after_forward)
        return self._read(idx, version)

    def gather_async(self, slots: torch.Tensor, length: int, *, version: int | None = None) -> Future:
        """`gather` as a future: the slot transfer and the copy out of the host store run on the drain thread,
        after every forward submitted so far, so the scheduler thread neither waits nor copies (at once on the
        other paths)."""
        resolve = self._slot_index(slots, length)
        return self.ring.run_after(lambda: self._read(resolve(), version))

    def _read(self, idx: torch.Tensor, version: int | None = None) -> TrajectoryRecords:
        """The records of host-store rows `idx`, as views of one gathered copy (checks: see `gather`)."""
        length = idx.shape[0]
        unwritten = (~self.written[idx]).nonzero().flatten()
        if unwritten.numel():
            raise ValueError(
                f"{unwritten.numel()} of {length} positions have no captured record (first positions "
                f"{unwritten[:8].tolist()}, slots {idx[unwritten[:8]].tolist()})"
            )
        rows = self.host[idx]
        if self.marks:
            missing = (self.row.view(rows, "meta", "marks") == 0).nonzero()
            if missing.numel():
                raise ValueError(
                    f"{missing[:, 0].unique().numel()} of {length} positions were written by a forward in which a "
                    f"hook did not run (first (position, marker) {missing[:4].tolist()}); records refused"
                )
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
            buf = self._buffers(rows, site)
            records[site] = Record(get_format(fmt_name), bits, n, buf.low_bits, buf.scales, buf.global_scale)
        routes = None
        if self.routes_shape is not None:
            routes = self.row.view(rows, "routes", "routes", torch.int32).view(length, *self.routes_shape)
        return TrajectoryRecords(num_tokens=length, records=records, routes=routes)
