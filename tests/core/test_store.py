"""Record store with real files and real zstandard: round trips, failure policy, concurrency, crash safety."""

import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.numerics.formats import format_names, get_format
from trace_core.numerics.guided import GuidanceStats, guided_round
from trace_core.numerics.quant import dequantize, quantize
from trace_core.records.capture import RecordCapturer
from trace_core.records.layout import TrajectoryRecords, site_layout
from trace_core.records.reader import RecordReader
from trace_core.records.spec import ModelShape, Record, RecordSpec
from trace_core.records.store import (
    CorruptShardError,
    MissingRecordError,
    StepWriter,
    StoreError,
    apply_retention,
    finalize_step,
    list_steps,
    parse_rollout_rid,
    read_header,
    rollout_rid,
    shard_paths,
    step_dir,
)

SHAPE = ModelShape(hidden=64, num_kv_heads=2, head_dim=32)
REPO = Path(__file__).resolve().parents[2]


def one_format_layout(fmt: str, bits: int) -> dict:
    """MoE input at layers 1 and 3, K and V at layer 2, all in `fmt`: the store writes and reads records of any
    format, whichever a recipe (and so a `RecordSpec`) records."""
    kv = SHAPE.num_kv_heads * SHAPE.head_dim
    return {(1, "moe_in"): (fmt, bits, SHAPE.hidden), (3, "moe_in"): (fmt, bits, SHAPE.hidden)} | {
        (2, kind): (fmt, bits, kv) for kind in ("k", "v")
    }


def trajectory(seed: int, num_tokens: int, fmt: str = "nvfp4", bits: int = 1, routes: bool = True):
    """Records of a synthetic trajectory, quantized by the reference quantizer."""
    gen = torch.Generator().manual_seed(seed)
    records = {}
    for site, (fmt_name, b, n) in one_format_layout(fmt, bits).items():
        x = torch.randn(num_tokens, n, generator=gen) * (1 + seed % 3)
        f = get_format(fmt_name)
        q = quantize(x, f, **({"per_token": True} if f.has_global_scale else {}))
        records[site] = Record.from_quantized(q, b)
    r = torch.randint(0, 64, (num_tokens, 4, 2), generator=gen, dtype=torch.int32) if routes else None
    return TrajectoryRecords(num_tokens, records, r)


def assert_rows(mb, i, tr: TrajectoryRecords, start: int, end: int) -> None:
    """Row i of a loaded micro-batch holds positions [start, end) of `tr`, then padding."""
    rows = end - start
    for site, rec in tr.records.items():
        got = mb.records[site]
        assert torch.equal(got.low_bits[i, :rows], rec.low_bits[start:end])
        assert torch.equal(got.scales[i, :rows], rec.scales[start:end])
        assert not got.low_bits[i, rows:].any() and not got.scales[i, rows:].any()
        if rec.global_scale is not None:
            assert torch.equal(got.global_scale[i, :rows], rec.global_scale[start:end])
            assert (got.global_scale[i, rows:] == 1).all()
        mask = mb.has_record[site][i]
        assert mask[:rows].all() and not mask[rows:].any()
    if tr.routes is not None:
        assert torch.equal(mb.routes[i, :rows], tr.routes[start:end]) and mb.has_routes[i, :rows].all()


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("fmt", format_names())
def test_round_trip_every_format_and_bits(tmp_path, fmt, bits):
    trs = {f"t{i}": trajectory(i, 5 + 3 * i, fmt, bits) for i in range(3)}
    writer = StepWriter(tmp_path, 2)
    writer.write({"t0": trs["t0"]})
    writer.write({"t1": trs["t1"], "t2": trs["t2"]})  # a shard may group trajectories
    reader = RecordReader(tmp_path, 2)
    assert reader.trajectories() == ["t0", "t1", "t2"]
    mb = reader.load([("t2", 3, 11), ("t0", 0, 5), ("t1", 2, 2)], pad_to=12)
    assert mb.records[(1, "moe_in")].low_bits.shape == (3, 12, 8 * bits)
    assert mb.records[(2, "k")].fmt is get_format(fmt) and mb.records[(2, "v")].bits == bits
    assert_rows(mb, 0, trs["t2"], 3, 11)
    assert_rows(mb, 1, trs["t0"], 0, 5)
    assert_rows(mb, 2, trs["t1"], 2, 2)
    assert torch.equal(mb.records[(3, "moe_in")].code_bits()[1, :5], trs["t0"].records[(3, "moe_in")].code_bits())
    assert reader.stats.rows == 4 * (8 + 5) and reader.stats.fallback_rows == 0
    assert writer.stats.trajectories == 3 and writer.stats.shards == 2


