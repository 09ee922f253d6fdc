"""Trainer-side loader of the record store: dense per-site tensors for a micro-batch of (trajectory, token range).

`RecordReader.load` returns, for each site, one `Record` of shape `[B, T, n]` (B trajectories, T = longest range
or `pad_to`) and a has-record mask `[B, T]` that is False on padding rows and on rows whose record is missing
under the "rtn" policy, so the guided kernel rounds exactly those rows by RTN. Reads are streaming and memory
bounded: only the frames (at most `FRAME_BYTES` raw bytes each) holding the requested rows of the requested
trajectories and sites are read and decompressed, and decompressed frames sit in an LRU cache of at most
`cache_bytes`. Missing trajectories follow an explicit policy: "error" raises `MissingRecordError`; "rtn" marks
their rows as having no record and counts them in `stats`. `check_bindings` compares each trajectory's stored
`Binding` with what the trainer expects and raises `BindingMismatchError` naming the fields that differ.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np
import torch
import zstandard

from trace_core.numerics.formats import get_format
from trace_core.records.layout import SiteLayout
from trace_core.records.spec import Binding, Record, packed_len
from trace_core.records.store import (
    INDEX_NAME,
    ROUTES,
    CorruptShardError,
    MissingRecordError,
    StoreError,
    build_index,
    check_format,
    check_site_recipe,
    parse_site,
    read_failures,
    read_header,
    site_key,
    step_dir,
)
from trace_core.sites import Site

POLICIES = ("error", "rtn")


class FailedRecordError(MissingRecordError):
    """The writer recorded that a trajectory's records will not come (`trace_core.records.store.write_failure`)."""


class BindingMismatchError(StoreError):
    """A trajectory's records were produced for another step, policy, attempt or token sequence (or are unbound)."""


_DTYPES = {"low_bits": np.uint8, "scales": np.uint8, "global_scale": np.float32, ROUTES: np.int32}


@dataclass
class ReaderStats:
    """Counters a trainer reports: rows served with a record, rows that fall back to RTN for a missing record
    (`fallback_rows`, by trajectory in `missing`), frames read and bytes read from disk / decompressed."""

    rows: int = 0
    fallback_rows: int = 0
    missing: dict[str, int] = field(default_factory=dict)
    frames_read: int = 0
    disk_bytes: int = 0
    raw_bytes: int = 0
    cache_hits: int = 0


@dataclass(frozen=True)
class MicroBatchRecords:
    """Records of a micro-batch, padded to `[B, T]` rows.

    Attributes:
        records: site -> `Record` with `[B, T, ...]` tensors (nvfp4 global scale `[B, T, 1]`, 1.0 on rows without
            a record).
        has_record: site -> bool `[B, T]`; False on padding and on missing records (RTN fallback rows).
        routes: int32 `[B, T, moe_layers, topk]` or None when no trajectory of the batch recorded routes.
        has_routes: bool `[B, T]` rows whose routes were recorded.
    """

    records: dict[Site, Record]
    has_record: dict[Site, torch.Tensor]
    routes: torch.Tensor | None
    has_routes: torch.Tensor

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatchRecords:
        """The same records on `device` (e.g. the trainer's GPU)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        def move_optional(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else move(t)

        records = {
            site: Record(r.fmt, r.bits, r.n, move(r.low_bits), move(r.scales), move_optional(r.global_scale))
            for site, r in self.records.items()
        }
        return MicroBatchRecords(
            records=records,
            has_record={site: move(m) for site, m in self.has_record.items()},
            routes=move_optional(self.routes),
            has_routes=move(self.has_routes),
        )


class _LRU:
    """Decompressed frames keyed by (shard, trajectory, site, field), bounded by total bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.size = capacity, 0
        self.items: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def get(self, key: tuple) -> np.ndarray | None:
        arr = self.items.get(key)
        if arr is not None:
            self.items.move_to_end(key)
        return arr

    def discard(self, key: tuple) -> None:
        arr = self.items.pop(key, None)
        if arr is not None:
            self.size -= arr.nbytes

    def put(self, key: tuple, arr: np.ndarray) -> None:
        if arr.nbytes > self.capacity:
            return
        self.items[key] = arr
        self.size += arr.nbytes
        while self.size > self.capacity:
            _, old = self.items.popitem(last=False)
            self.size -= old.nbytes


