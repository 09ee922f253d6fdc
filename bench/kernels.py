"""Benchmark the FP4 kernels on a CUDA GPU; every ratio is measured within one run.

For T in {1, 64, 4096, 65536} x D in {2048, 4096, 7168} and the nvfp4 (per-token) and kv_fp4 formats (or those
of `--formats`: the E8M0 formats mxfp4 and mxfp4_ocp too):
- quantize-and-record (b = 1): time, achieved GB/s (bytes read + written), ratio to a device-to-device copy of
  the same number of bytes;
- record emission overhead: quantize-and-record vs quantize-only (no record);
- guided vs RTN fake-quant, forward + backward (straight-through): eager (Python dispatch and autograd included,
  CPU-bound at small T) and captured in a CUDA graph (the kernels alone), and forward only (graph), on the
  rollout's x moved by 2 % of its row amax (so that guidance redirects some elements: `redirected_fraction`);
- speed-up over `torch.compile` of the pure-torch reference (the peer), for both ops.
Timing: `triton.testing.do_bench` (median, L2 flushed between runs).

Usage: python bench/kernels.py [--out results.json] [--quick] [--t 4096 65536] [--d 2048 4096 7168] [--no-compile]
       [--formats nvfp4 kv_fp4 mxfp4 mxfp4_ocp]
       python bench/kernels.py --guided-row-loops 1 4 [--t 65536] [--d 4096 7168]
       python bench/kernels.py --tune [--tune-out best.json] [--tune-kernels quant guided] [--d 2048 4096 7168]
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

from bench.common import bench_ms, copy_gbps, graph_ms, markdown, versions, write_json
from trace_core.kernels import guided_fake_quant, kernel_rtn_fake_quant, launch, quantize_record, record_buffers
from trace_core.numerics.guided import GuidanceStats, guided_quantize
from trace_core.numerics.quant import dequantize, quantize
from trace_core.records.spec import Record, pack_low_bits

BITS = 1
FORMATS = {"nvfp4": {"per_token": True}, "kv_fp4": {}}  # the default formats, and the ones `--tune` sweeps over
MORE_FORMATS = {"mxfp4": {}, "mxfp4_ocp": {}}  # the 32-element E8M0 formats, timed on request (`--formats`)


def reference_quantize_record(x, fmt, kwargs):
    q = quantize(x, fmt, **kwargs)
    return dequantize(q, x.dtype), pack_low_bits(q.codes, BITS), q.scales


def reference_guided(x, rec):
    q, _ = guided_quantize(x, rec, BITS)
    return dequantize(q, x.dtype)


def redirected_fraction(x: torch.Tensor, rec: Record) -> float:
    """Fraction of x's elements that guidance by `rec` moves off their RTN point (one eager call)."""
    stats = GuidanceStats()
    guided_fake_quant(x, rec, BITS, stats=stats)
    return int(stats.redirected) / x.numel()


def run_case(fmt: str, t: int, d: int, compiled: dict) -> dict:
    kwargs = (FORMATS | MORE_FORMATS)[fmt]
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

    t_rec, t_plain = graph_ms(with_record), graph_ms(without_record)
    with_record()
    rec = Record(fmt=quantize(x[:1], fmt, **kwargs).fmt, bits=BITS, n=d, low_bits=low, scales=scales,
                 global_scale=token)  # fmt: skip
    # the trainer's input: the rollout's x moved by 2 % of its row amax, so that guidance redirects some elements
    xt = (x.float() + 0.02 * x.float().abs().amax(-1, keepdim=True) * torch.randn_like(x, dtype=torch.float32)).to(
        x.dtype
    )
    xg = xt.clone().requires_grad_(True)
    grad = torch.randn_like(x)
    stats = GuidanceStats()

    def guided_step():
        guided_fake_quant(xg, rec, BITS, stats=stats).backward(grad)

    def rtn_step():
        kernel_rtn_fake_quant(xg, fmt, **kwargs).backward(grad)

    t_guided, t_rtn = bench_ms(guided_step), bench_ms(rtn_step)
    t_guided_graph, t_rtn_graph = graph_ms(guided_step), graph_ms(rtn_step)
    t_guided_fwd = graph_ms(lambda: guided_fake_quant(xt, rec, BITS, stats=stats))
    t_rtn_fwd = graph_ms(lambda: kernel_rtn_fake_quant(xt, fmt, **kwargs))
    row = {
        "format": fmt,
        "T": t,
        "D": d,
        "quant_record_us": 1e3 * t_rec,
        "quant_plain_us": 1e3 * t_plain,
        "quant_record_GBps": moved / t_rec / 1e6,
        "copy_GBps": copy_gbps(moved),
        "record_overhead_pct": 100 * (t_rec / t_plain - 1),
        "guided_fwd_bwd_us": 1e3 * t_guided,
        "rtn_fwd_bwd_us": 1e3 * t_rtn,
        "guided_over_rtn": t_guided / t_rtn,
        "guided_fwd_bwd_graph_us": 1e3 * t_guided_graph,
        "rtn_fwd_bwd_graph_us": 1e3 * t_rtn_graph,
        "guided_over_rtn_graph": t_guided_graph / t_rtn_graph,
        "guided_over_rtn_fwd": t_guided_fwd / t_rtn_fwd,
        "redirected_fraction": redirected_fraction(xt, rec),
    }
    row["copy_ratio"] = row["quant_record_GBps"] / row["copy_GBps"]
    if "quant" in compiled and t >= 4096:
        t_peer_q = bench_ms(lambda: compiled["quant"](x, fmt, kwargs))
        t_peer_g = bench_ms(lambda: compiled["guided"](xt, rec))
        row["speedup_vs_compiled_quant"] = t_peer_q / t_rec
        row["speedup_vs_compiled_guided"] = t_peer_g / bench_ms(lambda: guided_fake_quant(xt, rec, BITS, stats=stats))
    return row


