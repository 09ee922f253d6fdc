"""On-disk record store: one directory per RL step, zstandard shards of finished trajectories (docs/design.md,
"Records").

A rollout worker hands finished trajectories' records (`TrajectoryRecords`) to a `StepWriter`, which writes
them as a shard file (one or many trajectories per shard; SGLang's capturer writes every request of a transfer in
one): a small JSON header (the shard's index: trajectory -> site -> field -> byte range) followed
by zstandard frames of at most `FRAME_BYTES` raw bytes (whole rows) per (trajectory, site, field), so a reader
decompresses only the rows a micro-batch needs. Every frame carries zstandard's content checksum (XXH64) and the
header a CRC-32; each trajectory may carry a `Binding` (step, policy version, trajectory, attempt, token digest)
that the trainer checks. Shards are written to a temporary name, fsynced and linked into place (never over an
existing shard), so a crash never leaves a half-written shard under a shard name; shard names are unique per
writer, so several workers (threads or processes, one host or many over a shared file system) write one step
concurrently. `finalize_step` writes the step's `index.json` (trajectory -> shard; with the rollout's attempts,
trajectories of earlier attempts are left out, whole stale shards set aside) under the step's exclusive lock, and
a write that lands after it fails; `apply_retention` keeps the last k steps.

Shard layout (all integers little-endian):
    magic b"TRACEREC" | u32 version | u32 header length H | u32 CRC-32 of header | header JSON (H bytes) | frames
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import struct
import threading
import uuid
import zlib
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zstandard

from trace_core.numerics.formats import get_format
from trace_core.numerics.recipe import DEFAULT_RECIPE
from trace_core.records.layout import TrajectoryRecords
from trace_core.records.spec import Binding, Record, recorded_format
from trace_core.sites import SITE_KINDS, Site, check_site

MAGIC = b"TRACEREC"
VERSION = 2
FRAME_BYTES = 1 << 20  # raw bytes per frame at most (one row at least): the reader's decompression unit
LOCK_NAME = ".lock"
STALE_PREFIX = ".stale-"
FAILED_PREFIX = ".failed-"
PREAMBLE = struct.Struct("<8sIII")  # magic, version, header length, header CRC-32
SHARD_SUFFIX = ".trs"
INDEX_NAME = "index.json"
STEP_PREFIX = "step_"
DEFAULT_LEVEL = 1
ROUTES = "routes"


class StoreError(ValueError):
    """A record store problem that names the step, shard or trajectory involved."""


class CorruptShardError(StoreError):
    """A shard is truncated, fails its checksum or does not decode."""


class MissingRecordError(StoreError, KeyError):
    """A trajectory (or one of its sites) asked for is not in the step."""

    __str__ = ValueError.__str__


RID_SEP = "#"
STEP_SEP = "@"


def rollout_rid(trajectory: str, attempt: str, step: int | None = None) -> str:
    """The request id a rollout client sends a server for one trajectory of one attempt of rollout step `step`
    (`<trajectory>#<attempt>@<step>`; without a step, `<trajectory>#<attempt>`): the server binds the records it writes
    to all three (`parse_rollout_rid`). With a step the records go to that step's directory whatever policy version
    the server holds, so a rollout may run ahead of the trainer (`async_lag`)."""
    for sep in (RID_SEP, STEP_SEP):
        if sep in trajectory or sep in attempt:
            raise ValueError(f"trajectory {trajectory!r} and attempt {attempt!r} must not contain {sep!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"rollout step must be a non-negative int, got {step!r}")
    rid = f"{trajectory}{RID_SEP}{attempt}"
    return rid if step is None else f"{rid}{STEP_SEP}{step}"


def parse_rollout_rid(rid: str) -> tuple[str, str, int | None]:
    """(trajectory, attempt, rollout step or None) of a request id; a plain id is the trajectory with attempt "" and
    no step. A step that is not a non-negative integer is a ValueError naming the id."""
    trajectory, _, rest = rid.partition(RID_SEP)
    attempt, sep, step = rest.partition(STEP_SEP)
    if not sep:
        return trajectory, attempt, None
    if not step.isdecimal():
        raise ValueError(f"request id {rid!r}: rollout step {step!r} after {STEP_SEP!r} is not a non-negative integer")
    return trajectory, attempt, int(step)


def site_key(site: Site) -> str:
    """File-format name of a site: `"<layer>.<kind>"`."""
    layer, kind = check_site(site)
    return f"{layer}.{kind}"


def parse_site(key: str) -> Site:
    """Inverse of `site_key`."""
    layer, _, kind = key.partition(".")
    if not layer.isdigit() or kind not in SITE_KINDS:
        raise ValueError(f"malformed site key {key!r}")
    return int(layer), kind


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """Directory of RL step `step` under the store root."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"RL step must be a non-negative int, got {step!r}")
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def _fields(rec: Record) -> dict[str, torch.Tensor]:
    """The tensors stored for a record; a static (0-d) global scale is stored once per row like a token scale."""
    out = {"low_bits": rec.low_bits, "scales": rec.scales}
    if rec.global_scale is not None:
        out["global_scale"] = rec.global_scale.to(torch.float32).expand(rec.scales.shape[0], 1)
    return out


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename or new file in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_COMPRESSORS = threading.local()
COMPRESS_WORKERS = min(8, os.cpu_count() or 1)
_POOL = ThreadPoolExecutor(max_workers=COMPRESS_WORKERS, thread_name_prefix="trace-zstd")
POOL_MIN_BYTES = 4 * FRAME_BYTES  # shards with less raw data are compressed in the calling thread