class RecordReader:
    """Reads one step's records for training micro-batches (see module docstring). Not thread-safe: use one reader
    per loader thread or process."""

    def __init__(
        self,
        root: str | os.PathLike,
        step: int,
        *,
        missing: str = "error",
        cache_bytes: int = 256 << 20,
        layout: Mapping[Site, SiteLayout] | None = None,
    ) -> None:
        if missing not in POLICIES:
            raise ValueError(f"missing-record policy must be one of {POLICIES}, got {missing!r}")
        self.dir = step_dir(root, step)
        if not self.dir.is_dir():
            raise StoreError(f"record store has no step {step} (no directory {self.dir})")
        self.missing = missing
        self.layout = None if layout is None else dict(sorted(layout.items()))
        self.stats = ReaderStats()
        self._cache = _LRU(cache_bytes)
        self._headers: dict[str, dict] = {}
        self._files: dict[str, BinaryIO] = {}  # shards open during one `load` / `verify`
        self._dctx = zstandard.ZstdDecompressor()
        self.index = self._load_index()

    def _load_index(self) -> dict[str, str]:
        path = self.dir / INDEX_NAME
        if not path.exists():
            return build_index(self.dir)
        try:
            index = json.loads(path.read_bytes())["shards"]
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptShardError(f"step index {path} does not parse: {e}") from e
        if not isinstance(index, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in index.items()):
            raise CorruptShardError(
                f"step index {path}: 'shards' must map trajectory ids to shard names, got {json.dumps(index)[:200]}"
            )
        for shard in set(index.values()):
            if not (self.dir / shard).exists():
                raise StoreError(f"step index {path} lists shard {shard}, which is missing")
        return index

    def trajectories(self) -> list[str]:
        return sorted(self.index)

    def _header(self, shard: str) -> dict:
        if shard not in self._headers:
            self._headers[shard] = read_header(self.dir / shard)
        return self._headers[shard]

    def _entry(self, traj: str) -> tuple[str, dict] | None:
        shard = self.index.get(traj)
        if shard is None:
            return None
        entry = self._header(shard)["trajectories"].get(traj)
        if entry is None:
            raise CorruptShardError(f"shard {self.dir / shard} lacks trajectory {traj!r} that the step index lists")
        return shard, entry

    def binding(self, traj: str | int) -> Binding | None:
        """The stored binding of trajectory `traj` (None when its shard is unbound)."""
        found = self._entry(str(traj))
        if found is None:
            raise MissingRecordError(f"trajectory {str(traj)!r} has no records in {self.dir}")
        b = found[1].get("binding")
        try:
            return None if b is None else Binding.from_json(b)
        except (TypeError, ValueError) as e:
            raise CorruptShardError(f"shard {self.dir / found[0]}, trajectory {str(traj)!r}: bad binding {b}") from e

    def check_bindings(self, expected: Mapping[str | int, Binding]) -> None:
        """Raise `BindingMismatchError` naming the trajectory, shard and fields unless every trajectory's stored
        binding equals `expected[trajectory]`."""
        problems = []
        for traj, want in expected.items():
            got = self.binding(traj)
            shard = self.index[str(traj)]
            if got is None:
                problems.append(f"trajectory {str(traj)!r} (shard {shard}) has no binding")
                continue
            diff = got.mismatches(want)
            if diff:
                fields = ", ".join(f"{k} {a!r} != expected {b!r}" for k, (a, b) in diff.items())
                problems.append(f"trajectory {str(traj)!r} (shard {shard}): {fields}")
        if problems:
            raise BindingMismatchError(f"records of {self.dir} do not belong to this batch: " + "; ".join(problems))

    def _frame(self, shard: str, traj: str, name: str, kind: str, meta: dict, i: int) -> np.ndarray:
        """Frame `i` of one field, decompressed, as a flat numpy array checked against its checksum and length."""
        key = (shard, traj, name, kind, i)
        arr = self._cache.get(key)
        if arr is not None:
            self.stats.cache_hits += 1
            return arr
        frames = meta["frames"]
        length, raw_len = frames[i]
        start = self._header(shard)["data_start"] + meta["offset"] + sum(f[0] for f in frames[:i])

        def where() -> str:  # built only for an error: this runs once per frame
            return f"shard {self.dir / shard}, trajectory {traj!r}, {name} {kind}"

        try:
            f = self._files.get(shard)
            if f is None:
                f = self._files[shard] = open(self.dir / shard, "rb")
            f.seek(start)
            frame = f.read(length)
        except OSError as e:
            raise StoreError(f"{where()}: cannot read the shard ({e})") from e
        if len(frame) != length:
            raise CorruptShardError(f"{where()}: frame {i} truncated ({len(frame)} of {length} bytes)")
        try:
            raw = self._dctx.decompress(frame, max_output_size=raw_len)
        except zstandard.ZstdError as e:
            raise CorruptShardError(f"{where()}: corrupt frame {i}, fails its checksum or does not decode ({e})") from e
        if len(raw) != raw_len:
            raise CorruptShardError(f"{where()}: frame {i} decodes to {len(raw)} bytes, header says {raw_len}")
        arr = np.frombuffer(raw, dtype=_DTYPES[kind])
        self.stats.frames_read += 1
        self.stats.disk_bytes += len(frame)
        self.stats.raw_bytes += len(raw)
        self._cache.put(key, arr)
        return arr

    def _close_files(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def load(self, batch: Sequence[tuple[str | int, int, int]], *, pad_to: int | None = None) -> MicroBatchRecords:
        """Records of positions [start, end) of each (trajectory, start, end), padded to `[B, T]`."""
        try:
            return self._load(batch, pad_to)
        finally:
            self._close_files()

    def _load(self, batch: Sequence[tuple[str | int, int, int]], pad_to: int | None) -> MicroBatchRecords:
        if not batch:
            raise ValueError("load() needs a non-empty micro-batch")
        spans = [(str(t), s, e) for t, s, e in batch]
        for traj, start, end in spans:
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
                raise ValueError(f"trajectory {traj!r}: token range [{start}, {end}) is invalid")
        longest = max(e - s for _, s, e in spans)
        t = longest if pad_to is None else pad_to
        if t < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest range ({longest} tokens)")
        entries = [self._lookup(traj, start, end) for traj, start, end in spans]
        layout = self._site_layout([e for e in entries if e is not None])
        b = len(spans)
        records, has_record = {}, {}
        for site, (fmt_name, bits, n) in layout.items():
            fmt = get_format(fmt_name)
            low = torch.zeros(b, t, packed_len(n, bits), dtype=torch.uint8)
            scales = torch.zeros(b, t, n // fmt.block, dtype=torch.uint8)
            gs = torch.ones(b, t, 1, dtype=torch.float32) if fmt.has_global_scale else None
            mask = torch.zeros(b, t, dtype=torch.bool)
            for i, ((traj, start, end), entry) in enumerate(zip(spans, entries, strict=True)):
                meta = None if entry is None else entry[1]["sites"].get(site_key(site))
                if entry is None or meta is None:
                    self._fallback(traj, end - start)
                    continue
                shard = entry[0]
                rows = end - start
                fields = meta["fields"]
                self._rows(shard, traj, site, "low_bits", fields, start, end, low[i, :rows])
                self._rows(shard, traj, site, "scales", fields, start, end, scales[i, :rows])
                if gs is not None:
                    self._rows(shard, traj, site, "global_scale", fields, start, end, gs[i, :rows])
                mask[i, :rows] = True
                self.stats.rows += rows
            records[site] = Record(fmt=fmt, bits=bits, n=n, low_bits=low, scales=scales, global_scale=gs)
            has_record[site] = mask
        routes, has_routes = self._routes(spans, entries, t)
        return MicroBatchRecords(records=records, has_record=has_record, routes=routes, has_routes=has_routes)

    def _lookup(self, traj: str, start: int, end: int) -> tuple[str, dict] | None:
        found = self._entry(traj)
        if found is None:
            if self.missing == "error":
                failed = [msg for (t, _), (_, msg) in read_failures(self.dir).items() if t == traj]
                if failed:
                    raise FailedRecordError(f"trajectory {traj!r} has no records in {self.dir}: {'; '.join(failed)}")
                raise MissingRecordError(f"trajectory {traj!r} has no records in {self.dir}")
            return None
        if end > found[1]["num_tokens"]:
            raise ValueError(
                f"trajectory {traj!r} has {found[1]['num_tokens']} recorded tokens; range [{start}, {end}) exceeds it"
            )
        return found

    def _fallback(self, traj: str, rows: int) -> None:
        if self.missing == "error":
            raise MissingRecordError(f"trajectory {traj!r} in {self.dir} lacks a site the micro-batch needs")
        self.stats.fallback_rows += rows
        self.stats.missing[traj] = self.stats.missing.get(traj, 0) + rows

    def _site_layout(self, entries: list[tuple[str, dict]]) -> dict[Site, SiteLayout]:
        """Site -> (format, bits, width): the reader's `layout` if given, else the union of the batch's sites;
        every trajectory's record of a site must agree with it."""
        layout: dict[Site, SiteLayout] = dict(self.layout or {})
        for shard, entry in entries:
            for key, meta in entry["sites"].items():
                where = f"shard {self.dir / shard}, site {key}"
                check_format(meta["fmt"], where)
                site, found = parse_site(key), (meta["fmt"], meta["bits"], meta["n"])
                check_site_recipe(site, meta["fmt"], entry.get("binding"), where)
                if self.layout is not None and site not in self.layout:
                    continue
                if layout.setdefault(site, found) != found:
                    raise StoreError(f"{where}: (format, bits, width) {found} differs from {layout[site]} expected")
        return dict(sorted(layout.items()))

    def _copy_rows(self, shard: str, traj: str, name: str, kind: str, meta: dict, start: int, end: int, out):
        """Copy rows [start, end) of one field into `out` (`[end - start, ...]` numpy view), decompressing only the
        frames that hold them."""
        per, width = meta["rows"], int(np.prod(out.shape[1:]))

        def where() -> str:  # built only for an error: this runs once per field
            return f"shard {self.dir / shard}, trajectory {traj!r}, {name}"

        if meta["raw"] % (width * out.itemsize or 1):
            raise CorruptShardError(f"{where()}: {kind} of {meta['raw']} bytes does not hold rows of width {width}")
        flat = out.reshape(out.shape[0], width)
        row = start
        while row < end:
            i = row // per
            arr = self._frame(shard, traj, name, kind, meta, i)
            first, last = i * per, min(end, (i + 1) * per)
            rows = arr.reshape(-1, width)
            if rows.shape[0] < last - first:
                raise CorruptShardError(f"{where()}: {kind} frame {i} holds {rows.shape[0]} rows, not {last - first}")
            flat[row - start : last - start] = rows[row - first : last - first]
            row = last

    def _rows(self, shard: str, traj: str, site: Site, kind: str, fields: dict, start: int, end: int, out):
        """Copy rows [start, end) of one field into `out` (a `[rows, width]` tensor view)."""
        if kind not in fields:
            raise CorruptShardError(f"shard {self.dir / shard}, trajectory {traj!r}, site {site_key(site)}: no {kind}")
        self._copy_rows(shard, traj, site_key(site), kind, fields[kind], start, end, out.numpy())

    def _routes(self, batch, entries, t: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        b = len(batch)
        has = torch.zeros(b, t, dtype=torch.bool)
        shapes = {tuple(e[1][ROUTES]["shape"]) for e in entries if e is not None and ROUTES in e[1]}
        if not shapes:
            return None, has
        if len(shapes) > 1:
            raise StoreError(f"routes of the micro-batch disagree in [moe_layers, topk]: {sorted(shapes)}")
        (shape,) = shapes
        routes = torch.zeros(b, t, *shape, dtype=torch.int32)
        for i, ((traj, start, end), entry) in enumerate(zip(batch, entries, strict=True)):
            if entry is None or ROUTES not in entry[1]:
                continue
            self._copy_rows(
                entry[0], traj, ROUTES, ROUTES, entry[1][ROUTES], start, end, routes[i, : end - start].numpy()
            )
            has[i, : end - start] = True
        return routes, has

    def verify(self) -> int:
        """Read and check every frame of the step (bypassing the cache); returns the number of frames checked."""
        try:
            return self._verify()
        finally:
            self._close_files()

    def _verify(self) -> int:
        count = 0
        for traj, shard in sorted(self.index.items()):
            entry = self._header(shard)["trajectories"][traj]
            fields = [
                (key, kind, fmeta) for key, meta in entry["sites"].items() for kind, fmeta in meta["fields"].items()
            ]
            if ROUTES in entry:
                fields.append((ROUTES, ROUTES, entry[ROUTES]))
            for key, kind, fmeta in fields:
                for i in range(len(fmeta["frames"])):
                    self._cache.discard((shard, traj, key, kind, i))
                    self._frame(shard, traj, key, kind, fmeta, i)
                    count += 1
        return count
