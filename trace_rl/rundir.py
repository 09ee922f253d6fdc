"""A run directory's exclusive lock and its checkpoints (fsynced, checksummed, the last two kept).

`RunLock` takes an exclusive `flock` on the run directory itself (and on `<out_dir>/.lock`) for the controller's
lifetime and writes who holds it (host, pid, start time) into `.lock`; a second controller on the same directory is
refused with that holder. Deleting `.lock` does not free the directory; `RunLock.check` (every step) stops a
controller whose directory was moved or replaced. The kernel drops the lock when the holder exits, SIGKILL
included, so a crashed run never leaves a stale lock. `fresh_start` deletes the old run's checkpoints under a marker
written first, so a crash midway cannot leave one a resume would take; `remove_stale_temps` removes what a killed
controller left between a write and its rename.

Checkpoint files are `checkpoint-<step>.pt`: a preamble (magic, payload length, SHA-256 of the payload) and the
`torch.save` payload, written to a temporary file, fsynced, renamed into place, the directory fsynced; the newest
`KEEP` are kept. `load_latest` verifies them newest first and returns the first intact one; damaged newer ones are
then renamed to `<name>.corrupt` and reported, so the run resumes from the previous checkpoint (when none is intact,
it raises and renames nothing).

The trainer's tensors are not in that file: they are a Megatron distributed checkpoint (`megatron_trace.checkpoint`,
loadable at any parallel layout) in the directory `checkpoint-<step>.dist`, written by every trainer rank into
`.checkpoint-<step>.dist.tmp`, then fsynced and renamed into place (`seal_sharded`) before the file that names it is
written. The file holds the SHA-256 of the directory's `integrity.json` (Megatron's SHA-256 of every file in it);
`read_checkpoint` checks both, so a damaged or missing shard makes the checkpoint damaged like a bad file. A
directory goes with its file (retention, `remove_checkpoint`); one that no file names (a crash between the two) is
removed at the next save.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import socket
import struct
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

from trace_core.records.store import atomic_write, fsync_dir

MAGIC = b"TRACECKP"
PREAMBLE = struct.Struct("<8sQ32s")  # magic, payload length, SHA-256 of the payload
KEEP = 2
LOCK = ".lock"
_NAME = re.compile(r"checkpoint-(\d{8})\.pt")
_SHARDED = re.compile(r"\.?checkpoint-(\d{8})\.dist(\.tmp)?")
INTEGRITY = "integrity.json"  # Megatron's manifest of a distributed checkpoint
FRESH_START = ".fresh-start"  # present while a fresh start deletes the old run's checkpoints
# Temporaries of `trace_core.records.store.atomic_write` (checkpoint files, the fresh-start marker) and unsealed trainer
# dirs.
_TEMP = re.compile(r"\.(checkpoint-\d{8}\.pt|\.fresh-start)\.[0-9a-f]{32}\.tmp|\.checkpoint-\d{8}\.dist\.tmp")


class RunLockedError(RuntimeError):
    """Another controller holds the run directory."""


class RunDirError(RuntimeError):
    """The run directory cannot be used (not creatable, not writable); the message names the absolute path."""


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


class RunLock:
    """Exclusive lock on a run directory (see the module docstring): `flock` on the directory itself, which deleting
    `.lock` cannot defeat, and on `.lock` (which names the holder). `check` refuses to go on when the directory
    at the path is no longer the one locked (it was moved away or replaced)."""

    def __init__(self, out: Path) -> None:
        self._fds: list[int] = []  # closed by `release`, or by the finalizer (safe at interpreter exit)
        self._finalizer = weakref.finalize(self, _close_all, self._fds)
        self.path = out = Path(os.path.abspath(out))
        try:
            out.mkdir(parents=True, exist_ok=True)
            self._fds.append(os.open(out, os.O_RDONLY | os.O_DIRECTORY))
        except OSError as e:
            raise RunDirError(f"run directory {out} cannot be created or opened: {e.strerror}") from None
        try:
            fcntl.flock(self._fds[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise RunLockedError(f"run directory {out} is in use by another controller: {self._holder()}") from None
        self._identity = _identity(os.fstat(self._fds[0]))
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": now}).encode()
        try:
            fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            self.release()
            raise RunDirError(f"run directory {out}: cannot create {out / LOCK}: {e.strerror}") from None
        self._fds.append(fd)
        try:  # a controller of an earlier version locks only this file
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
            raise RunLockedError(f"run directory {out} is in use by another controller: {self._holder()}") from None
        self._write_holder(fd)

    def _holder(self) -> str:
        try:
            text = (self.path / LOCK).read_bytes().decode(errors="replace").strip()
        except FileNotFoundError:
            return f"unknown ({self.path / LOCK}, which names the holder, was deleted)"
        return text or "unknown (no holder written yet)"

    def _write_holder(self, fd: int) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, self.holder, 0)
        os.fsync(fd)

    def check(self) -> None:
        """`RunLockedError` unless the directory at the path is still the locked one; a deleted `.lock` is written
        again (the lock itself is on the directory)."""
        try:
            here = _identity(os.stat(self.path))
        except FileNotFoundError:
            here = None
        if here != self._identity:
            raise RunLockedError(
                f"run directory {self.path} was moved or replaced while this controller held it; stopping so that "
                "two controllers never train into one directory"
            )
        if not (self.path / LOCK).exists():
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                self._write_holder(fd)
            finally:
                os.close(fd)

    def release(self) -> None:
        self._finalizer()


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


class CorruptCheckpointError(ValueError):
    """A checkpoint file is truncated, fails its checksum or does not load."""


@dataclass(frozen=True)
class Loaded:
    """The checkpoint `load_latest` resumes from, and the damaged newer ones it set aside (path, reason)."""

    state: dict
    path: Path
    rejected: list[tuple[Path, str]]


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoint files of a run directory, oldest first."""
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _NAME.fullmatch(p.name))]
    return sorted(found)