def _compress(level: int, raw) -> bytes:
    """zstandard frame with content checksum; one compressor per thread (they are not thread-safe)."""
    cctx = getattr(_COMPRESSORS, "cctx", None)
    if cctx is None or _COMPRESSORS.level != level:
        cctx = _COMPRESSORS.cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
        _COMPRESSORS.level = level
    return cctx.compress(raw)


def _compress_many(level: int, raws: Sequence) -> list[bytes]:
    """`_compress` of each raw frame in order: one thread-pool task."""
    return [_compress(level, raw) for raw in raws]


def _pool_tasks(raws: list, size: int = FRAME_BYTES) -> list[list]:
    """Consecutive runs of the frames of about `size` raw bytes each (a larger frame alone), one pool task per run:
    a shard of many small fields (short requests, every layer's sites) pays one hand-off per run, not per frame."""
    tasks: list[list] = [[]]
    held = 0
    for raw in raws:
        if held >= size:
            tasks.append([])
            held = 0
        tasks[-1].append(raw)
        held += raw.nbytes
    return tasks


def encode_shard(trajectories: Mapping[str, TrajectoryRecords], level: int = DEFAULT_LEVEL) -> list[bytes]:
    """Serialize trajectories into one shard: the preamble plus header, then one zstandard frame per field.

    A field of T rows is cut into frames of `rows` whole rows, at most `FRAME_BYTES` raw bytes each (one row at
    least). Frames carry zstandard's content checksum (XXH64 of the decompressed bytes, verified on every decode);
    the header carries a CRC-32 in the preamble. Frames are compressed on a thread pool (zstandard releases the
    GIL), since one core compresses slower than a disk writes.
    """
    raws: list = []
    entries: list[dict] = []  # header entries of the fields, in payload order
    header: dict = {"version": VERSION, "trajectories": {}}

    def add(tensor: torch.Tensor) -> dict:
        rows = max(1, tensor.shape[0])
        t = tensor.detach() if tensor.requires_grad else tensor
        t = t if t.device.type == "cpu" else t.cpu()
        t = t if t.is_contiguous() else t.contiguous()
        raw = (t if t.dtype == torch.uint8 else t.view(torch.uint8)).numpy().reshape(rows, -1)  # numpy: no dispatch
        per = max(1, FRAME_BYTES // max(1, raw.shape[1]))
        parts = [memoryview(raw[i : i + per].reshape(-1)) for i in range(0, tensor.shape[0], per)]
        raws.append(parts)
        entries.append({"raw": raw.nbytes if tensor.shape[0] else 0, "rows": per})
        return entries[-1]

    for traj, tr in trajectories.items():
        sites = {}
        for site, rec in tr.records.items():
            fields = {name: add(t) for name, t in _fields(rec).items()}
            sites[site_key(site)] = {"fmt": rec.fmt.name, "bits": rec.bits, "n": rec.n, "fields": fields}
        entry: dict = {"num_tokens": tr.num_tokens, "sites": sites}
        if tr.routes is not None:
            entry[ROUTES] = add(tr.routes)
            entry[ROUTES]["shape"] = list(tr.routes.shape[1:])
        if tr.binding is not None:
            entry["binding"] = tr.binding.to_json()
        header["trajectories"][traj] = entry
    flat = [part for parts in raws for part in parts]
    if sum(p.nbytes for p in flat) < POOL_MIN_BYTES:  # a pool's hand-offs cost more than compressing small shards
        frames = [_compress(level, raw) for raw in flat]
    else:
        frames = [f for task in _POOL.map(functools.partial(_compress_many, level), _pool_tasks(flat)) for f in task]
    offset, i = 0, 0
    for entry, parts in zip(entries, raws, strict=True):
        mine = frames[i : i + len(parts)]
        i += len(parts)
        entry["offset"], entry["length"] = offset, sum(map(len, mine))
        entry["frames"] = [[len(f), p.nbytes] for f, p in zip(mine, parts, strict=True)]
        offset += entry["length"]
    header["payload_bytes"] = offset
    head = json.dumps(header, separators=(",", ":")).encode()
    return [PREAMBLE.pack(MAGIC, VERSION, len(head), zlib.crc32(head)) + head, *frames]


def read_header(path: Path) -> dict:
    """Parse and check a shard's header; raise `CorruptShardError` naming the shard on any damage."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            pre = f.read(PREAMBLE.size)
            if len(pre) < PREAMBLE.size:
                raise CorruptShardError(f"shard {path} is truncated: {len(pre)} bytes, no complete preamble")
            magic, version, hlen, hcrc = PREAMBLE.unpack(pre)
            if magic != MAGIC:
                raise CorruptShardError(f"shard {path} is not a TRACE record shard (bad magic {magic!r})")
            if version != VERSION:
                raise CorruptShardError(f"shard {path} has format version {version}, this reader reads {VERSION}")
            head = f.read(hlen)
    except OSError as e:
        raise StoreError(f"cannot read shard {path}: {e}") from e
    if len(head) < hlen:
        raise CorruptShardError(f"shard {path} is truncated inside its header ({len(head)} of {hlen} bytes)")
    if zlib.crc32(head) != hcrc:
        raise CorruptShardError(f"shard {path} header fails its CRC-32 check")
    try:
        header = json.loads(head)
    except ValueError as e:
        raise CorruptShardError(f"shard {path} header does not parse: {e}") from e
    header["data_start"] = PREAMBLE.size + hlen
    if size < header["data_start"] + header["payload_bytes"]:
        raise CorruptShardError(
            f"shard {path} is truncated: {size} bytes, header promises {header['data_start'] + header['payload_bytes']}"
        )
    return header


def _write_tmp(path: Path, chunks: Iterable[bytes]) -> Path:
    """Write `chunks` to a hidden temporary file next to `path` and fsync it; the file is removed on failure."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.writelines(chunks)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write(path: Path, chunks: Iterable[bytes]) -> None:
    """Write `chunks` to `path` through a temporary file, fsync and rename: readers see all of it or nothing."""
    tmp = _write_tmp(path, chunks)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def step_lock(directory: Path, *, exclusive: bool) -> Iterator[None]:
    """The step directory's lock (`flock` on its `.lock` file): writers publish shards under the shared lock,
    `finalize_step` indexes under the exclusive one, so no shard lands between the index and the step's seal."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@dataclass
class WriterStats:
    """What a `StepWriter` wrote: shards, trajectories, raw (uncompressed) and on-disk bytes."""

    shards: int = 0
    trajectories: int = 0
    raw_bytes: int = 0
    disk_bytes: int = 0


@dataclass
class StepWriter:
    """Writes shards of finished trajectories into one step directory; safe to run in many workers at once.

    Shard names are `<writer id>-<sequence>.trs`, with a writer id unique per host, process and writer object, so
    concurrent writers never touch the same file; a shard is never written over an existing one (a repeated writer
    id fails with `StoreError`). Writing a trajectory id twice within a step is caught by the reader's index (it
    names both shards). A shard that would land after `finalize_step` is removed and its write fails.
    """

    root: str | os.PathLike
    step: int
    level: int = DEFAULT_LEVEL
    writer_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    stats: WriterStats = field(default_factory=WriterStats)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.writer_id) or self.writer_id.startswith("."):
            raise ValueError(f"writer_id {self.writer_id!r} must be a plain file-name token")
        self.dir = step_dir(self.root, self.step)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._seq = 0
        self._lock = threading.Lock()

    def write(self, trajectories: Mapping[str | int, TrajectoryRecords]) -> Path:
        """Write one shard holding `trajectories` (id -> records); returns its path."""
        if not trajectories:
            raise ValueError("write() needs at least one trajectory")
        if (self.dir / INDEX_NAME).exists():
            raise StoreError(f"step directory {self.dir} is finalized; no more shards may be added")
        named = {}
        for traj, tr in trajectories.items():
            if not isinstance(tr, TrajectoryRecords):
                raise ValueError(f"trajectory {traj!r}: expected TrajectoryRecords, got {type(tr).__name__}")
            named[str(traj)] = tr
            b = tr.binding
            if b is not None and (b.step != self.step or b.trajectory != str(traj)):
                raise ValueError(f"trajectory {traj!r}: binding {b} does not name step {self.step} and this id")
        if len(named) != len(trajectories):
            raise ValueError("trajectory ids collide once converted to str")
        chunks = encode_shard(named, self.level)
        with self._lock:
            name = f"{self.writer_id}-{self._seq:06d}{SHARD_SUFFIX}"
            self._seq += 1
        path = self.dir / name
        tmp = _write_tmp(path, chunks)
        try:
            with step_lock(self.dir, exclusive=False):
                if (self.dir / INDEX_NAME).exists():
                    raise StoreError(f"step {self.dir} was finalized while shard {name} was written; it is not stored")
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise StoreError(
                        f"shard {path} already exists: writer id {self.writer_id!r} is not unique"
                    ) from None
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.dir)
        with self._lock:
            self.stats.shards += 1
            self.stats.trajectories += len(named)
            self.stats.disk_bytes += sum(len(c) for c in chunks)
            self.stats.raw_bytes += sum(_raw_bytes(tr) for tr in named.values())
        return path


def _raw_bytes(tr: TrajectoryRecords) -> int:
    total = sum(t.numel() * t.element_size() for rec in tr.records.values() for t in _fields(rec).values())
    return total + (tr.routes.numel() * 4 if tr.routes is not None else 0)


def shard_paths(directory: Path) -> list[Path]:
    """Complete shards of a step directory; temporary files of unfinished writes are ignored."""
    return sorted(p for p in directory.glob(f"*{SHARD_SUFFIX}") if not p.name.startswith("."))


def build_index(directory: Path, leave_out: Mapping[str, Collection[str]] | None = None) -> dict[str, str]:
    """Trajectory id -> shard file name, from the shards' headers; a trajectory in two shards is an error.

    `leave_out` (shard file name -> trajectory ids): entries of those shards not indexed, so a trajectory that is
    also (as one of them) in another shard is not an error: `finalize_step`'s stale trajectories of a shard that
    also holds current ones."""
    index: dict[str, str] = {}
    skip = leave_out or {}
    for path in shard_paths(directory):
        for traj in read_header(path)["trajectories"]:
            if traj in skip.get(path.name, ()):
                continue
            if traj in index:
                raise StoreError(f"trajectory {traj!r} of {directory} is in two shards: {index[traj]} and {path.name}")
            index[traj] = path.name
    return index


def shard_attempts(header: dict) -> set[str | None]:
    """Attempt ids of a shard's trajectories (None for an unbound trajectory)."""
    return {(e.get("binding") or {}).get("attempt") for e in header["trajectories"].values()}