def test_missing_trajectory_is_an_error_or_a_counted_rtn_fallback(tmp_path):
    StepWriter(tmp_path, 0).write({"a": trajectory(1, 6)})
    with pytest.raises(MissingRecordError, match="trajectory 'b' has no records in .*step_00000000"):
        RecordReader(tmp_path, 0).load([("a", 0, 6), ("b", 0, 4)])
    reader = RecordReader(tmp_path, 0, missing="rtn")
    mb = reader.load([("a", 0, 6), ("b", 0, 4)])
    for mask in mb.has_record.values():
        assert mask[0].all() and not mask[1].any()
    assert not mb.has_routes[1].any()
    assert reader.stats.fallback_rows == 4 * 4 and reader.stats.missing == {"b": 16}
    # With no record of any trajectory, the expected layout still yields dense (all-RTN) tensors.
    spec = RecordSpec(bits=1, moe_layers=(1, 3), attn_layers=(2,))
    reader = RecordReader(tmp_path, 0, missing="rtn", layout=site_layout(spec, SHAPE))
    mb = reader.load([("c", 0, 3)])
    assert set(mb.records) == {(1, "moe_in"), (2, "k"), (2, "v"), (3, "moe_in")}
    assert not any(m.any() for m in mb.has_record.values()) and reader.stats.fallback_rows == 12


def test_layout_mismatch_and_bad_ranges_are_named(tmp_path):
    StepWriter(tmp_path, 0).write({"a": trajectory(1, 6, bits=1), "b": trajectory(2, 6, bits=2)})
    reader = RecordReader(tmp_path, 0)
    with pytest.raises(StoreError, match=r"site 1.moe_in: \(format, bits, width\) \('nvfp4', 2, 64\) differs"):
        reader.load([("a", 0, 6), ("b", 0, 6)])
    expect_b2 = RecordReader(tmp_path, 0, layout={(1, "moe_in"): ("nvfp4", 2, 64)})
    with pytest.raises(StoreError, match=r"site 1.moe_in: .* \('nvfp4', 1, 64\) differs from \('nvfp4', 2, 64\)"):
        expect_b2.load([("a", 0, 6)])
    assert set(expect_b2.load([("b", 0, 6)]).records) == {(1, "moe_in")}  # sites outside the layout are skipped
    with pytest.raises(ValueError, match=r"trajectory 'a' has 6 recorded tokens; range \[2, 9\) exceeds it"):
        reader.load([("a", 2, 9)])
    with pytest.raises(ValueError, match="pad_to=3 is shorter"):
        reader.load([("a", 0, 6)], pad_to=3)
    with pytest.raises(StoreError, match="has no step 5"):
        RecordReader(tmp_path, 5)
    with pytest.raises(ValueError, match="policy must be one of"):
        RecordReader(tmp_path, 0, missing="zeros")


