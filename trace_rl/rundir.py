"""A run directory's exclusive lock and its checkpoints (fsynced, checksummed, the last two kept).

`RunLock` takes an exclusive `flock` on `<out_dir>/.lock` for the controller's lifetime and writes who holds it
(host, pid, start time) into the file; a second controller on the same directory is refused with that holder. The
kernel drops the lock when the holder exits, SIGKILL included, so a crashed run never leaves a stale lock.

Checkpoint files are `checkpoint-<step>.pt`: a preamble (magic, payload length, SHA-256 of the payload) and the
`torch.save` payload, written to a temporary file, fsynced, renamed into place, the directory fsynced; the newest
`KEEP` are kept. `load_latest` verifies them newest first and returns the first intact one; damaged newer ones are
then renamed to `<name>.corrupt` and reported, so the run resumes from the previous checkpoint (when none is intact,
it raises and renames nothing).
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import io
import json
import os
import re
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from trace_core.store import atomic_write

MAGIC = b"TRACECKP"
PREAMBLE = struct.Struct("<8sQ32s")  # magic, payload length, SHA-256 of the payload
KEEP = 2
LOCK = ".lock"
_NAME = re.compile(r"checkpoint-(\d{8})\.pt")


class RunLockedError(RuntimeError):
    """Another controller holds the run directory."""


class RunLock:
    """Exclusive lock on a run directory (see the module docstring)."""

    def __init__(self, out: Path) -> None:
        self.fd: int | None = None
        out.mkdir(parents=True, exist_ok=True)
        path = out / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown (no holder written yet)"
            os.close(fd)
            raise RunLockedError(f"run directory {out} is in use by another controller: {holder}") from None
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        holder = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": now}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder, 0)
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __del__(self) -> None:
        self.release()


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


def save_checkpoint(out: Path, step: int, state: dict) -> Path:
    """Write `state` as `checkpoint-<step>.pt` (fsync + SHA-256, atomic), then keep only the newest `KEEP`."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getbuffer()
    path = out / f"checkpoint-{step:08d}.pt"
    atomic_write(path, [PREAMBLE.pack(MAGIC, len(payload), hashlib.sha256(payload).digest()), payload])
    for _, old in checkpoints(out)[:-KEEP]:
        old.unlink()
    return path


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
        return torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:
        raise CorruptCheckpointError(f"checkpoint {path} does not load: {e}") from e


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
