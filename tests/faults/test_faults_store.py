"""Fault injection, record store (docs/reliability.md items 1, 4 and 7): records bound to what produced them,
writer ids that cannot replace another writer's shard, a write racing `finalize_step` (a real writer process
stopped at a chosen point), memory bounded by frames of bounded size, and a step index whose shards are not a map
is corrupt by name."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch

from tests.core.test_store import assert_rows, trajectory
from trace_core.numerics.formats import get_format
from trace_core.numerics.quant import quantize
from trace_core.records.layout import TrajectoryRecords
from trace_core.records.reader import BindingMismatchError, CorruptShardError, RecordReader
from trace_core.records.spec import Binding, Record, token_digest
from trace_core.records.store import (
    FRAME_BYTES,
    INDEX_NAME,
    StepWriter,
    StoreError,
    finalize_step,
    shard_paths,
    step_dir,
)

pytestmark = pytest.mark.faults
REPO = Path(__file__).resolve().parents[2]


def bound(seed: int, rows: int, binding: Binding) -> TrajectoryRecords:
    tr = trajectory(seed, rows)
    return TrajectoryRecords(tr.num_tokens, tr.records, tr.routes, binding)


def test_a_binding_mismatch_is_refused_by_name(tmp_path):
    tokens = torch.arange(6)
    want = Binding(3, 2, "7", "attempt-b", token_digest(tokens))
    StepWriter(tmp_path, 3).write({"7": bound(1, 5, want), "8": trajectory(2, 5)})
    reader = RecordReader(tmp_path, 3)
    reader.check_bindings({"7": want})
    other = Binding(3, 1, "7", "attempt-a", token_digest(tokens.flip(0)))
    with pytest.raises(BindingMismatchError, match=r"trajectory '7' .*policy_version 2 != expected 1.*attempt.*tokens"):
        reader.check_bindings({"7": other})
    with pytest.raises(BindingMismatchError, match="trajectory '8' .* has no binding"):
        reader.check_bindings({"8": want})
    with pytest.raises(ValueError, match="does not name step 4"):
        StepWriter(tmp_path, 4).write({"7": bound(1, 5, want)})


def test_a_repeated_writer_id_cannot_replace_a_shard(tmp_path):
    first = StepWriter(tmp_path, 0, writer_id="request0").write({"0": trajectory(1, 4)})
    with pytest.raises(StoreError, match="already exists: writer id 'request0' is not unique"):
        StepWriter(tmp_path, 0, writer_id="request0").write({"1": trajectory(2, 4)})
    assert RecordReader(tmp_path, 0).trajectories() == ["0"] and shard_paths(first.parent) == [first]
    assert not [p for p in first.parent.iterdir() if p.name.endswith(".tmp")]


WRITER = """
import os, signal, sys
import trace_core.records.store as store
from tests.core.test_store import trajectory
real_fsync = os.fsync
def fsync_then_stop(fd):  # the chosen point: the shard's bytes are on disk under its temporary name
    real_fsync(fd)
    if os.readlink(f"/proc/self/fd/{{fd}}").endswith(".tmp"):
        os.kill(os.getpid(), signal.SIGSTOP)
store.os.fsync = fsync_then_stop
try:
    store.StepWriter({root!r}, 0).write({{"late": trajectory(3, 512)}})
except store.StoreError as e:
    print(e)
    sys.exit(4)
