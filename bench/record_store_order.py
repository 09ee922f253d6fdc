"""Where the kv_fp4 record's time went: variants of the block-per-thread quantize kernel, timed on a CUDA GPU.

kv_fp4, T = 65536 (BF16, b = 1, the default tile), graph-timed like bench/kernels.py. Each variant is the kernel
with the record stored after the output (`RECORD_FIRST` False, what `ops` launched before) and one change, made by
a text edit of `triton_fp4.py` (so the variants differ from it in that one place only):
- `record first`: `RECORD_FIRST` True, what `ops` launches now where a thread holds whole blocks;
- `record stores predicated off`: the record is computed, its stores never write (their mask is false);
- `scale store only` / `code store only`: one of the two record stores predicated off;
- `record .cs` / `output .cs`: streaming stores (`cache_modifier=".cs"`); `x loads evict_first`;
- the group-per-thread kernel with and without the record; 4 row tiles per program; the record rows all written to
  row 0 (stride 0: the same instructions, a record footprint of one row).
Each variant that writes the record is checked to write the same bytes as the first.
`--profile VARIANT ...` instead launches the named variants (suffix `:nr`: without the record) twice each, for
Nsight Compute to profile the second launch (see docs/performance.md).

Usage: python bench/record_store_order.py [--t 65536] [--d 4096 7168] [--out order.json]
       ncu --set full --import-source yes -k regex:_quantize_record --launch-skip N --launch-count N \\
           python bench/record_store_order.py --profile "output first" "output first:nr" ...
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import graph_ms
from trace_core.kernels import ops

SRC = (Path(__file__).resolve().parent.parent / "trace_core/kernels/triton_fp4.py").read_text()
SCALE_ST = "tl.store(scale_ptr + rows64[:, None] * scale_stride + blk, byte.to(tl.uint8), mask=bmask)"
CODE_ST = "wa, wb, bmask, BITS,"
CODE16 = "tl.store(rec.to(tl.pointer_type(tl.int16)), (wa | (wb << 8)).to(tl.int16), mask=mask)"
OUT_A = "tl.store(o, (_with_sign(qa, za) * decode[:, :, None]).to(ty), mask=m)"
OUT_B = "tl.store(o + 8, (_with_sign(qb, zb) * decode[:, :, None]).to(ty), mask=m)"
LD_A = "xa = tl.load(x_rows + c0 + offs, mask=m, other=0.0).to(tl.float32)"
LD_B = "xb = tl.load(x_rows + c0 + 8 + offs, mask=m, other=0.0).to(tl.float32)"
OFF = "bmask & (D < 0)"  # false at run time, unknown to the compiler

EDITS: dict[str, list[tuple[str, str]]] = {
    "output first": [],
    "record first": [],
    "record stores predicated off": [(SCALE_ST, SCALE_ST.replace("mask=bmask", f"mask={OFF}")),
                                     (CODE_ST, f"wa, wb, {OFF}, BITS,")],
    "scale store only": [(CODE_ST, f"wa, wb, {OFF}, BITS,")],
    "code store only": [(SCALE_ST, SCALE_ST.replace("mask=bmask", f"mask={OFF}"))],
    "record .cs": [(SCALE_ST, SCALE_ST.replace("mask=bmask)", 'mask=bmask, cache_modifier=".cs")')),
                   (CODE16, CODE16.replace("mask=mask)", 'mask=mask, cache_modifier=".cs")'))],
    "output .cs": [(OUT_A, OUT_A.replace("mask=m)", 'mask=m, cache_modifier=".cs")')),
                   (OUT_B, OUT_B.replace("mask=m)", 'mask=m, cache_modifier=".cs")'))],
    "x loads evict_first": [(LD_A, LD_A.replace("other=0.0)", 'other=0.0, eviction_policy="evict_first")')),
                            (LD_B, LD_B.replace("other=0.0)", 'other=0.0, eviction_policy="evict_first")'))],
}  # fmt: skip
"""Variant -> text edits of triton_fp4.py."""


def module(name: str):
    """triton_fp4.py with the variant's edits, loaded as a module of its own."""
    src = SRC
    for a, b in EDITS[name]:
        if a not in src:
            raise RuntimeError(f"{name}: {a[:60]!r} is no longer in triton_fp4.py")
        src = src.replace(a, b)
    path = Path(tempfile.gettempdir()) / f"triton_fp4_{name.replace(' ', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launcher(mod, x, out, low, scales, record: bool, first: bool = False, loop: int = 1, group: bool = False):
    """A no-argument launch of the kv_fp4 quantize kernel (block- or group-per-thread) on the default tile."""
    t, d = x.shape
    f = ops.get_format("kv_fp4")
    rb, chunk, warps = ops._launch_shape(f, d)
    grid = (triton.cdiv(t, rb * loop), triton.cdiv(d, chunk))
    f32 = torch.empty(1, dtype=torch.float32, device=x.device)
    args = (x, out, low, scales, f32, f32, t, d, x.stride(0), out.stride(0), low.stride(0), scales.stride(0), 1, 1)
    common = {"FMT": f.kernel_id, "SCALE_MODE": ops.SCALE_NONE, "BITS": int(record), "WRITE_OUT": True, "RB": rb,
              "C": chunk, "ONE_PASS": True, "num_warps": warps}  # fmt: skip
    if group:
        return lambda: mod._quantize_record_kernel[grid](*args, **common, BLOCK=16)
    return lambda: mod._quantize_record16_kernel[grid](*args, **common, REC_UNIT=2, RECORD_FIRST=first, ROW_LOOP=loop)