def _find_stale(directory: Path, attempts: Mapping[str, str]) -> list[dict]:
    """The shards holding trajectories of earlier rollout attempts (a trajectory's attempt differs from
    `attempts`; one not in `attempts` counts as current if unbound): one entry per shard, `{"shard": name,
    "trajectories": [stale ids], "set_aside": bool}`. A shard all of whose trajectories are stale is set aside
    (renamed to a hidden `.stale-` name readers ignore; "shard" keeps its name before); a shard that also holds
    current trajectories stays where it is (several requests of a transfer share a shard, and one of them may
    have been retried as a new attempt) and only its stale trajectories are left out of the index."""
    stale = []
    for path in shard_paths(directory):
        trajs = read_header(path)["trajectories"]
        old = sorted(t for t, e in trajs.items() if (e.get("binding") or {}).get("attempt") != attempts.get(t))
        if not old:
            continue
        whole = len(old) == len(trajs)
        if whole:
            os.replace(path, directory / f"{STALE_PREFIX}{path.name}")
        stale.append({"shard": path.name, "trajectories": old, "set_aside": whole})
    return stale


def finalize_step(root: str | os.PathLike, step: int, attempts: Mapping[str, str] | None = None) -> Path:
    """Write the step's `index.json` (`"shards"`: trajectory -> shard) once all writers are done; later writes fail.

    With `attempts` (trajectory id -> attempt id of the rollout that counts), trajectories of earlier attempts are
    not indexed: a shard holding only those is set aside, a shard that also holds current ones stays (its stale
    entries are left out of the index, so a retry written in another shard is not a duplicate); each such shard
    is listed under `"stale"` (`_find_stale`; readers read only `"shards"`). Every trajectory of `attempts` must be
    in a shard as its current attempt, and no trajectory may be current in two shards."""
    directory = step_dir(root, step)
    if not directory.is_dir():
        raise StoreError(f"step directory {directory} does not exist")
    path = directory / INDEX_NAME
    with step_lock(directory, exclusive=True):
        if path.exists():
            raise StoreError(f"step {directory} is already finalized")
        stale = [] if attempts is None else _find_stale(directory, attempts)
        index = build_index(directory, {s["shard"]: s["trajectories"] for s in stale if not s["set_aside"]})
        if attempts is not None:
            missing = sorted(set(attempts) - set(index))
            if missing:
                raise StoreError(f"step {directory}: no shard of the current attempt holds trajectories {missing}")
        atomic_write(path, [json.dumps({"version": VERSION, "shards": index, "stale": stale}).encode()])
    return path