COLUMNS = [
    ("format", "{}"), ("T", "{}"), ("D", "{}"), ("quant_record_us", "{:.1f}"), ("quant_plain_us", "{:.1f}"),
    ("quant_record_GBps", "{:.0f}"),
    ("copy_GBps", "{:.0f}"), ("copy_ratio", "{:.2f}"), ("record_overhead_pct", "{:+.1f}"),
    ("guided_over_rtn", "{:.2f}"), ("guided_over_rtn_graph", "{:.2f}"), ("guided_over_rtn_fwd", "{:.2f}"),
    ("redirected_fraction", "{:.3f}"),
    ("speedup_vs_compiled_quant", "{:.1f}"),
    ("speedup_vs_compiled_guided", "{:.1f}"),
]  # fmt: skip
"""The report's columns (`bench.common.markdown`)."""


QUANT_TILES = [(1, 1024, 4), (1, 2048, 4), (1, 2048, 8), (1, 4096, 8), (1, 4096, 16), (2, 1024, 4), (2, 2048, 8)]
GUIDED_TILES = [(1, 1024, 4), (1, 2048, 4), (1, 2048, 8), (1, 4096, 8), (2, 1024, 4), (2, 2048, 8), (4, 512, 4)]


def tune(
    t: int = 65536,
    ds: tuple[int, ...] = (2048, 4096, 7168),
    out: str | None = None,
    kernels: tuple[str, ...] = ("quant", "guided"),
) -> dict:
    """Sweep each kernel's program tile (rows x chunk, warps; `row_chunk` for per-token nvfp4) at T = `t`, graph-
    timed; the best tile per kernel minimizes the summed time over formats and widths (quantize: with and without
    the record). Prints every configuration, returns (and writes to `out`) the best as a `TRACE_FP4_LAUNCH` JSON."""
    saved = {k: dict(v) for k, v in launch.LAUNCH.items()}
    cases = []
    for d in ds:
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        for fmt, kwargs in FORMATS.items():
            low, scales, token = record_buffers(t, d, fmt, BITS, "cuda", per_token=bool(kwargs))
            quantize_record(x, fmt, BITS, low_bits=low, scales=scales, token_scale=token, **kwargs)
            rec = Record(quantize(x[:1], fmt, **kwargs).fmt, BITS, d, low, scales, token)
            cases.append((fmt, d, x, kwargs, low, scales, token, rec))
    totals: dict[tuple, float] = {}
    for kernel, tiles in ((k, {"quant": QUANT_TILES, "guided": GUIDED_TILES}[k]) for k in kernels):
        row_chunks = (4096, 8192) if kernel == "quant" else (None,)
        for (rows, chunk, warps), row_chunk in itertools.product(tiles, row_chunks):
            launch.LAUNCH[kernel].update(rows=rows, chunk=chunk, warps=warps)
            if row_chunk:
                launch.LAUNCH[kernel]["row_chunk"] = row_chunk
            total = 0.0
            for fmt, d, x, kwargs, low, scales, token, rec in cases:
                if kernel == "quant":
                    out_ = torch.empty_like(x)
                    record = {"low_bits": low, "scales": scales, "token_scale": token}
                    ms = graph_ms(partial(quantize_record, x, fmt, BITS, out=out_, **record, **kwargs))
                    ms += graph_ms(partial(quantize_record, x, fmt, BITS, out=out_, **kwargs))
                else:
                    ms = graph_ms(partial(guided_fake_quant, x, rec, BITS, stats=GuidanceStats()))
                total += ms
                print(f"{kernel:<7}{fmt:<8}D={d:<6}rows={rows} chunk={chunk:<5} warps={warps:<3}"
                      f"row_chunk={row_chunk}  {1e3 * ms:8.1f} us", flush=True)  # fmt: skip
            totals[(kernel, rows, chunk, warps, row_chunk)] = total
        launch.LAUNCH[kernel].clear()
        launch.LAUNCH[kernel].update(saved[kernel])
    best = {}
    for kernel in kernels:
        ranked = sorted((v, k) for k, v in totals.items() if k[0] == kernel)
        for v, k in ranked:
            print(f"{kernel} total {1e3 * v:9.1f} us  rows={k[1]} chunk={k[2]} warps={k[3]} row_chunk={k[4]}")
        _, (_, rows, chunk, warps, row_chunk) = ranked[0]
        best[kernel] = {"rows": rows, "chunk": chunk, "warps": warps} | ({"row_chunk": row_chunk} if row_chunk else {})
    print("best:", json.dumps(best))
    if out:
        write_json(out, best, indent=None)
    return best