def buffers(t: int, d: int):
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    low, scales, _ = ops.record_buffers(t, d, "kv_fp4", 1, "cuda")
    return x, torch.empty_like(x), low, scales


def profile(t: int, specs: list[str]) -> None:
    x, out, low, scales = buffers(t, 4096)
    fns = []
    for spec in specs:
        name, record = (spec[:-3], False) if spec.endswith(":nr") else (spec, True)
        group = name == "group kernel"
        mod = module("output first" if group else name)
        fns.append((spec, launcher(mod, x, out, low, scales, record, name == "record first", group=group)))
    for phase in ("warm-up", "profiled"):  # the profiler skips the warm-up launches (compilation, first touch)
        for i, (spec, fn) in enumerate(fns):
            fn()
            torch.cuda.synchronize()
            print(f"{phase} launch {i}: {spec}", flush=True)


def timings(t: int, ds: list[int]) -> list[dict]:
    mods = {name: module(name) for name in EDITS}
    rows = []

    def row(d: int, variant: str, us: float, plain: float | None = None, **extra) -> None:
        rows.append({"D": d, "variant": variant, "us": us, **extra})
        if plain:
            rows[-1]["overhead_pct"] = 100 * (us / plain - 1)
        print(json.dumps(rows[-1]), flush=True)

    for d in ds:
        x, out, low, scales = buffers(t, d)
        plain = 1e3 * graph_ms(launcher(mods["output first"], x, out, low, scales, False))
        row(d, "no record", plain)
        ref = None
        for name, mod in mods.items():
            for b in (out, low, scales):
                b.zero_()
            us = 1e3 * graph_ms(launcher(mod, x, out, low, scales, True, name == "record first"))
            got = [b.clone() for b in (out, low, scales)]
            ref = ref or got
            stores = "predicated off" not in name and "only" not in name
            same = all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)) if stores else None
            row(d, name, us, plain, same_bytes=same)
        for record in (False, True):
            us = 1e3 * graph_ms(launcher(mods["output first"], x, out, low, scales, record, group=True))
            row(d, f"group kernel, {'record' if record else 'no record'}", us)
        us = 1e3 * graph_ms(launcher(mods["output first"], x, out, low, scales, True, loop=4))
        row(d, "output first, 4 row tiles per program", us, plain)
        lo0, sc0 = (torch.as_strided(b, b.shape, (0, 1)) for b in (low, scales))
        us = 1e3 * graph_ms(launcher(mods["output first"], x, out, lo0, sc0, True))
        row(d, "output first, record rows all at row 0", us, plain)
        del x, out
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--t", type=int, default=65536)
    parser.add_argument("--d", type=int, nargs="+", default=[4096, 7168])
    parser.add_argument("--profile", nargs="+", metavar="VARIANT")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.profile:
        profile(args.t, args.profile)
        return
    rows = timings(args.t, args.d)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "T": args.t, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