def corrupt(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_and_truncated_shards_raise_naming_the_shard(tmp_path):
    writer = StepWriter(tmp_path, 1)
    good = writer.write({"good": trajectory(1, 8)})
    bad = writer.write({"bad": trajectory(2, 8)})
    corrupt(bad, 10)  # inside the last frame (the routes)
    reader = RecordReader(tmp_path, 1)
    with pytest.raises(CorruptShardError, match=f"shard {bad}, trajectory 'bad', routes routes: corrupt frame"):
        reader.load([("bad", 0, 8)])
    with pytest.raises(CorruptShardError, match=f"shard {bad}.*fails its checksum"):
        RecordReader(tmp_path, 1).verify()
    assert reader.load([("good", 0, 8)]).has_record[(1, "moe_in")].all()  # other shards stay readable
    bad.write_bytes(bad.read_bytes()[:-5])
    with pytest.raises(CorruptShardError, match=f"shard {bad} is truncated"):
        RecordReader(tmp_path, 1)
    bad.write_bytes(bad.read_bytes()[:20])
    with pytest.raises(CorruptShardError, match=f"shard {bad} is truncated inside its header"):
        RecordReader(tmp_path, 1)
    data = bytearray(good.read_bytes())
    data[30] ^= 0x01  # inside the JSON header
    good.write_bytes(bytes(data))
    bad.unlink()
    with pytest.raises(CorruptShardError, match=f"shard {good} header fails its CRC-32 check"):
        RecordReader(tmp_path, 1)


@pytest.mark.parametrize("field", ["low_bits", "scales", "global_scale"])
def test_a_flipped_byte_inside_any_frame_fails_the_load_that_needs_it(tmp_path, field):
    shard = StepWriter(tmp_path, 1).write({"t": trajectory(3, 64, routes=False)})
    header = read_header(shard)
    frame = header["trajectories"]["t"]["sites"]["3.moe_in"]["fields"][field]
    data = bytearray(shard.read_bytes())
    data[header["data_start"] + frame["offset"] + frame["length"] // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    only_k = RecordReader(tmp_path, 1, layout={(2, "k"): ("nvfp4", 1, 64)})  # never reads the damaged frame
    assert only_k.load([("t", 0, 64)]).has_record[(2, "k")].all()
    reader = RecordReader(tmp_path, 1)
    with pytest.raises(CorruptShardError, match=f"shard {shard}, trajectory 't', 3.moe_in {field}: corrupt frame"):
        reader.load([("t", 0, 64)])


def test_a_shard_removed_under_an_open_reader_is_named(tmp_path):
    shard = StepWriter(tmp_path, 2).write({"t": trajectory(4, 5)})
    fresh = RecordReader(tmp_path, 2)
    warm = RecordReader(tmp_path, 2, cache_bytes=0)
    warm.load([("t", 0, 5)])  # header parsed, no frame cached
    shard.unlink()
    with pytest.raises(StoreError, match=f"cannot read shard {shard}"):
        fresh.load([("t", 0, 5)])
    with pytest.raises(StoreError, match=f"shard {shard}, trajectory 't', .*cannot read the shard"):
        warm.load([("t", 0, 5)])


def test_duplicate_trajectory_across_shards_names_both(tmp_path):
    a = StepWriter(tmp_path, 0, writer_id="w0").write({"x": trajectory(1, 3)})
    b = StepWriter(tmp_path, 0, writer_id="w1").write({"x": trajectory(2, 3)})
    with pytest.raises(StoreError, match=f"trajectory 'x' .* is in two shards: {a.name} and {b.name}"):
        RecordReader(tmp_path, 0)


def test_finalize_writes_the_index_and_closes_the_step(tmp_path):
    writer = StepWriter(tmp_path, 4)
    writer.write({i: trajectory(i, 4) for i in range(3)})
    index = finalize_step(tmp_path, 4)
    assert index.exists()
    with pytest.raises(StoreError, match="is finalized"):
        writer.write({"late": trajectory(9, 4)})
    reader = RecordReader(tmp_path, 4)
    assert reader.trajectories() == ["0", "1", "2"]
    for shard in shard_paths(step_dir(tmp_path, 4)):
        shard.unlink()
    with pytest.raises(StoreError, match="lists shard .* which is missing"):
        RecordReader(tmp_path, 4)


def test_reads_are_streaming_and_the_cache_is_bounded(tmp_path):
    trs = {f"t{i}": trajectory(i, 32) for i in range(6)}
    StepWriter(tmp_path, 0).write(trs)
    frame_bytes = 32 * 8  # one decompressed low_bits frame of a moe_in site
    reader = RecordReader(tmp_path, 0, cache_bytes=4 * frame_bytes)
    reader.load([("t1", 0, 32)])
    assert reader.stats.frames_read == 4 * 3 + 1  # only t1's frames: 4 sites x 3 fields, routes
    for name, tr in trs.items():
        assert_rows(reader.load([(name, 4, 20)]), 0, tr, 4, 20)
        assert reader._cache.size <= 4 * frame_bytes
    assert reader.verify() == 6 * 13


def test_retention_keeps_the_last_k_steps(tmp_path):
    for step in (1, 2, 5, 7):
        StepWriter(tmp_path, step).write({"t": trajectory(step, 2)})
    assert apply_retention(tmp_path, keep_last=2, protect=[1]) == [2]
    assert list_steps(tmp_path) == [1, 5, 7]
    assert apply_retention(tmp_path, keep_last=1) == [1, 5]
    assert list_steps(tmp_path) == [7] and RecordReader(tmp_path, 7).trajectories() == ["t"]
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        apply_retention(tmp_path, keep_last=0)


def test_concurrent_writer_threads(tmp_path):
    writers = [StepWriter(tmp_path, 3) for _ in range(2)]
    shared = StepWriter(tmp_path, 3)
    trs = {f"t{i}": trajectory(i, 3 + i % 4) for i in range(24)}

    def work(k: int) -> None:
        for i in range(k, 24, 4):
            (writers[k] if k < 2 else shared).write({f"t{i}": trs[f"t{i}"]})

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    finalize_step(tmp_path, 3)
    reader = RecordReader(tmp_path, 3)
    assert reader.trajectories() == sorted(trs) and shared.stats.shards == 12
    for name, tr in trs.items():
        assert_rows(reader.load([(name, 0, tr.num_tokens)]), 0, tr, 0, tr.num_tokens)


def _process_writer(root: str, worker: int) -> None:
    writer = StepWriter(root, 8)
    for i in range(worker, 8, 2):
        writer.write({f"t{i}": trajectory(i, 5)})


def test_concurrent_writer_processes(tmp_path):
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in [pool.submit(_process_writer, str(tmp_path), w) for w in range(2)]:
            done.result(timeout=120)  # re-raises a worker's exception with its traceback
    reader = RecordReader(tmp_path, 8)
    assert reader.trajectories() == [f"t{i}" for i in range(8)]
    for i in range(8):
        assert_rows(reader.load([(f"t{i}", 0, 5)]), 0, trajectory(i, 5), 0, 5)


CRASH = """
import os, sys, torch
import trace_core.records.store as store
from tests.core.test_store import trajectory
w = store.StepWriter({root!r}, 0)
w.write({{"before": trajectory(1, 4)}})
store.os.link = lambda src, dst: os._exit(3)  # the process dies between the write and the link
w.write({{"crashed": trajectory(2, 4)}})
"""


def test_crash_between_write_and_rename_leaves_the_store_readable(tmp_path):
    code = CRASH.format(root=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=120).returncode == 3
    directory = step_dir(tmp_path, 0)
    leftovers = [p for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0  # the unrenamed shard is on disk, ignored
    reader = RecordReader(tmp_path, 0, missing="rtn")
    assert reader.trajectories() == ["before"]
    mb = reader.load([("before", 0, 4), ("crashed", 0, 4)])
    assert mb.has_record[(1, "moe_in")][0].all() and reader.stats.missing == {"crashed": 16}
    finalize_step(tmp_path, 0)
    assert RecordReader(tmp_path, 0).trajectories() == ["before"]


def test_bad_writer_input_is_rejected_before_anything_is_written(tmp_path):
    writer = StepWriter(tmp_path, 0)
    tr = trajectory(1, 4)
    with pytest.raises(ValueError, match="needs at least one trajectory"):
        writer.write({})
    with pytest.raises(ValueError, match="expected TrajectoryRecords"):
        writer.write({"a": tr.records})
    with pytest.raises(ValueError, match="collide once converted to str"):
        writer.write({1: tr, "1": tr})
    with pytest.raises(ValueError, match=r"record rows \(4,\) != \(5,\)"):
        TrajectoryRecords(5, tr.records)
    with pytest.raises(ValueError, match="routes must be int32"):
        TrajectoryRecords(4, tr.records, tr.routes.long())
    with pytest.raises(ValueError, match="plain file-name token"):
        StepWriter(tmp_path, 0, writer_id="../x")
    assert shard_paths(step_dir(tmp_path, 0)) == []


@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=4),
    picks=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=4),
    extra_pad=st.integers(0, 3),
    bits=st.integers(1, 4),
)
@settings(max_examples=25, deadline=None)
def test_any_micro_batch_of_ranges_round_trips(lengths, picks, extra_pad, bits):
    with tempfile.TemporaryDirectory() as root:
        trs = {f"t{i}": trajectory(10 + i, n, "nvfp4", bits) for i, n in enumerate(lengths)}
        StepWriter(root, 0).write(trs)
        batch = []
        for i, a, b in picks:
            name = f"t{i % len(lengths)}"
            n = trs[name].num_tokens
            start, end = sorted((min(a, n), min(b, n)))
            batch.append((name, start, end))
        pad = max(e - s for _, s, e in batch) + extra_pad
        mb = RecordReader(root, 0).load(batch, pad_to=pad)
        for row, (name, start, end) in enumerate(batch):
            assert_rows(mb, row, trs[name], start, end)