def _fwd_bwd(op, x: torch.Tensor, grad: torch.Tensor, *args, **kwargs) -> None:
    op(x, *args, **kwargs).backward(grad)


def guided_row_loops(t: int, ds: list[int], loops: list[int]) -> list[dict]:
    """Guided fwd + bwd (graph) over RTN's at nvfp4 per token, T = `t`, for each `LAUNCH["guided"]["row_loop"]` in
    `loops` (row tiles per guided program, one redirected-count add per program), on the moved x of `run_case`."""
    rows, saved = [], launch.LAUNCH["guided"]["row_loop"]
    for d in ds:
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        low, scales, token = record_buffers(t, d, "nvfp4", BITS, "cuda", per_token=True)
        quantize_record(x, "nvfp4", BITS, per_token=True, low_bits=low, scales=scales, token_scale=token)
        rec = Record(quantize(x[:1], "nvfp4", per_token=True).fmt, BITS, d, low, scales, token)
        noise = 0.02 * x.float().abs().amax(-1, keepdim=True) * torch.randn_like(x, dtype=torch.float32)
        xg = (x.float() + noise).to(x.dtype).requires_grad_(True)
        grad, stats = torch.randn_like(x), GuidanceStats()
        rtn = graph_ms(partial(_fwd_bwd, kernel_rtn_fake_quant, xg, grad, "nvfp4", per_token=True))
        for loop in loops:
            launch.LAUNCH["guided"]["row_loop"] = loop
            guided = graph_ms(partial(_fwd_bwd, guided_fake_quant, xg, grad, rec, BITS, stats=stats))
            rows.append({"T": t, "D": d, "row_loop": loop, "guided_us": 1e3 * guided, "rtn_us": 1e3 * rtn,
                         "guided_over_rtn_graph": guided / rtn})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    launch.LAUNCH["guided"]["row_loop"] = saved
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="T in {64, 4096}, D = 4096 only")
    parser.add_argument("--t", type=int, nargs="+", help="token counts (default 1 64 4096 65536)")
    parser.add_argument("--d", type=int, nargs="+", help="row widths (default 2048 4096 7168)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS | MORE_FORMATS),
                        help="formats to time (default nvfp4 kv_fp4)")  # fmt: skip
    parser.add_argument("--tune", action="store_true", help="sweep the kernels' program tiles instead")
    parser.add_argument("--tune-out", help="with --tune: write the best tiles here (TRACE_FP4_LAUNCH JSON)")
    parser.add_argument("--tune-kernels", nargs="+", default=["quant", "guided"], choices=["quant", "guided"],
                        help="with --tune: the kernels to sweep")  # fmt: skip
    parser.add_argument("--guided-row-loops", type=int, nargs="+", help="only compare guided row_loop values")
    args = parser.parse_args()
    if args.guided_row_loops:
        rows = guided_row_loops((args.t or [65536])[0], args.d or [4096, 7168], args.guided_row_loops)
        write_json(args.out, {"gpu": torch.cuda.get_device_name(), "rows": rows})
        return
    if args.tune:
        tune(ds=tuple(args.d or (2048, 4096, 7168)), out=args.tune_out, kernels=tuple(args.tune_kernels))
        return
    ts, ds = ((64, 4096), (4096,)) if args.quick else ((1, 64, 4096, 65536), (2048, 4096, 7168))
    ts, ds = args.t or ts, args.d or ds
    compiled = {}
    if not args.no_compile:
        compiled = {
            "quant": torch.compile(reference_quantize_record),
            "guided": torch.compile(reference_guided),
        }
    rows = [run_case(fmt, t, d, compiled) for fmt in args.formats for t in ts for d in ds]
    print(versions() + "\n")
    print(markdown(rows, COLUMNS))
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows})


if __name__ == "__main__":
    main()
