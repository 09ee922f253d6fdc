"""Benchmark the FP4 kernels on a CUDA GPU; every ratio is measured within one run.

For T in {1, 64, 4096, 65536} x D in {2048, 4096, 7168} and the nvfp4 (per-token) and kv_fp4 formats:
- quantize-and-record (b = 1): time, achieved GB/s (bytes read + written), ratio to a device-to-device copy of
  the same number of bytes;
- record emission overhead: quantize-and-record vs quantize-only (no record);
- guided vs RTN fake-quant, forward + backward (straight-through);
- speed-up over `torch.compile` of the pure-torch reference (the peer), for both ops.
Timing: `triton.testing.do_bench` (median, L2 flushed between runs).

Usage: python bench/kernels.py [--out results.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
import triton
import triton.testing

from trace_core.guided import GuidanceStats, guided_quantize
from trace_core.kernels import guided_fake_quant, ops, quantize_record, record_buffers, rtn_fake_quant
from trace_core.quant import dequantize, quantize
from trace_core.records import Record, pack_low_bits

BITS = 1
FORMATS = {"nvfp4": {"per_token": True}, "kv_fp4": {}}


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def copy_gbps(nbytes: int) -> float:
    """Device-to-device copy bandwidth (read + write counted) for a buffer of nbytes / 2."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench_ms(lambda: dst.copy_(src)) / 1e6


def reference_quantize_record(x, fmt, kwargs):
    q = quantize(x, fmt, **kwargs)
    return dequantize(q, x.dtype), pack_low_bits(q.codes, BITS), q.scales


def reference_guided(x, rec):
    q, _ = guided_quantize(x, rec, BITS)
    return dequantize(q, x.dtype)


def run_case(fmt: str, t: int, d: int, compiled: dict) -> dict:
    kwargs = FORMATS[fmt]
    per_token = kwargs.get("per_token", False)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    low, scales, token = record_buffers(t, d, fmt, BITS, "cuda", per_token=per_token)
    record_bytes = low.numel() + scales.numel() + (token.numel() * 4 if token is not None else 0)
    moved = 2 * x.numel() * 2 + record_bytes  # read x, write out (bf16), write the record

    def with_record():
        quantize_record(x, fmt, BITS, out=out, low_bits=low, scales=scales, token_scale=token, **kwargs)

    def without_record():
        quantize_record(x, fmt, BITS, out=out, **kwargs)

    t_rec, t_plain = bench_ms(with_record), bench_ms(without_record)
    with_record()
    rec = Record(fmt=quantize(x[:1], fmt, **kwargs).fmt, bits=BITS, n=d, low_bits=low, scales=scales,
                 global_scale=token)  # fmt: skip
    xg = x.clone().requires_grad_(True)
    grad = torch.randn_like(x)
    stats = GuidanceStats()

    def guided_step():
        guided_fake_quant(xg, rec, BITS, stats=stats).backward(grad)

    def rtn_step():
        rtn_fake_quant(xg, fmt, **kwargs).backward(grad)

    t_guided, t_rtn = bench_ms(guided_step), bench_ms(rtn_step)
    row = {
        "format": fmt,
        "T": t,
        "D": d,
        "quant_record_us": 1e3 * t_rec,
        "quant_record_GBps": moved / t_rec / 1e6,
        "copy_GBps": copy_gbps(moved),
        "record_overhead_pct": 100 * (t_rec / t_plain - 1),
        "guided_fwd_bwd_us": 1e3 * t_guided,
        "rtn_fwd_bwd_us": 1e3 * t_rtn,
        "guided_over_rtn": t_guided / t_rtn,
    }
    row["copy_ratio"] = row["quant_record_GBps"] / row["copy_GBps"]
    if "quant" in compiled and t >= 4096:
        t_peer_q = bench_ms(lambda: compiled["quant"](x, fmt, kwargs))
        t_peer_g = bench_ms(lambda: compiled["guided"](x, rec))
        row["speedup_vs_compiled_quant"] = t_peer_q / t_rec
        row["speedup_vs_compiled_guided"] = t_peer_g / bench_ms(lambda: guided_fake_quant(x, rec, BITS, stats=stats))
    return row


def markdown(rows: list[dict]) -> str:
    cols = [
        ("format", "{}"), ("T", "{}"), ("D", "{}"), ("quant_record_us", "{:.1f}"), ("quant_record_GBps", "{:.0f}"),
        ("copy_GBps", "{:.0f}"), ("copy_ratio", "{:.2f}"), ("record_overhead_pct", "{:+.1f}"),
        ("guided_over_rtn", "{:.2f}"), ("speedup_vs_compiled_quant", "{:.1f}"),
        ("speedup_vs_compiled_guided", "{:.1f}"),
    ]  # fmt: skip
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f.format(r[c]) if c in r else "-" for c, f in cols) + " |")
    return "\n".join(lines)


def tune(t: int = 65536, d: int = 4096) -> None:
    """Sweep the program tile (rows x chunk, warps) for both kernels; prints GB/s per configuration."""
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    results = []
    for fmt, kwargs in FORMATS.items():
        low, scales, token = record_buffers(t, d, fmt, BITS, "cuda", per_token=bool(kwargs))
        moved = 4 * x.numel() + low.numel() + scales.numel()
        for rows in (1, 2, 4, 8):
            for chunk in (512, 1024, 2048):
                for warps in (4, 8):
                    if rows * chunk > 16384:
                        continue
                    ops.LAUNCH.update(rows=rows, chunk=chunk, warps=warps)
                    quantize_record(x, fmt, BITS, out=out, low_bits=low, scales=scales, token_scale=token, **kwargs)
                    rec = Record(quantize(x[:1], fmt, **kwargs).fmt, BITS, d, low, scales, token)
                    t_q = bench_ms(
                        partial(quantize_record, x, fmt, BITS, out=out, low_bits=low, scales=scales,
                                token_scale=token, **kwargs)
                    )  # fmt: skip
                    t_g = bench_ms(partial(guided_fake_quant, x, rec, BITS, stats=GuidanceStats()))
                    results.append((fmt, rows, chunk, warps, moved / t_q / 1e6, moved / t_g / 1e6))
    for r in sorted(results, key=lambda r: (r[0], -r[4] - r[5])):
        fmt, rows, chunk, warps, gq, gg = r
        print(f"{fmt:<7} rows={rows:<3} chunk={chunk:<5} warps={warps}  quant+record {gq:6.0f} GB/s, guided {gg:6.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="T in {64, 4096}, D = 4096 only")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    parser.add_argument("--tune", action="store_true", help="sweep the kernels' program tile instead")
    args = parser.parse_args()
    if args.tune:
        tune()
        return
    ts, ds = ((64, 4096), (4096,)) if args.quick else ((1, 64, 4096, 65536), (2048, 4096, 7168))
    compiled = {}
    if not args.no_compile:
        compiled = {
            "quant": torch.compile(reference_quantize_record),
            "guided": torch.compile(reference_guided),
        }
    rows = [run_case(fmt, t, d, compiled) for fmt in FORMATS for t in ts for d in ds]
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}\n")
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