def test_static_global_scale_is_stored_per_row(tmp_path):
    q = quantize(torch.randn(6, 64), "nvfp4", global_scale=torch.tensor(123.0))
    tr = TrajectoryRecords(6, {(1, "moe_in"): Record.from_quantized(q, 2)})
    StepWriter(tmp_path, 0).write({"s": tr})
    rec = RecordReader(tmp_path, 0).load([("s", 0, 6)]).records[(1, "moe_in")]
    assert torch.equal(rec.global_scale, torch.full((1, 6, 1), 123.0))
    assert torch.equal(rec.low_bits[0], tr.records[(1, "moe_in")].low_bits)


def test_rollout_capture_to_store_to_guided_rounding_reproduces_the_rollout():
    """End to end: the trainer, given the rollout's activations, rounds every recorded row exactly as the rollout
    did, and pads with counted RTN rows."""
    spec = RecordSpec(bits=1, moe_layers=(0, 1), attn_layers=())
    cap = RecordCapturer(spec, SHAPE, max_tokens=16, num_slots=64, device="cpu")
    gen = torch.Generator().manual_seed(0)
    acts = {site: torch.randn(64, 64, generator=gen) for site in spec.sites()}  # activations by KV slot

    def forward(slots: list[int]) -> None:
        for site in spec.sites():
            cap.stage_quantized(site, quantize(acts[site][slots], "nvfp4", per_token=True))
        cap.on_forward_end(torch.tensor(slots))

    forward([1, 2, 3, 4, 5])  # request a: prompt 1..4 + first token 5
    forward([6, 7])  # request b: reuses prompt slots 1..4 from the prefix cache, own token at 6; a decodes 7
    requests = {"a": [1, 2, 3, 4, 5, 7], "b": [1, 2, 3, 4, 6]}
    with tempfile.TemporaryDirectory() as root:
        writer = StepWriter(root, 0)
        for name, slots in requests.items():
            writer.write({name: cap.gather(torch.tensor(slots), len(slots))})
        finalize_step(root, 0)
        mb = RecordReader(root, 0).load([("a", 0, 6), ("b", 0, 5)], pad_to=6)
    stats = GuidanceStats()
    for site in spec.sites():
        x = torch.zeros(2, 6, 64)
        for row, slots in enumerate(requests.values()):
            x[row, : len(slots)] = acts[site][slots]
        out = guided_round(x, mb.records[site], 1, has_record=mb.has_record[site], stats=stats)
        for row, slots in enumerate(requests.values()):
            rollout = dequantize(quantize(acts[site][slots], "nvfp4", per_token=True))
            assert torch.equal(out[row, : len(slots)], rollout)
    assert stats.rtn_fallback == 2 * 64  # one padding row of b, per site


