"""Benchmark of the record capture path and the record store; every ratio is measured against a baseline in the
same run.

  1. capture overhead: a simulated rollout forward (per layer, a BF16 GEMM sized like a Qwen3-30B-A3B MoE layer's
     expert traffic: all experts' weights read at decode, top-k experts' FLOPs at prefill) with and without record
     capture, and the GPU kernels each runs per forward. `--record kernel` (SGLang's emulate path): both forwards
     quantize-dequantize every layer's MoE input (emulate's numerics, `rollout_rtn`); with capture, the recorded
     layers' kernel also writes the record into the staging rows, every layer stages its routes (one copy, which
     is also the layer's FusedMoE hook marker, as in `sglang_trace` where a rank keeps the layer's routes), and
     the forward ends with `on_forward_end`. `--record stage` (the earlier rounds'
     upper bound): no fake-quant in either forward, the record copied into staging by `stage` (three copies).
     Part `graph`: the decode forward captured once in a CUDA graph per variant and replayed, as SGLang's
     cuda-graph runner does (the hooks' writes run inside the graph; `on_forward_end` runs eagerly after the
     replay, as SGLang calls it after the forward). Wall time: `--repeats` plain / captured pairs in ABBA
     order, each `--iters` forwards; the median overhead over the pairs and its quartiles. On CUDA each variant is
     also profiled over `--profile-forwards` forwards: kernels per forward and, per kernel name over both variants'
     names, the calls and device time capture changes (`added_by_capture`), with the net device time of the kernels
     whose calls differ (`capture_kernel_us`: capture's own kernels, not the GEMM's run-to-run noise). `--tp-size N`:
     what TP rank 0 of N runs (its share of the MoE layers' records and routes; the expert GEMM 1 / N);
  2. part `copy`: the store's per-forward `index_copy_` and the finish `index_select` of a prefill's rows through
     a byte view against the 8-byte word view the capturer uses;
     part `transfer`, the finish transfer: bytes/s of one gather of a finished request's rows out of the device
     record store (its slots scattered over the store) copied into a span of the pinned host ring, against a plain
     pinned `copy_` of the same number of contiguous bytes;
  3. record store write / read MB/s against writing / reading the same raw bytes as plain files (both fsynced;
     reads hit the page cache); zstandard compression ratio per field (b = 1 bits, scale bytes, token scales,
     routes) on synthetic activations with outlier channels.

    python bench/capture.py --out capture.json              # GPU, paper-scale shapes
    python bench/capture.py --small --device cpu            # CPU smoke check
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import capture_graph, device_name, mean_time, sync, write_json
from trace_core.numerics.fc2 import fc2_input_fake_quant
from trace_core.numerics.quant import quantize
from trace_core.numerics.recipe import NVFP4_W4A4_KV4
from trace_core.numerics.role_quant import rollout_rtn
from trace_core.records.capture import WORD, RecordCapturer, shard_layers
from trace_core.records.host_ring import HostRing
from trace_core.records.layout import TrajectoryRecords
from trace_core.records.reader import RecordReader
from trace_core.records.spec import ModelShape, Record, RecordSpec
from trace_core.records.store import StepWriter, read_header, shard_paths


def synthetic_activations(rows: int, hidden: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Gaussian activations with log-normal per-channel (outlier channels) and per-token magnitudes."""
    channel = torch.exp(1.5 * torch.randn(hidden, generator=gen))
    token = torch.exp(0.5 * torch.randn(rows, 1, generator=gen))
    return (torch.randn(rows, hidden, generator=gen) * channel * token).to(device)


