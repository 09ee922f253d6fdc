"""The quantize tile per row width: candidate `LAUNCH["quant"]` settings timed against each other on a CUDA GPU.

For each row width D and T, nvfp4 (per token) and kv_fp4, BF16, b = 1, graph-timed like bench/kernels.py: the
quantize kernel that `launch` picks under each candidate setting (`CANDIDATES`, `tests.kernel_tiles.SWEPT_TILES`:
the settings the GPU tests check bit for bit; applied for that width only), with and without the record, its record
overhead and its ratio to a device-to-device copy of as many bytes. Every candidate's output, record and token scales
are checked against the pure-torch reference (bit for bit). The first candidate of each width is the default tile.
The best candidate of a width has the least sum, over formats and T, of its record and no-record times relative to
the first candidate's; `--best` writes them as {D: TRACE_FP4_LAUNCH JSON}.

Usage: python bench/record_tiles.py [--t 4096 65536] [--d 2048 4096 7168] [--candidates 0 6] [--formats nvfp4]
       [--out tiles.json] [--best best.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import copy_gbps, graph_ms, write_json
from bench.kernels import BITS, FORMATS
from tests.kernel_tiles import SWEPT_TILES as CANDIDATES
from trace_core.kernels import launch, quantize_record, record_buffers
from trace_core.kernels.launch import ScaleMode
from trace_core.numerics.formats import get_format
from trace_core.numerics.quant import dequantize, quantize
from trace_core.records.spec import pack_low_bits


def tile_label(fmt: str, t: int, d: int) -> str:
    """The tile `launch` picks for fmt on [t, d] under the current LAUNCH: rows x chunk / warps (passes)."""
    per_token = FORMATS[fmt].get("per_token", False)
    rows, chunk, warps = launch.launch_shape(get_format(fmt), d, per_token=per_token)
    chunks = -(-d // chunk)
    passes = ", 2 passes" if per_token and chunks > 1 else ""
    first = "" if launch.record_first(rows, chunk, warps) else ", block per 2 threads"
    if not per_token and launch.LAUNCH["quant"]["whole_chunks"] and d % chunk:  # launch.whole_chunk_rows (T x D fills)
        return f"{rows}x{chunk}/{warps}w (with a record: rows of whole chunks{first})"
    tile = launch.LAUNCH["quant"]
    mode = ScaleMode.PER_TOKEN if per_token else ScaleMode.NONE
    groups = [launch.token_groups(t, d, (rows, chunk, warps), mode, [], torch.device("cuda"), r) for r in (True, False)]
    if all(groups):
        (g, c, w), (pg, pc, pw) = groups
        return (f"token groups, {tile['group_ahead']} chunks ahead: {g} rows as {g * d // c} chunks of {c}/{w}w, "
                f"without the record {pg} rows as {pg * d // pc} chunks of {pc}/{pw}w")  # fmt: skip
    loop = tile["row_loop"]
    tiles = f", {loop} row tiles per program" if loop > 1 else ""
    if launch.loaded_ahead_rows(d, chunks, mode):
        tiles = f", {tile['prefetch_loop']} row tiles per program loaded ahead where they fill the SMs"
    return f"{rows}x{chunk}/{warps}w ({chunks} chunk{'s' if chunks > 1 else ''}{passes}{first}{tiles})"


def time_case(x: torch.Tensor, fmt: str, only: list[int] | None = None) -> list[dict]:
    """Every candidate tile of x's width for fmt on x (those numbered in `only`, where given): a row each (printed
    as it is measured)."""
    t, d = x.shape
    kwargs = FORMATS[fmt]
    q = quantize(x, fmt, **kwargs)
    ref = [dequantize(q, x.dtype), pack_low_bits(q.codes, BITS), q.scales]
    if q.global_scale is not None:
        ref.append(q.global_scale)
    del q
    out = torch.empty_like(x)
    low, scales, token = record_buffers(t, d, fmt, BITS, x.device, per_token=bool(kwargs))
    written = [out, low, scales] + ([token] if token is not None else [])
    moved = 2 * x.numel() * 2 + sum(b.numel() * b.element_size() for b in written[1:])
    copy = copy_gbps(moved)
    with_record = partial(quantize_record, x, fmt, BITS, out=out, low_bits=low, scales=scales, token_scale=token,
                          **kwargs)  # fmt: skip
    without_record = partial(quantize_record, x, fmt, BITS, out=out, **kwargs)
    rows = []
    for i, override in enumerate(CANDIDATES[d]):
        if only is not None and i not in only:
            continue
        with launch.launch_overrides(override):
            for b in written:
                b.zero_()
            rec_us, plain_us = 1e3 * graph_ms(with_record), 1e3 * graph_ms(without_record)
            same = all(torch.equal(a, b) for a, b in zip(written, ref, strict=True))
            out.zero_()
            without_record()
            rows.append({
                "D": d, "T": t, "format": fmt, "candidate": i, "override": override, "tile": tile_label(fmt, t, d),
                "record_us": rec_us, "plain_us": plain_us, "record_overhead_pct": 100 * (rec_us / plain_us - 1),
                "copy_ratio": moved / rec_us / 1e3 / copy, "copy_GBps": copy,
                "bit_exact": same and torch.equal(out, ref[0]),
            })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run(ts: list[int], ds: list[int], only: list[int] | None = None, formats: list[str] | None = None) -> list[dict]:
    rows = []
    for d, t in itertools.product(ds, ts):
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        for fmt in formats or FORMATS:
            rows += time_case(x, fmt, only)
    return rows


def best(rows: list[dict]) -> dict[int, dict[str, int]]:
    """Per width, the candidate with the least summed record and no-record time relative to the first's."""
    first = {}
    for r in rows:  # the first candidate timed of each case
        first.setdefault((r["D"], r["T"], r["format"]), r)
    score: dict[tuple[int, int], float] = {}
    for r in rows:
        f = first[(r["D"], r["T"], r["format"])]
        key = (r["D"], r["candidate"])
        score[key] = score.get(key, 0.0) + r["record_us"] / f["record_us"] + r["plain_us"] / f["plain_us"]
    out = {}
    for d in sorted({k[0] for k in score}):
        i = min((c for dd, c in score if dd == d), key=lambda c: score[(d, c)])
        out[d] = CANDIDATES[d][i]
        print(f"D={d}: best candidate {i} {json.dumps({'quant': out[d]})} (score {score[(d, i)]:.3f}; "
              + ", ".join(f"{c}: {score[(d, c)]:.3f}" for dd, c in sorted(score) if dd == d) + ")")  # fmt: skip
    return out


