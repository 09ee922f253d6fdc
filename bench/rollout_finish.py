"""The embedded engine's rollout finish: records of a sampled batch from the slot-keyed store into one record-store
shard, two ways, alternating in one process.

- `per_trajectory`: each trajectory gathered on the device (`RecordCapturer.gather`), its record fields copied to
  the host one by one as the shard is encoded (every copy a host sync on CUDA): what `EmbeddedEngine.generate`
  did in the trainer-at-EP = 2 runs of docs/results.md (docs/results/trainer_ep2_and_seeds_29_steps).
- `batched`: the batch's rows gathered and copied to the host in one transfer, each trajectory split from them on
  the host (`RecordCapturer.read`): what `EmbeddedEngine.generate` does (`_gather_batch`).
Both end in `trace_core.records.store.encode_shard` (the bytes written), and must give the same shard.

The store is filled by one staged forward of random codes and routes with the model preset's layout (every site
at 4 bits: the runs of docs/results.md with `measure_all_sites`). On a GPU shared by other processes a host sync
waits for them, so run it next to the load it should see (docs/results.md ran it next to the RL runs).

Usage: python bench/rollout_finish.py [--preset small] [--batch 128] [--length 12] [--rounds 5] [--device cuda]
           [--out rollout_finish.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import write_json
from trace_core.records.capture import RecordCapturer
from trace_core.records.layout import TrajectoryRecords
from trace_core.records.spec import ModelShape, RecordSpec
from trace_core.records.store import encode_shard
from trace_rl.warmup import PRESETS


def filled_capturer(preset: str, batch: int, length: int, device: str) -> RecordCapturer:
    """A capturer of the preset's sites (4 bits, every layer, routes) whose slots [0, batch * length) hold rows."""
    cfg = PRESETS[preset]
    ids = tuple(range(cfg.layers))
    spec = RecordSpec.of_recipe(None, ids, ids, 4)
    shape = ModelShape(hidden=cfg.hidden, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim)
    rows = batch * length
    cap = RecordCapturer(spec, shape, max_tokens=rows, num_slots=rows, routes=(cfg.layers, cfg.topk), device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for site in cap.layouts:
        buf = cap.site_buffers(site)
        low = torch.randint(0, 256, (rows, buf.low_bits.shape[1]), generator=g, device=device, dtype=torch.uint8)
        scales = torch.randint(0, 127, (rows, buf.scales.shape[1]), generator=g, device=device, dtype=torch.uint8)
        gs = None if buf.global_scale is None else torch.rand(rows, 1, generator=g, device=device) + 0.5
        cap.stage(site, low, scales, gs)
    for layer in range(cfg.layers):
        cap.stage_routes(layer, torch.randint(0, cfg.experts, (rows, cfg.topk), generator=g, device=device))
    cap.on_forward_end(torch.arange(rows, device=device))
    return cap


def per_trajectory(cap: RecordCapturer, batch: int, length: int) -> list[bytes]:
    records = {str(i): cap.gather(torch.arange(length) + i * length, length) for i in range(batch)}
    return encode_shard(records)


def batched(cap: RecordCapturer, batch: int, length: int) -> list[bytes]:
    rows = cap.gather_rows(torch.arange(batch * length)).cpu().view(batch, length, -1)
    records: dict[str, TrajectoryRecords] = {str(i): cap.read(rows[i]) for i in range(batch)}
    return encode_shard(records)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=128, help="trajectories per rollout (16 prompts x 8 samples)")
    ap.add_argument("--length", type=int, default=12, help="positions per trajectory")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of both paths")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="JSON of every timing")
    args = ap.parse_args(argv)
    cap = filled_capturer(args.preset, args.batch, args.length, args.device)
    paths = {"per_trajectory": per_trajectory, "batched": batched}
    shards = {name: fn(cap, args.batch, args.length) for name, fn in paths.items()}  # warm-up, and the check
    if shards["per_trajectory"] != shards["batched"]:
        raise SystemExit("the two paths wrote different shards")
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.rounds):
        for name, fn in paths.items():
            start = time.perf_counter()
            fn(cap, args.batch, args.length)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {"args": vars(args), "seconds": times, "median_s": median}
    result["per_trajectory_over_batched"] = median["per_trajectory"] / median["batched"]
    print(json.dumps(result))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