def write_failure(root: str | os.PathLike, step: int, trajectory: str, attempt: str, message: str) -> Path:
    """Record in step `step` that the records of (`trajectory`, `attempt`) will not come (a server answered but
    could not store them), with `message`; a waiting client (`StepWatcher.failed`) and the reader report it."""
    directory = step_dir(root, step)
    directory.mkdir(parents=True, exist_ok=True)
    key = hashlib.blake2b(f"{trajectory}\0{attempt}".encode(), digest_size=8).hexdigest()
    path = directory / f"{FAILED_PREFIX}{key}.json"
    atomic_write(path, [json.dumps({"trajectory": trajectory, "attempt": attempt, "message": message}).encode()])
    return path


def read_failures(directory: Path, skip: Collection[str] = frozenset()) -> dict[tuple[str, str], tuple[str, str]]:
    """(trajectory, attempt) -> (marker file name, message) of the failure markers of a step directory, less the
    files named in `skip`."""
    out = {}
    for path in sorted(directory.glob(f"{FAILED_PREFIX}*.json")):
        if path.name in skip:
            continue
        try:
            marker = json.loads(path.read_bytes())
            out[(marker["trajectory"], marker["attempt"])] = (path.name, marker["message"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"failure marker {path} does not parse: {e}") from e
    return out


class StepWatcher:
    """What a step directory being written holds, read incrementally: every complete shard's header is read once,
    so waiting for records costs a directory listing per look, not a header read per shard (`headers_read`)."""

    def __init__(self, root: str | os.PathLike, step: int) -> None:
        self.dir = step_dir(root, step)
        self.seen: set[str] = set()
        self.found: dict[str, list[tuple[str, Binding | None]]] = {}  # trajectory -> [(shard, binding)]
        self.failed: dict[tuple[str, str], str] = {}  # (trajectory, attempt) -> message of a failure marker
        self.headers_read = 0
        self._markers: set[str] = set()

    def refresh(self) -> dict[str, list[tuple[str, Binding | None]]]:
        """Read the headers of shards not seen before; returns trajectory -> [(shard, binding), ...]."""
        if not self.dir.is_dir():
            return self.found
        for key, (name, message) in read_failures(self.dir, self._markers).items():
            self._markers.add(name)
            self.failed[key] = message
        for path in shard_paths(self.dir):
            if path.name in self.seen:
                continue
            header = read_header(path)
            self.headers_read += 1
            self.seen.add(path.name)
            for traj, entry in header["trajectories"].items():
                b = entry.get("binding")
                self.found.setdefault(traj, []).append((path.name, None if b is None else Binding.from_json(b)))
        return self.found


def list_steps(root: str | os.PathLike) -> list[int]:
    """RL steps present under the store root, oldest first."""
    pattern = re.compile(rf"{STEP_PREFIX}(\d+)")
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := pattern.fullmatch(p.name)))