def sharded_dir(out: Path, step: int, *, tmp: bool = False) -> Path:
    """The trainer's distributed checkpoint directory of step `step` (`tmp`: where the ranks write it first)."""
    return out / (f".checkpoint-{step:08d}.dist.tmp" if tmp else f"checkpoint-{step:08d}.dist")


def seal_sharded(out: Path, step: int) -> dict:
    """Make the written `sharded_dir(tmp=True)` durable (every file and the directory fsynced) and rename it into
    place; returns what the checkpoint file records of it."""
    tmp, final = sharded_dir(out, step, tmp=True), sharded_dir(out, step)
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    fsync_dir(tmp)
    if final.exists():  # left by a run that crashed before its checkpoint file was written
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(out)
    return {"dir": final.name, "integrity_sha256": hashlib.sha256((final / INTEGRITY).read_bytes()).hexdigest()}


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file and the trainer directory it names."""
    path.unlink(missing_ok=True)
    shutil.rmtree(path.with_name(path.name.removesuffix(".pt") + ".dist"), ignore_errors=True)


def fresh_start(out: Path) -> bool:
    """Delete the run directory's checkpoints so that a later resume cannot find the old run: the marker
    `FRESH_START` is written (fsynced) first and removed last, so a crash between two deletions leaves the marker,
    and the next start (`fresh_start_pending`) finishes the fresh start instead of resuming what is left. Returns
    whether anything was deleted."""
    found = checkpoints(out)
    if not found and not fresh_start_pending(out):
        return False
    atomic_write(out / FRESH_START, [b"a fresh start is deleting this directory's checkpoints\n"])
    for _, path in found:
        remove_checkpoint(path)
    for d in out.iterdir():
        if _SHARDED.fullmatch(d.name) and d.is_dir():
            shutil.rmtree(d)
    (out / FRESH_START).unlink()
    fsync_dir(out)
    return True


def fresh_start_pending(out: Path) -> bool:
    """Whether a fresh start was interrupted (its marker is there): the directory's checkpoints must not be resumed."""
    return (out / FRESH_START).exists()