def records_for(spec: RecordSpec, hidden: int, rows: int, seed: int, device: torch.device) -> dict:
    """Reference-quantizer records of every MoE site for `rows` tokens (on `device`)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in spec.moe_layers:
        q = quantize(synthetic_activations(rows, hidden, gen, device), spec.moe_format, per_token=True)
        out[(layer, "moe_in")] = Record.from_quantized(q, spec.bits)
    return out


class SimulatedForward:
    """Per layer `x += (x @ W)[:, :hidden]`, W sized so a layer moves the bytes (decode) or does the FLOPs
    (prefill) of a routed-expert layer on one MoE-TP rank: experts * 3 * moe_inter / tp columns at decode,
    topk * 3 * moe_inter / tp at prefill."""

    def __init__(self, args, tokens: int, decode: bool, device: torch.device, dtype: torch.dtype) -> None:
        cols = (args.experts if decode else args.topk) * 3 * args.moe_inter // args.tp_size  # this TP rank's share
        self.w = torch.randn(args.hidden, cols, device=device, dtype=dtype) * 0.01
        self.x = torch.randn(tokens, args.hidden, device=device, dtype=dtype)
        self.layers, self.hidden = args.layers, args.hidden

    def __call__(self, moe_input=None, on_layer=None) -> None:
        x = self.x
        for layer in range(self.layers):
            h = x if moe_input is None else moe_input(layer, x)
            x = x + (h @ self.w)[:, : self.hidden]
            if on_layer is not None:
                on_layer(layer)


def recorded_layers(args) -> tuple[int, ...]:
    """The MoE layers with records: `--layers all` or the latter half (the paper's policy)."""
    return tuple(range(0 if args.record_layers == "all" else args.layers // 2, args.layers))


def rank_layers(args) -> tuple[int, ...]:
    """The MoE layers TP rank 0 keeps in its record store (records and routes; `--tp-size`)."""
    return shard_layers(range(args.layers), recorded_layers(args), args.tp_size)[0]


def kernel_profile(fn, device: torch.device, forwards: int) -> dict | str | None:
    """GPU kernels (and memsets / copies) per call of `fn`, by name: `{name: [calls, device µs]}`, the means over
    `forwards` calls profiled in one session; None off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(forwards):
                fn()
            sync(device)
        out: dict[str, list] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                entry = out.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += e.time_range.elapsed_us()
        return {name: [calls / forwards, us / forwards] for name, (calls, us) in out.items()}
    except Exception as e:  # the profile is a side figure: report why it is missing, keep the timings
        return f"not profiled ({type(e).__name__}: {e})"


def profile_diff(plain: dict | str | None, captured: dict | str | None) -> dict:
    """Per-forward kernel accounting of capture: what it changes per kernel name (calls, device µs), over the union of
    both variants' names (a kernel only the plain forward runs, e.g. the no-record quantize kernel the record kernel
    replaces, counts negative), largest first.

    `capture_kernel_us`: the net device time of the kernels whose calls per forward differ between the variants
    (the launches capture adds, minus those it replaces); `shared_kernel_delta_us`: the difference over kernels both
    run equally often (the forward's own GEMMs and adds, the same work: run-to-run noise, not capture);
    `capture_kernel_pct`: `capture_kernel_us` over the plain forward's kernel time."""
    if not isinstance(plain, dict) or not isinstance(captured, dict):
        return {"kernels_forward": plain, "kernels_captured": captured}
    added, own, shared = {}, 0.0, 0.0
    for name in plain.keys() | captured.keys():
        base_calls, base_us = plain.get(name, (0, 0.0))
        calls, us = captured.get(name, (0, 0.0))
        if calls != base_calls:
            own += us - base_us
        else:
            shared += us - base_us
        if calls != base_calls or abs(us - base_us) > 1.0:
            added[name] = [round(calls - base_calls, 2), round(us - base_us, 1)]
    plain_us = sum(us for _, us in plain.values())
    return {
        "kernels_forward": round(sum(c for c, _ in plain.values()), 2),
        "kernels_captured": round(sum(c for c, _ in captured.values()), 2),
        "kernel_us_forward": round(plain_us, 1),
        "kernel_us_captured": round(sum(us for _, us in captured.values()), 1),
        "capture_kernel_us": round(own, 1),
        "shared_kernel_delta_us": round(shared, 1),
        "capture_kernel_pct": 100 * own / plain_us if plain_us else None,
        "added_by_capture": dict(sorted(added.items(), key=lambda kv: -abs(kv[1][1]))),
    }


def paired_overhead(plain, captured, pairs: int, timed) -> dict:
    """Wall time of `plain` and `captured` measured in `pairs` adjacent pairs, the order alternating (ABBA) so a
    drift in clocks or load falls on both; the overhead of each pair, its median and spread (quartiles, min, max)."""
    base_t, cap_t, pct = [], [], []
    for i in range(pairs):
        if i % 2:
            c, b = timed(captured), timed(plain)
        else:
            b, c = timed(plain), timed(captured)
        base_t.append(b)
        cap_t.append(c)
        pct.append(100 * (c - b) / b)
    q = statistics.quantiles(pct, n=4) if pairs > 1 else [pct[0]] * 3
    return {
        "forward_ms": statistics.median(base_t) * 1e3,
        "captured_ms": statistics.median(cap_t) * 1e3,
        "overhead_pct": statistics.median(pct),
        "overhead_pct_quartiles": [q[0], q[2]],
        "overhead_pct_range": [min(pct), max(pct)],
        "pairs": pairs,
    }


def bench_overhead(args, device: torch.device, tokens: int, decode: bool, graph: bool = False) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mine = rank_layers(args)  # every layer at --tp-size 1
    spec = RecordSpec.of_recipe(None, tuple(layer for layer in recorded_layers(args) if layer in mine), (), args.bits)
    shape = ModelShape(hidden=args.hidden, num_kv_heads=1, head_dim=16)
    index = {layer: i for i, layer in enumerate(mine)}
    cap = RecordCapturer(
        spec,
        shape,
        max_tokens=max(tokens, args.prefill),  # SGLang sizes staging for the largest prefill chunk
        num_slots=4 * tokens + 1,
        routes=(len(mine), args.topk),
        device=device,
        versioned=True,
    )
    ids = torch.randint(0, args.experts, (tokens, args.topk), device=device, dtype=torch.int32)
    fwd = SimulatedForward(args, tokens, decode, device, dtype)
    role = NVFP4_W4A4_KV4.moe_in
    recs = records_for(spec, args.hidden, tokens, 0, device) if args.record == "stage" else {}
    step = [0]

    def emulate(layer: int, x: torch.Tensor) -> torch.Tensor:  # TRACE off: emulate's numerics only
        return rollout_rtn(role, x, args.bits)

    def emulate_recorded(layer: int, x: torch.Tensor) -> torch.Tensor:  # sglang_trace.moe.emulate_moe_input
        site = (layer, "moe_in")
        return rollout_rtn(role, x, args.bits, cap.staging_rows(site, tokens) if site in cap.layouts else None)

    def on_layer(layer: int) -> None:  # the FusedMoE hook staging the routes (its marker), on the rank keeping them
        if layer not in index:
            return
        cap.stage_routes(index[layer], ids)
        rec = recs.get((layer, "moe_in"))
        if rec is not None:
            cap.stage((layer, "moe_in"), rec.low_bits, rec.scales, rec.global_scale)

    kernel = args.record == "kernel"

    slots = [torch.arange(i * tokens + 1, (i + 1) * tokens + 1, device=device) for i in range(4)]  # out_cache_loc

    def plain() -> None:
        fwd(emulate if kernel else None)

    def recorded() -> None:
        fwd(emulate_recorded if kernel else None, on_layer)

    def forward_end(replay: bool) -> None:
        step[0] += 1
        cap.on_forward_end(slots[step[0] % 4], graph_replay=replay, version=0)

    if graph:  # three warm-up forwards on a side stream, each followed by what runs outside the graph
        plain = capture_graph(plain, warmup=3, device=device)
        recorded = capture_graph(recorded, warmup=3, after=lambda: forward_end(False), device=device)

    def captured() -> None:
        recorded()
        forward_end(graph)

    def timed(fn) -> float:
        return mean_time(fn, args.iters, device)

    for fn in (plain, captured):  # warm-up
        timed(fn)
    wall = paired_overhead(plain, captured, args.repeats, timed)
    return {
        "tokens": tokens,
        "record": args.record,
        "cuda_graph": graph,
        "tp_size": args.tp_size,
        "recorded_layers": len(spec.moe_layers),
        "iters": args.iters,
        **wall,
        "bytes_per_forward": tokens * cap.row.row_bytes,
        **profile_diff(*(kernel_profile(fn, device, args.profile_forwards) for fn in (plain, captured))),
    }


def bench_fc2(args, device: torch.device, tokens: int, decode: bool) -> dict:
    """emulate's FC2-input fake-quant (`trace_core.numerics.fc2`, every MoE layer on `[tokens * topk, moe_inter]`)
    against the simulated forward of the same tokens (not capture: the numerics of the emulated rollout)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fwd = SimulatedForward(args, tokens, decode, device, dtype)
    h = torch.randn(tokens * args.topk, args.moe_inter, device=device, dtype=dtype)

    def fc2() -> None:
        for _ in range(args.layers):
            fc2_input_fake_quant(h, NVFP4_W4A4_KV4.fc2_in)

    def timed(fn) -> float:
        return mean_time(fn, args.iters, device)

    timed(fwd), timed(fc2)
    b = statistics.median(timed(fwd) for _ in range(args.repeats))
    q = statistics.median(timed(fc2) for _ in range(args.repeats))
    return {"tokens": tokens, "forward_ms": b * 1e3, "fc2_qdq_ms": q * 1e3, "fc2_qdq_pct": 100 * q / b}


def bench_copy(args, device: torch.device, tokens: int) -> dict:
    """The store's per-forward copy (`index_copy_` of the staging rows into the slot-keyed store) and the finish
    gather (`index_select`) of `tokens` record rows, through a byte view (what the capturer copied before it moved
    words) against the 8-byte word view `RecordCapturer` uses, in one run."""
    spec = RecordSpec.of_recipe(None, recorded_layers(args), (), args.bits)
    shape = ModelShape(hidden=args.hidden, num_kv_heads=1, head_dim=16)
    cap = RecordCapturer(
        spec, shape, max_tokens=tokens, num_slots=4 * tokens + 1, routes=(args.layers, args.topk), device=device
    )
    slots = (torch.randperm(4 * tokens)[:tokens] + 1).to(device)
    views = {"bytes": (cap.staging, cap.store), "words": (cap.staging.view(WORD), cap.store.view(WORD))}
    out: dict = {"tokens": tokens, "bytes": tokens * cap.row.row_bytes}
    for name, (staging, store) in views.items():

        def copy(staging=staging, store=store) -> None:
            store.index_copy_(0, slots, staging)

        def gather(store=store) -> None:
            store.index_select(0, slots)

        out[f"index_copy_ms_{name}"] = 1e3 * statistics.median(
            mean_time(copy, args.iters, device) for _ in range(args.repeats)
        )
        out[f"index_select_ms_{name}"] = 1e3 * statistics.median(
            mean_time(gather, args.iters, device) for _ in range(args.repeats)
        )
    return out


def bench_transfer(args, device: torch.device, tokens: int) -> dict:
    spec = RecordSpec.of_recipe(None, recorded_layers(args), (), args.bits)
    shape = ModelShape(hidden=args.hidden, num_kv_heads=1, head_dim=16)
    cap = RecordCapturer(
        spec, shape, max_tokens=tokens, num_slots=4 * tokens + 1, routes=(args.layers, args.topk), device=device
    )
    cap.store.random_(0, 256)
    nbytes = tokens * cap.row.row_bytes
    src = cap.staging[:tokens]
    pin = device.type == "cuda"
    pinned = torch.empty(src.shape, dtype=torch.uint8, pin_memory=pin)
    ring = HostRing(2 * nbytes, pin=pin)
    request = (torch.randperm(4 * tokens)[:tokens] + 1).to(device)  # a finished request's slots, scattered

    def plain() -> None:
        pinned.copy_(src, non_blocking=True)
        sync(device)

    def transfer() -> None:
        ticket, span = ring.reserve(nbytes)
        span.view(tokens, -1).copy_(cap.gather_rows(request), non_blocking=True)
        sync(device)
        ring.release(ticket)

    plain_s = statistics.median(mean_time(plain, args.iters, device) for _ in range(args.repeats))
    transfer_s = statistics.median(mean_time(transfer, args.iters, device) for _ in range(args.repeats))
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "pinned_copy_GBps": nbytes / plain_s / 1e9,
        "transfer_GBps": nbytes / transfer_s / 1e9,
        "transfer_ms": transfer_s * 1e3,
    }


def _write_raw(directory: Path, blobs: list[bytes]) -> float:
    directory.mkdir(parents=True)
    t0 = time.perf_counter()
    for i, blob in enumerate(blobs):
        with open(directory / f"raw-{i}.bin", "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def bench_store(args, device: torch.device, work: Path) -> dict:
    spec = RecordSpec.of_recipe(None, recorded_layers(args), (), args.bits)
    trajs = {}
    for i in range(args.trajectories):
        recs = {
            s: Record(r.fmt, r.bits, r.n, r.low_bits.cpu(), r.scales.cpu(), r.global_scale.cpu())
            for s, r in records_for(spec, args.hidden, args.traj_tokens, 100 + i, device).items()
        }
        routes = torch.randint(0, args.experts, (args.traj_tokens, args.layers, args.topk), dtype=torch.int32)
        trajs[f"traj{i}"] = TrajectoryRecords(args.traj_tokens, recs, routes)
    blobs = []
    for tr in trajs.values():
        parts = [t.numpy().tobytes() for r in tr.records.values() for t in (r.low_bits, r.scales, r.global_scale)]
        blobs.append(b"".join(parts) + tr.routes.numpy().tobytes())
    raw_bytes = sum(len(b) for b in blobs)
    raw_write = _write_raw(work / "raw", blobs)
    writer = StepWriter(work / "store", 0, level=args.level)
    t0 = time.perf_counter()
    for name, tr in trajs.items():
        writer.write({name: tr})
    store_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(len(blobs)):
        (work / "raw" / f"raw-{i}.bin").read_bytes()
    raw_read = time.perf_counter() - t0
    reader = RecordReader(work / "store", 0, cache_bytes=1 << 20)
    t0 = time.perf_counter()
    for name in trajs:
        reader.load([(name, 0, args.traj_tokens)])
    store_read = time.perf_counter() - t0
    ratios: dict[str, list[int]] = {}
    for path in shard_paths(work / "store" / "step_00000000"):
        for entry in read_header(path)["trajectories"].values():
            frames = [(k, m) for s in entry["sites"].values() for k, m in s["fields"].items()]
            for kind, meta in frames + [("routes", entry["routes"])]:
                acc = ratios.setdefault(kind, [0, 0])
                acc[0], acc[1] = acc[0] + meta["raw"], acc[1] + meta["length"]
    mb = raw_bytes / 1e6
    return {
        "raw_MB": mb,
        "disk_MB": writer.stats.disk_bytes / 1e6,
        "raw_write_MBps": mb / raw_write,
        "store_write_MBps": mb / store_write,
        "raw_read_MBps": mb / raw_read,
        "store_read_MBps": mb / store_read,
        "compression_ratio": {k: raw / disk for k, (raw, disk) in ratios.items()},
    }


def table(result: dict) -> str:
    rows = ["| measurement | value | baseline (same run) | ratio |", "|---|---|---|---|"]
    for name, r in [*result.get("overhead", {}).items(), *result.get("graph", {}).items()]:
        name += ", CUDA graph" if r["cuda_graph"] else ""
        name += f", TP rank 0 of {r['tp_size']}" if r["tp_size"] > 1 else ""
        lo, hi = r["overhead_pct_quartiles"]
        kernels = ""
        if r.get("capture_kernel_pct") is not None:
            kernels = (
                f"; capture's kernels {r['capture_kernel_us']:.1f} µs = {r['capture_kernel_pct']:+.2f} % of the "
                f"forward's {r['kernel_us_forward']:.0f} µs (shared kernels {r['shared_kernel_delta_us']:+.1f} µs)"
            )
        rows.append(
            f"| capture, {name}, record by {r['record']}, {r['recorded_layers']} recorded layers ({r['tokens']} "
            f"tokens, {r['bytes_per_forward'] / 1e6:.2f} MB; GPU kernels {r['kernels_captured']} vs "
            f"{r['kernels_forward']}) | {r['captured_ms']:.3f} ms | {r['forward_ms']:.3f} ms forward | "
            f"{r['overhead_pct']:+.2f} % (median of {r['pairs']} pairs, quartiles {lo:+.2f} .. {hi:+.2f} %){kernels} |"
        )
    for name, r in result.get("fc2", {}).items():
        rows.append(
            f"| FC2-input fake-quant, {name} ({r['tokens']} tokens, every MoE layer) | {r['fc2_qdq_ms']:.3f} ms | "
            f"{r['forward_ms']:.3f} ms forward | {r['fc2_qdq_pct']:.2f} % |"
        )
    if c := result.get("copy"):
        for op in ("index_copy", "index_select"):
            words, raw = c[f"{op}_ms_words"], c[f"{op}_ms_bytes"]
            rows.append(
                f"| store {op} of {c['tokens']} rows ({c['bytes'] / 1e6:.1f} MB), 8-byte words | {words:.3f} ms | "
                f"{raw:.3f} ms as bytes | {words / raw:.2f} |"
            )
    if d := result.get("transfer"):
        rows.append(
            f"| finish transfer of a {d['tokens']}-token request ({d['bytes'] / 1e6:.1f} MB: store gather + copy "
            f"into the host ring) | {d['transfer_GBps']:.2f} GB/s ({d['transfer_ms']:.2f} ms) | "
            f"{d['pinned_copy_GBps']:.2f} GB/s pinned copy | {d['transfer_GBps'] / d['pinned_copy_GBps']:.2f} |"
        )
    if s := result.get("store"):
        for op in ("write", "read"):
            store, raw = s[f"store_{op}_MBps"], s[f"raw_{op}_MBps"]
            rows.append(
                f"| store {op} ({s['raw_MB']:.0f} MB) | {store:.0f} MB/s | {raw:.0f} MB/s raw | {store / raw:.2f} |"
            )
        for kind, ratio in s["compression_ratio"].items():
            rows.append(f"| zstd ratio, {kind} | {ratio:.3f} | 1.0 uncompressed | |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke check")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--bits", type=int, default=1)
    p.add_argument(
        "--record",
        choices=("kernel", "stage"),
        default="kernel",
        help="overhead part: records written by the fake-quant kernel (SGLang's emulate path) or staged by copies",
    )
    p.add_argument("--record-layers", choices=("latter-half", "all"), default="all", help="MoE layers with records")
    p.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="overhead / graph parts: TP rank 0 of this many ranks (its share of the MoE layers' records and routes, "
        "as sglang_trace shards them; the expert GEMM 1 / tp wide)",
    )
    p.add_argument("--level", type=int, default=1, help="zstandard level of the store")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--repeats", type=int, default=5, help="timed repeats (overhead / graph: plain-captured pairs, ABBA order)"
    )
    p.add_argument(
        "--profile-forwards", type=int, default=3, help="overhead / graph parts: forwards profiled per variant"
    )
    p.add_argument(
        "--parts",
        default="overhead,fc2,transfer,store",
        help="comma-separated subset of overhead,graph (decode under a CUDA graph; GPU),copy,fc2,transfer,store",
    )
    p.add_argument("--trajectories", type=int, help="store part: trajectories written (default 16; small: 4)")
    p.add_argument("--traj-tokens", type=int, help="store part: tokens per trajectory (default 4096; small: 256)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"overhead", "graph", "copy", "fc2", "transfer", "store"}:
        raise ValueError(f"--parts must name overhead, graph, copy, fc2, transfer and/or store, got {args.parts!r}")
    if "graph" in parts and args.device == "cpu":
        raise ValueError("--parts graph captures CUDA graphs: it needs --device cuda")
    big = dict(hidden=2048, layers=48, experts=128, topk=8, moe_inter=768, decode=64, prefill=8192)
    small = dict(hidden=256, layers=4, experts=16, topk=4, moe_inter=64, decode=8, prefill=256)
    for k, v in (small if args.small else big).items():
        setattr(args, k, v)
    args.trajectories = args.trajectories or (4 if args.small else 16)
    args.traj_tokens = args.traj_tokens or (256 if args.small else 4096)
    if args.small:
        args.iters, args.repeats = min(args.iters, 3), min(args.repeats, 2)
    device = torch.device(args.device)
    result = {
        "device": device_name(device),
        "config": {
            k: getattr(args, k)
            for k in (*big, "bits", "record", "record_layers", "tp_size", "level", "trajectories", "traj_tokens")
        },
    }

    def done() -> None:  # each part's result is kept as soon as it is measured
        write_json(args.out, result, indent=2)

    if "graph" in parts:
        result["graph"] = {"decode": bench_overhead(args, device, args.decode, decode=True, graph=True)}
        done()
    if "overhead" in parts:
        result["overhead"] = {
            "decode": bench_overhead(args, device, args.decode, decode=True),
            "prefill": bench_overhead(args, device, args.prefill, decode=False),
        }
        done()
    if "copy" in parts:
        result["copy"] = bench_copy(args, device, args.prefill)
        done()
    if "fc2" in parts:
        result["fc2"] = {
            "decode": bench_fc2(args, device, args.decode, decode=True),
            "prefill": bench_fc2(args, device, args.prefill, decode=False),
        }
    if "transfer" in parts:
        result["transfer"] = bench_transfer(args, device, args.prefill)
    if "store" in parts:
        with tempfile.TemporaryDirectory() as work:
            result["store"] = bench_store(args, device, Path(work))
    done()
    print(table(result))


if __name__ == "__main__":
    main()
