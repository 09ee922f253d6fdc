"""Where the record's cost goes: quantize-and-record variants timed against each other on a CUDA GPU.

At T x D (default 65536 x 4096, BF16, b = 1) for nvfp4 (per token) and kv_fp4, graph-timed like bench/kernels.py:
- the one-block-per-thread kernel (`_quantize_record16_kernel`, what `ops` launches for 16-element blocks) with and
  without the record, with the record in 2-byte stores (aligned buffer), in byte stores (buffer at an odd
  address) and capped at 32 registers, and writing only the record (no fake-quantized output); with one tile of
  rows per program and with several (`ROW_LOOPS`, one after the other: warps stay resident while stores drain);
- the generic kernel (`_quantize_record_kernel`, one 8-element group per thread, what `ops` launched for these
  formats before; now only for nvfp4 records on rows of at most 256 columns) in the same variants.
Differences between rows place the time: record stores, store width, layout. `--tiles` adds a sweep of the
program tile (rows x columns, warps) of the kv_fp4 block kernel with and without the record: the record's
overhead at each tile, and at the best tile of each.

`--wide D [D ...]` instead times, at each row width D, the record stored per block (2-byte words and scale
bytes, `REC_UNIT` 2) against the record stored in 16-byte vectors and 8-byte scale words (`REC_UNIT` 16, what
`ops` launches where `record_store_unit` allows it), both against the block kernel without a record, and for
nvfp4 the group-per-thread kernel with the record; it checks that every variant writes the same bytes.

Usage: python bench/record_variants.py [--t 65536] [--d 4096] [--tiles] [--wide 2048 4096 7168] [--out variants.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import graph_ms
from trace_core.kernels import ops
from trace_core.kernels import triton_fp4 as k

TILES = [(1, 4096, 8), (1, 4096, 4), (1, 2048, 4), (1, 2048, 8), (2, 2048, 8), (1, 1024, 4), (4, 1024, 8), (2, 1024, 4)]
"""(rows, columns, warps) of the `--tiles` sweep; the first is ops.LAUNCH["quant"], the default."""
ROW_LOOPS = (4,)
"""Row tiles per program (`ROW_LOOP`) timed for the block kernel besides one."""


def launch(kernel16: bool, x, fmt, out, low, scales, token, unit: int, tile=None, maxnreg=None, loop=1) -> None:
    """`ops.triton_quantize_record` with the kernel family, record store width and (optionally) the program tile
    and a register cap chosen explicitly."""
    f = ops.get_format(fmt)
    t, d = x.shape
    per_token = fmt == "nvfp4"
    mode = ops.SCALE_PER_TOKEN if per_token else ops.SCALE_NONE
    rb, chunk, warps = tile or ops._launch_shape(f, d, per_token=per_token)
    n_chunks = triton.cdiv(d, chunk)
    per_prog = n_chunks if per_token else 1
    record = low is not None
    extra16 = {"REC_UNIT": unit, "RECORD_FIRST": ops.record_first(rb, chunk, warps), "ROW_LOOP": loop}
    kernel, extra = (k._quantize_record16_kernel, extra16) if kernel16 else (
        k._quantize_record_kernel, {"BLOCK": f.block})  # fmt: skip
    dummy8 = torch.empty(1, dtype=torch.uint8, device=x.device)
    dummy32 = torch.empty(1, dtype=torch.float32, device=x.device)
    kernel[(triton.cdiv(t, rb * loop), n_chunks // per_prog)](
        x, out if out is not None else x, low if record else dummy8, scales if record else dummy8, dummy32,
        token if token is not None else dummy32, t, d, x.stride(0), out.stride(0) if out is not None else 0,
        low.stride(0) if record else 0, scales.stride(0) if record else 0, 1, per_prog, FMT=f.kernel_id,
        SCALE_MODE=mode, BITS=1 if record else 0, WRITE_OUT=out is not None, RB=rb, C=chunk, ONE_PASS=n_chunks == 1,
        num_warps=warps, **extra, **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip


def wide(t: int, ds: list[int]) -> list[dict]:
    """The `--wide` comparison (module docstring): one row per format, width and variant, with the overhead over
    the no-record kernel and whether its bytes equal the per-block stores'."""
    rows = []
    for d, fmt in itertools.product(ds, ("nvfp4", "kv_fp4")):
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        low, scales, token = ops.record_buffers(t, d, fmt, 1, "cuda", per_token=fmt == "nvfp4")
        variants = {"no record": (True, None, 1), "record, per-block stores": (True, low, 2),
                    "record, 16-byte vectors": (True, low, 16)}  # fmt: skip
        if fmt == "nvfp4":
            variants["record, group-per-thread kernel"] = (False, low, 1)
        plain, first = None, None
        for label, (kernel16, rec, unit) in variants.items():
            for buf in (low, scales, out):  # every variant must write all of its bytes
                buf.zero_()
            ms = graph_ms(partial(launch, kernel16, x, fmt, out, rec, scales, token, unit))
            row = {"format": fmt, "T": t, "D": d, "variant": label, "us": 1e3 * ms}
            if rec is None:
                plain = ms
            else:
                written = [b.clone() for b in (out, low, scales)]
                first = first or written
                row["overhead_pct"] = 100 * (ms / plain - 1)
                row["same_bytes"] = all(torch.equal(a, b) for a, b in zip(written, first, strict=True))
            rows.append(row)
            print(json.dumps(row), flush=True)
        del x, out
    print(f"\nGPU: {torch.cuda.get_device_name()}  T={t} bf16 b=1\n")
    print("| format | D | variant | us | over no record | same bytes |\n|---|---|---|---|---|---|")
    for r in rows:
        over = f"{r['overhead_pct']:+.1f} %" if "overhead_pct" in r else "-"
        print(f"| {r['format']} | {r['D']} | {r['variant']} | {r['us']:.1f} | {over} | {r.get('same_bytes', '-')} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--t", type=int, default=65536)
    parser.add_argument("--d", type=int, default=4096)
    parser.add_argument("--tiles", action="store_true", help="also sweep the kv_fp4 block kernel's tile")
    parser.add_argument("--wide", type=int, nargs="+", metavar="D", help="only the record store comparison")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.wide:
        rows = wide(args.t, args.wide)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "T": args.t, "rows": rows}, f, indent=1)
        return
    t, d = args.t, args.d
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    rows = []
    for fmt in ("nvfp4", "kv_fp4"):
        low, scales, token = ops.record_buffers(t, d, fmt, 1, "cuda", per_token=fmt == "nvfp4")
        odd = torch.empty(t, low.shape[1] + 1, dtype=torch.uint8, device="cuda")[:, 1:]
        for kernel16 in (True, False):
            cases = {
                "no record": (out, None, 1, None),
                "record (2-byte stores)" if kernel16 else "record": (out, low, 2, None),
                "record only, no output": (None, low, 2, None),
            }
            if kernel16:
                cases["record (byte stores)"] = (out, odd, 1, None)
                # the no-record kernel's 32 registers (full occupancy at 8 warps): ptxas spills a few bytes
                cases["record (2-byte stores), at most 32 registers"] = (out, low, 2, 32)
            loops = (1, *ROW_LOOPS) if kernel16 else (1,)
            first = {}
            for (label, (o, rec, unit, regs)), loop in itertools.product(cases.items(), loops):
                if loop > 1 and label in ("record (byte stores)", "record (2-byte stores), at most 32 registers"):
                    continue
                ms = graph_ms(partial(launch, kernel16, x, fmt, o, rec, scales, token, unit, maxnreg=regs, loop=loop))
                written = [b.clone() for b in (o, rec, scales) if b is not None]
                row = {
                    "format": fmt,
                    "kernel": "block per thread" if kernel16 else "group per thread",
                    "variant": label if loop == 1 else f"{label}, {loop} row tiles per program",
                    "us": 1e3 * ms,
                }
                if loop == 1:
                    first[label] = written
                else:  # the same kernel math: every byte as with one tile per program
                    pairs = zip(written, first[label], strict=True)
                    row["equal_to_one_tile"] = all(torch.equal(a, b) for a, b in pairs)
                rows.append(row)  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    if args.tiles:
        low, scales, _ = ops.record_buffers(t, d, "kv_fp4", 1, "cuda")
        for tile in TILES:
            for label, rec in (("tile: no record", None), ("tile: record (2-byte stores)", low)):
                ms = graph_ms(partial(launch, True, x, "kv_fp4", out, rec, scales, None, 2, tile))
                rows.append({"format": "kv_fp4", "kernel": "block per thread", "variant": label, "tile": list(tile),
                             "us": 1e3 * ms})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
        swept = [r for r in rows if "tile" in r]
        plain = min(r["us"] for r in swept if r["variant"] == "tile: no record")
        recorded = min(r["us"] for r in swept if r["variant"] != "tile: no record")
        print(f"best tiles: no record {plain:.1f} us, record {recorded:.1f} us: +{100 * (recorded / plain - 1):.1f} %")
    print(f"\nGPU: {torch.cuda.get_device_name()}  T={t} D={d} bf16 b=1\n")
    print("| format | kernel | variant | tile (rows, columns, warps) | us |\n|---|---|---|---|---|")
    for r in rows:
        tile = tuple(r["tile"]) if "tile" in r else "default"
        same = {True: " (same bytes)", False: " (DIFFERENT bytes)"}.get(r.get("equal_to_one_tile"), "")
        print(f"| {r['format']} | {r['kernel']} | {r['variant']}{same} | {tile} | {r['us']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "T": t, "D": d, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
