"""A consistent copy of a run directory's newest intact checkpoint, taken without the run's lock, so that
`trace-rl export` can read a live run: the checkpoint file and its trainer directory are hard-linked (copied where a
link fails, e.g. across file systems) into a directory of the caller's, then verified there
(`trace_rl.rundir.read_checkpoint`). A run writes each checkpoint file once and renames it into place, so the links
hold exactly the bytes that were checksummed, and retention deleting the checkpoint afterwards removes only the
run's names for them. A checkpoint that retention removes while it is being linked, or that fails its checks, is
skipped for the next one; nothing in the run directory is changed (unlike `load_latest`, which renames damaged
checkpoints of the run it resumes)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from trace_rl.rundir import CorruptCheckpointError, checkpoints, read_checkpoint


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links refused: a copy (as consistent: the file is never rewritten)
        shutil.copy2(src, dst)


def snapshot_latest(run_dir: Path, into: Path, attempts: int = 5) -> tuple[dict, Path]:
    """(state, path) of the newest intact checkpoint of `run_dir`, its file and trainer directory linked under
    `into` (an empty directory); `FileNotFoundError` when the run has none, `CorruptCheckpointError` when none is
    intact."""
    rejected: list[str] = []
    for attempt in range(attempts):
        found = checkpoints(run_dir)
        if not found:
            raise FileNotFoundError(f"{run_dir} holds no checkpoint (checkpoint-<step>.pt)")
        raced = False
        for _, path in reversed(found):
            snap = into / str(attempt) / path.stem
            snap.mkdir(parents=True)
            dist = path.with_name(path.stem + ".dist")
            try:
                _link(str(path), str(snap / path.name))
                shutil.copytree(dist, snap / dist.name, copy_function=_link)
            except FileNotFoundError as e:
                if not path.exists():  # retention removed it meanwhile: a newer one exists, list again
                    raced = True
                    break
                rejected.append(f"checkpoint {path}: {e.filename} is missing")
                continue
            try:
                return read_checkpoint(snap / path.name), snap / path.name
            except CorruptCheckpointError as e:
                rejected.append(str(e))
        if not raced:
            break
    raise CorruptCheckpointError(f"no intact checkpoint in {run_dir}: " + "; ".join(rejected or ["it kept changing"]))