def apply_retention(root: str | os.PathLike, keep_last: int, protect: Iterable[int] = ()) -> list[int]:
    """Delete all but the newest `keep_last` steps (and never those in `protect`); returns the deleted steps."""
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    steps = list_steps(root)
    keep = set(steps[-keep_last:]) | set(protect)
    removed = [s for s in steps if s not in keep]
    for s in removed:
        shutil.rmtree(step_dir(root, s))
    return removed


def check_format(name: str, where: str) -> None:
    """Raise `CorruptShardError` if a shard names an unknown format."""
    try:
        get_format(name)
    except ValueError as e:
        raise CorruptShardError(f"{where}: {e}") from e


def check_site_recipe(site: Site, fmt: str, binding: Mapping | None, where: str) -> None:
    """Raise `CorruptShardError` naming the `fmt` field unless a bound trajectory's record of `site` is in the
    format its binding's recipe records that site kind in (the record spec derives it from the recipe,
    `RecordSpec.moe_format` / `kv_format`); an unbound trajectory names no recipe and is not checked."""
    if binding is None:
        return
    recipe = binding.get("recipe", DEFAULT_RECIPE)
    try:
        want = recorded_format(recipe, site[1])
    except ValueError as e:
        raise CorruptShardError(f"{where}: bad binding recipe ({e})") from e
    if fmt != want:
        records = f"records it as {want!r}" if want is not None else "records no such site"
        raise CorruptShardError(f"{where}: fmt {fmt!r} disagrees with the binding's recipe {recipe!r}, which {records}")