def markdown(rows: list[dict]) -> str:
    head = ["D", "T", "format", "candidate", "tile", "record (us)", "no record (us)", "record overhead", "copy ratio",
            "bit-exact"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(f"| {r['D']} | {r['T']} | {r['format']} | {r['candidate']} {json.dumps(r['override'])} | "
                     f"{r['tile']} | {r['record_us']:.1f} | {r['plain_us']:.1f} | {r['record_overhead_pct']:+.1f} % | "
                     f"{r['copy_ratio']:.2f} | {r['bit_exact']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--t", type=int, nargs="+", default=[4096, 65536])
    parser.add_argument("--d", type=int, nargs="+", default=sorted(CANDIDATES))
    parser.add_argument("--candidates", type=int, nargs="+", help="time only these candidates (numbers, 0 first)")
    parser.add_argument("--formats", nargs="+", choices=list(FORMATS), help="time only these formats (default both)")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--best", help="write the best candidate per width here, {D: TRACE_FP4_LAUNCH JSON}")
    args = parser.parse_args()
    rows = run(args.t, args.d, args.candidates, args.formats)
    print(f"\nGPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  LAUNCH {launch.LAUNCH['quant']}\n")
    print(markdown(rows) + "\n")
    chosen = best(rows)
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "launch": launch.LAUNCH["quant"], "rows": rows})
    write_json(args.best, {str(d): json.dumps({"quant": o}) for d, o in chosen.items()}, indent=None)


if __name__ == "__main__":
    main()