"""


def test_a_write_racing_finalize_fails_and_leaves_nothing(tmp_path):
    StepWriter(tmp_path, 0).write({"early": trajectory(1, 4)})
    code = WRITER.format(root=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)  # the writer stops itself with its shard written
        assert os.WIFSTOPPED(status), status
        finalize_step(tmp_path, 0)
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 4 and "was finalized while shard" in out
    directory = step_dir(tmp_path, 0)
    assert RecordReader(tmp_path, 0).trajectories() == ["early"]
    assert [p.name for p in shard_paths(directory)] == [RecordReader(tmp_path, 0).index["early"]]
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")] and (directory / INDEX_NAME).exists()
    with pytest.raises(StoreError, match="is already finalized"):
        finalize_step(tmp_path, 0)


def b(traj: str, attempt: str, step: int = 0) -> Binding:
    return Binding(step, 0, traj, attempt, "d")


def test_finalize_sets_aside_earlier_attempts_and_refuses_a_gap(tmp_path):
    StepWriter(tmp_path, 0).write({"x": bound(1, 3, b("x", "old")), "y": bound(2, 3, b("y", "new"))})
    with pytest.raises(StoreError, match=r"no shard of the current attempt holds trajectories \['x'\]"):
        finalize_step(tmp_path, 0, attempts={"x": "new", "y": "new"})  # x's stale entry is not indexed: a gap
    StepWriter(tmp_path, 1).write({"x": bound(1, 3, b("x", "old", 1))})
    StepWriter(tmp_path, 1).write({"x": bound(1, 3, b("x", "new", 1))})
    with pytest.raises(StoreError, match=r"no shard of the current attempt holds trajectories \['y'\]"):
        finalize_step(tmp_path, 1, attempts={"x": "new", "y": "new"})
    StepWriter(tmp_path, 2).write({"x": bound(1, 3, b("x", "old", 2))})
    StepWriter(tmp_path, 2).write({"x": bound(1, 3, b("x", "new", 2))})
    index = finalize_step(tmp_path, 2, attempts={"x": "new"})
    reader = RecordReader(tmp_path, 2)
    assert reader.binding("x").attempt == "new"
    (aside,) = [p.name for p in step_dir(tmp_path, 2).iterdir() if p.name.startswith(".stale-")]
    (stale,) = json.loads(index.read_bytes())["stale"]
    assert stale == {"shard": aside.removeprefix(".stale-"), "trajectories": ["x"], "set_aside": True}
    StepWriter(tmp_path, 3).write({"x": bound(1, 3, b("x", "new", 3))})
    StepWriter(tmp_path, 3).write({"x": bound(1, 3, b("x", "new", 3)), "y": bound(2, 3, b("y", "new", 3))})
    with pytest.raises(StoreError, match="trajectory 'x' of .* is in two shards"):
        finalize_step(tmp_path, 3, attempts={"x": "new", "y": "new"})  # current in two shards: still an error


def recipe_bound(seed: int, rows: int, binding: Binding) -> TrajectoryRecords:
    """A bound trajectory whose records are in the formats its binding's (default) recipe records: MoE input in
    nvfp4 (per-token global scale), K and V in kv_fp4, and routes, so that the reader loads it."""
    gen = torch.Generator().manual_seed(seed)
    records = {}
    for site, fmt, kw in (
        ((1, "moe_in"), "nvfp4", {"per_token": True}),
        ((2, "k"), "kv_fp4", {}),
        ((2, "v"), "kv_fp4", {}),
    ):
        records[site] = Record.from_quantized(quantize(torch.randn(rows, 64, generator=gen), fmt, **kw), 1)
    routes = torch.randint(0, 64, (rows, 4, 2), generator=gen, dtype=torch.int32)
    return TrajectoryRecords(rows, records, routes, binding)


def test_finalize_keeps_a_shard_mixing_attempts_and_indexes_the_retry(tmp_path):
    """Several requests of one transfer share a shard; one of them (x) was retried as a new attempt, written in a
    later shard. The mixed shard stays: its current trajectory (y) is indexed there, its stale entry of x is left
    out of the index (listed under "stale", which readers do not read), and the reader returns the retry's
    records of x, bit for bit."""
    first = {
        "x": recipe_bound(1, 3, b("x", "old")),
        "y": recipe_bound(2, 5, b("y", "new")),
        "z": recipe_bound(3, 2, b("z", "new")),
    }
    mixed = StepWriter(tmp_path, 0).write(first)
    retry = recipe_bound(4, 6, b("x", "new"))
    again = StepWriter(tmp_path, 0).write({"x": retry})
    with pytest.raises(StoreError, match="trajectory 'x' of .* is in two shards"):
        RecordReader(tmp_path, 0)  # unfinalized, no attempts known: x is in two shards
    index = finalize_step(tmp_path, 0, attempts={"x": "new", "y": "new", "z": "new"})
    written = json.loads(index.read_bytes())
    assert written["shards"] == {"x": again.name, "y": mixed.name, "z": mixed.name}
    assert written["stale"] == [{"shard": mixed.name, "trajectories": ["x"], "set_aside": False}]
    directory = step_dir(tmp_path, 0)
    assert shard_paths(directory) == sorted([mixed, again])
    assert not [p for p in directory.iterdir() if p.name.startswith(".stale-")]
    reader = RecordReader(tmp_path, 0)
    assert reader.trajectories() == ["x", "y", "z"] and reader.binding("x") == b("x", "new")
    mb = reader.load([("x", 0, 6), ("y", 0, 5), ("z", 0, 2)])
    for i, tr in enumerate((retry, first["y"], first["z"])):
        assert_rows(mb, i, tr, 0, tr.num_tokens)
    assert not torch.equal(mb.records[(1, "moe_in")].low_bits[0, :3], first["x"].records[(1, "moe_in")].low_bits)
    assert reader.verify() > 0  # every indexed frame checks; the stale entry of x is not read


def long_trajectory(rows: int, width: int) -> TrajectoryRecords:
    """Random record bytes of one nvfp4 site `width` wide at 4 bits, and routes: 4 + ... bytes a row."""
    gen = torch.Generator().manual_seed(0)
    fmt = get_format("nvfp4")
    rec = Record(
        fmt,
        4,
        width,
        torch.randint(0, 256, (rows, width // 2), generator=gen, dtype=torch.uint8),
        torch.randint(0, 256, (rows, width // fmt.block), generator=gen, dtype=torch.uint8),
        torch.rand(rows, 1, generator=gen),
    )
    routes = torch.randint(0, 64, (rows, 4, 2), generator=gen, dtype=torch.int32)
    return TrajectoryRecords(rows, {(0, "moe_in"): rec}, routes)


def test_reading_a_few_rows_of_a_long_trajectory_decompresses_a_bounded_amount(tmp_path):
    tr = long_trajectory(8192, 2048)  # low bits: 8 MiB in 8 frames; the case is 396 MB for 8 MB of rows
    StepWriter(tmp_path, 0).write({"long": tr})
    rec = tr.records[(0, "moe_in")]
    reader = RecordReader(tmp_path, 0, cache_bytes=FRAME_BYTES)
    tracemalloc.start()
    try:
        mb = reader.load([("long", 5000, 5016)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reader.stats.raw_bytes <= 4 * FRAME_BYTES < rec.low_bits.numel()  # one frame per field
    assert peak < 4 * FRAME_BYTES  # the cache bound, one frame read and decoded (random bytes: incompressible)
    assert torch.equal(mb.records[(0, "moe_in")].low_bits[0], rec.low_bits[5000:5016])
    assert torch.equal(mb.records[(0, "moe_in")].global_scale[0], rec.global_scale[5000:5016])
    assert torch.equal(mb.routes[0], tr.routes[5000:5016])
    full = reader.load([("long", 0, 8192)])
    assert torch.equal(full.records[(0, "moe_in")].scales[0], rec.scales)
    assert reader.verify() > 4  # more frames than fields: each long field was cut


@pytest.mark.parametrize("shards", [[], ["shard"], {"0": 3}, None])
def test_a_step_index_whose_shards_are_not_a_map_is_corrupt_by_name(tmp_path, shards):
    StepWriter(tmp_path, 0).write({"0": trajectory(1, 4)})
    index = finalize_step(tmp_path, 0)
    index.write_text(json.dumps({"shards": shards, "stale": []}))
    with pytest.raises(CorruptShardError, match=f"step index {index}: 'shards' must map trajectory ids to shard names"):
        RecordReader(tmp_path, 0)