def test_small_and_large_shards_encode_to_the_same_bytes_in_the_calling_thread_or_the_pool(monkeypatch):
    """Shards under `POOL_MIN_BYTES` are compressed in the calling thread, larger ones on the thread pool; the
    frames and header do not depend on which."""
    from trace_core.records import store

    trajs = {f"t{i}": trajectory(i, 9 + i) for i in range(8)}
    inline = store.encode_shard(trajs)
    monkeypatch.setattr(store, "POOL_MIN_BYTES", 0)
    assert store.encode_shard(trajs) == inline
    assert len(inline) > 8  # a frame per field and trajectory, after the header
    cut = store._pool_tasks
    monkeypatch.setattr(store, "_pool_tasks", lambda raws: cut(raws, 64))  # many pool tasks of a few frames each
    assert len(cut([memoryview(f) for f in inline[1:]], 64)) > 2  # compressed frames: fewer bytes than the raw ones
    assert store.encode_shard(trajs) == inline


def test_the_pool_gets_consecutive_runs_of_frames_each_frame_once():
    """`_pool_tasks` cuts the frames, in order, into runs that reach the size only at their last frame."""
    from trace_core.records.store import _pool_tasks

    raws = [memoryview(bytes([i]) * (i % 4 + 1)) for i in range(11)]
    tasks = _pool_tasks(raws, 6)
    assert [bytes(r) for t in tasks for r in t] == [bytes(r) for r in raws]
    assert len(tasks) == 4
    assert all(sum(r.nbytes for r in t[:-1]) < 6 <= sum(r.nbytes for r in t) for t in tasks[:-1])
    assert _pool_tasks([], 6) == [[]]


def test_a_request_id_carries_trajectory_attempt_and_rollout_step():
    """`<trajectory>#<attempt>@<step>`: what a server binds its records to; a plain id is attempt "" and no step."""
    for trajectory, attempt, step in [("12", "a3f9", 4), ("0", "", 0), ("x", "a", None)]:
        assert parse_rollout_rid(rollout_rid(trajectory, attempt, step)) == (trajectory, attempt, step)
    assert parse_rollout_rid("plain") == ("plain", "", None)
    for bad in ("1#a@", "1#a@-2", "1#a@x"):
        with pytest.raises(ValueError, match=f"request id {bad!r}: rollout step"):
            parse_rollout_rid(bad)
    with pytest.raises(ValueError, match="must not contain '@'"):
        rollout_rid("1", "a@b", 2)
    with pytest.raises(ValueError, match="non-negative int"):
        rollout_rid("1", "a", -1)