def remove_stale_temps(out: Path) -> list[Path]:
    """Remove the temporary files and directories a killed controller of this run directory left (checkpoint files
    between their write and rename, trainer directories before their seal); call it holding the `RunLock`."""
    stale = [p for p in out.iterdir() if _TEMP.fullmatch(p.name)] if out.is_dir() else []
    for p in stale:
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()
    return stale


def save_checkpoint(out: Path, step: int, state: dict) -> Path:
    """Write `state` as `checkpoint-<step>.pt` (fsync + SHA-256, atomic), then keep only the newest `KEEP` (with
    their trainer directories; directories no kept file names go too)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    path = out / f"checkpoint-{step:08d}.pt"
    atomic_write(path, [PREAMBLE.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()), payload])
    for _, old in checkpoints(out)[:-KEEP]:
        remove_checkpoint(old)
    kept = {s for s, _ in checkpoints(out)}
    for d in out.iterdir():
        m = _SHARDED.fullmatch(d.name)
        if m and d.is_dir() and (m.group(2) or int(m.group(1)) not in kept):
            shutil.rmtree(d)
    return path


def _check_sharded(path: Path, sharded: dict) -> None:
    """The trainer directory a checkpoint file names: its manifest's SHA-256, then every file against it."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    d = path.parent / sharded["dir"]
    try:
        digest = hashlib.sha256((d / INTEGRITY).read_bytes()).hexdigest()
    except OSError as e:
        raise CorruptCheckpointError(f"checkpoint {path}: trainer directory {d} unreadable ({e})") from e
    if digest != sharded["integrity_sha256"]:
        raise CorruptCheckpointError(f"checkpoint {path}: {d / INTEGRITY} fails its SHA-256 check")
    try:
        verify_integrity_manifest(str(d))
    except CheckpointingException as e:
        raise CorruptCheckpointError(f"checkpoint {path}: trainer directory {d} is damaged: {e}") from e


def read_checkpoint(path: Path) -> dict:
    """Load and verify one checkpoint file; `CorruptCheckpointError` names it and what is wrong."""
    data = path.read_bytes()
    if len(data) < PREAMBLE.size:
        raise CorruptCheckpointError(f"checkpoint {path} is truncated ({len(data)} bytes, no preamble)")
    magic, length, digest = PREAMBLE.unpack_from(data)
    payload = memoryview(data)[PREAMBLE.size :]
    if magic != MAGIC:
        raise CorruptCheckpointError(f"checkpoint {path} is not a TRACE checkpoint (bad magic {magic!r})")
    if len(payload) != length:
        raise CorruptCheckpointError(f"checkpoint {path} is truncated ({len(payload)} of {length} payload bytes)")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpointError(f"checkpoint {path} fails its SHA-256 check")
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:
        raise CorruptCheckpointError(f"checkpoint {path} does not load: {e}") from e
    if "sharded" in state:
        _check_sharded(path, state["sharded"])
    return state


def load_latest(out: Path) -> Loaded | None:
    """The newest intact checkpoint (None when there is none); damaged newer ones are renamed `<name>.corrupt`."""
    rejected = []
    for _, path in reversed(checkpoints(out)):
        try:
            state = read_checkpoint(path)
        except CorruptCheckpointError as e:
            rejected.append((path, str(e)))
            continue
        for bad, _ in rejected:
            os.replace(bad, bad.with_name(bad.name + ".corrupt"))
        return Loaded(state, path, rejected)
    if rejected:
        raise CorruptCheckpointError("no intact checkpoint: " + "; ".join(reason for _, reason in rejected))
    return None
