"""Benchmark decode and extend attention over SGLang's FP4 KV pool on a CUDA GPU; every ratio is measured within
one run.

Three paths at the same batch, sequence lengths and pool (GQA 32 query / 4 KV heads, head dim 128 by default,
like Qwen3-30B-A3B on one GPU; requests on random slots of a pool of `--slots` slots; decode: 8 KV splits;
extend: each request's cached prefix in the pool and its new tokens' K/V in BF16, causal):
- fp4: `fp4_decode_attention` / `fp4_extend_attention`, reading the packed codes and scale bytes directly;
- bf16: SGLang's triton `decode_attention_fwd` / `extend_attention_fwd` over a BF16 pool (the BF16-KV baseline);
- dequant: what SGLang does today with `--kv-cache-dtype fp4_e2m1` on the triton backend: `get_key_buffer` and
  `get_value_buffer` dequantize the whole layer (`KVFP4QuantizeUtil.batched_dequantize`), then the BF16 kernel.
Each path is captured in a CUDA graph and replayed (median, L2 flushed). Before timing, the fp4 output is compared
with the dequant path's (equal, or the fraction that differs and by how much).

Usage: python bench/fp4_attention.py [--out results.json] [--phase decode extend] [--slots 2097152] [--kv-heads 4]
       [--launch '{"num_stages": 3}']
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import graph_ms, markdown, versions, write_json
from tests.fp4_attention_checks import sglang_decode_attention, sglang_extend_attention, sglang_module
from trace_core.kernels import fp4_attention as fa
from trace_core.kernels.fp4_attention import fp4_decode_attention
from trace_core.kernels.fp4_extend_attention import fp4_extend_attention
from trace_core.numerics.kv_attention import dequantize_kv

CASES = [(1, 8192), (16, 4096), (64, 2048), (64, 8192), (256, 1024)]  # (batch, tokens per request)
EXTEND_CASES = [(1, 8192, 512), (8, 4096, 512), (32, 2048, 128), (64, 1024, 32)]  # (batch, prefix, new tokens)
SPLITS = 8  # SGLang's default --triton-attention-num-kv-splits


def dequant_decode(decode_attention_fwd, util, q, codes, scales, out, common) -> None:
    """SGLang's FP4-pool decode today: both layer buffers dequantized whole, then the BF16 kernel."""
    k = util.batched_dequantize(codes[0], scales[0])
    v = util.batched_dequantize(codes[1], scales[1])
    decode_attention_fwd(q, k, v, out, *common, 1.0, 1.0)


def dequant_extend(extend_attention_fwd, util, q, k, v, codes, scales, out, common) -> None:
    """SGLang's FP4-pool extend today: both layer buffers dequantized whole, then the BF16 kernel."""
    kb = util.batched_dequantize(codes[0], scales[0])
    vb = util.batched_dequantize(codes[1], scales[1])
    extend_attention_fwd(q, k, v, out, kb, vb, *common)


def compare(fp4: torch.Tensor, dequant: torch.Tensor) -> dict:
    diff = (fp4.float() - dequant.float()).abs()
    return {
        "fp4_equals_dequant_path": torch.equal(fp4, dequant),
        "max_abs_diff": diff.max().item(),
        "unequal_fraction": (diff > 0).float().mean().item(),
        "max_abs_out": dequant.float().abs().max().item(),
    }


def pool(slots: int, kv_heads: int, d: int):
    """Random-byte FP4 pool layers (codes, scale bytes near 2^0) for K and V, their BF16 values, the dequantizer."""
    util = sglang_module("srt/layers/quantization/kvfp4_tensor.py").KVFP4QuantizeUtil
    codes = [torch.randint(0, 256, (slots, kv_heads, d // 2), dtype=torch.uint8, device="cuda") for _ in range(2)]
    scales = [torch.randint(118, 130, (slots, kv_heads * d // 16), dtype=torch.uint8, device="cuda") for _ in range(2)]
    bf16 = [util.batched_dequantize(c, s) for c, s in zip(codes, scales, strict=True)]
    return codes, scales, bf16, util


def run_extend(slots: int, kv_heads: int, q_heads: int, d: int) -> list[dict]:
    extend_attention_fwd = sglang_extend_attention()
    codes, scales, bf16, util = pool(slots, kv_heads, d)
    dev, rows = "cuda", []
    for batch, prefix, new in EXTEND_CASES:
        indices = torch.randperm(slots - 1, device=dev)[: batch * prefix] + 1
        kv_indptr = torch.arange(batch + 1, device=dev, dtype=torch.int32) * prefix
        qo_indptr = torch.arange(batch + 1, device=dev, dtype=torch.int32) * new
        q = torch.randn(batch * new, q_heads, d, dtype=torch.bfloat16, device=dev)
        k, v = (torch.randn(batch * new, kv_heads, d, dtype=torch.bfloat16, device=dev) for _ in range(2))
        outs = {p: torch.empty_like(q) for p in ("fp4", "bf16", "dequant")}
        common = (qo_indptr, kv_indptr, indices, None, True, None, new, 1.0, 1.0, 1 / math.sqrt(d))
        fp4 = partial(fp4_extend_attention, q, k, v, outs["fp4"], codes[0], scales[0], codes[1], scales[1], *common)
        bf16_path = partial(extend_attention_fwd, q, k, v, outs["bf16"], bf16[0], bf16[1], *common)
        dequant_path = partial(dequant_extend, extend_attention_fwd, util, q, k, v, codes, scales, outs["dequant"],
                               common)  # fmt: skip
        fp4()
        dequant_path()
        checks = compare(outs["fp4"], outs["dequant"])
        t = {"fp4": graph_ms(fp4), "bf16": graph_ms(bf16_path), "dequant": graph_ms(dequant_path)}
        rows.append({
            "phase": "extend", "batch": batch, "prefix": prefix, "new": new, "slots": slots, "kv_heads": kv_heads,
            "q_heads": q_heads, "head_dim": d, "fp4_us": 1e3 * t["fp4"], "bf16_us": 1e3 * t["bf16"],
            "dequant_path_us": 1e3 * t["dequant"], "fp4_over_bf16": t["fp4"] / t["bf16"],
            "dequant_over_fp4": t["dequant"] / t["fp4"], **checks,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def run(slots: int, kv_heads: int, q_heads: int, d: int) -> list[dict]:
    decode_attention_fwd = sglang_decode_attention()
    codes, scales, bf16, util = pool(slots, kv_heads, d)
    dev = "cuda"
    sm = 1 / math.sqrt(d)
    rows = []
    for batch, length in CASES:
        indices = torch.randperm(slots - 1, device=dev)[: batch * length] + 1
        indptr = torch.arange(batch + 1, device=dev, dtype=torch.int32) * length
        nsplit = torch.full((batch,), SPLITS, dtype=torch.int32, device=dev)
        q = torch.randn(batch, q_heads, d, dtype=torch.bfloat16, device=dev)
        logits = torch.empty(batch, q_heads, SPLITS, d, device=dev)
        lse = torch.empty(batch, q_heads, SPLITS, device=dev)
        outs = {k: torch.empty_like(q) for k in ("fp4", "bf16", "dequant", "eager")}

        common = (indptr, indices, logits, lse, nsplit, SPLITS, sm)
        fp4 = partial(fp4_decode_attention, q, codes[0], scales[0], codes[1], scales[1], outs["fp4"], *common)
        bf16_path = partial(decode_attention_fwd, q, bf16[0], bf16[1], outs["bf16"], *common, 1.0, 1.0)
        dequant_path = partial(dequant_decode, decode_attention_fwd, util, q, codes, scales,
                               outs["dequant"], common)  # fmt: skip

        fp4()
        dequant_path()
        # the BF16 kernel once more over the requests' slots dequantized by trace_core (eager), as a second witness
        compact = [dequantize_kv(c[indices], s[indices]) for c, s in zip(codes, scales, strict=True)]
        order = torch.arange(indices.numel(), device=dev)
        decode_attention_fwd(q, *compact, outs["eager"], indptr, order, logits, lse, nsplit, SPLITS, sm, 1.0, 1.0)
        checks = {
            **compare(outs["fp4"], outs["dequant"]),
            "fp4_equals_eager_dequant": torch.equal(outs["fp4"], outs["eager"]),
            "dequant_equals_eager_dequant": torch.equal(outs["dequant"], outs["eager"]),
        }
        t = {"fp4": graph_ms(fp4), "bf16": graph_ms(bf16_path), "dequant": graph_ms(dequant_path)}
        kv_bytes = 2 * batch * length * kv_heads * (d // 2 + d // 16)
        rows.append({
            "phase": "decode", "batch": batch, "tokens": length, "slots": slots, "kv_heads": kv_heads,
            "q_heads": q_heads, "head_dim": d,
            "fp4_us": 1e3 * t["fp4"], "bf16_us": 1e3 * t["bf16"], "dequant_path_us": 1e3 * t["dequant"],
            "fp4_over_bf16": t["fp4"] / t["bf16"], "dequant_over_fp4": t["dequant"] / t["fp4"],
            "fp4_kv_GBps": kv_bytes / t["fp4"] / 1e6, **checks,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    if not rows:
        return ""
    first = [("batch", "{}"), ("tokens", "{}")] if rows[0]["phase"] == "decode" else [
        ("batch", "{}"), ("prefix", "{}"), ("new", "{}")]  # fmt: skip
    cols = [*first, ("fp4_us", "{:.1f}"), ("bf16_us", "{:.1f}"),
            ("dequant_path_us", "{:.0f}"), ("fp4_over_bf16", "{:.2f}"), ("dequant_over_fp4", "{:.1f}"),
            *([("fp4_kv_GBps", "{:.0f}")] if rows[0]["phase"] == "decode" else []),
            ("fp4_equals_dequant_path", "{}"), ("unequal_fraction", "{:.2g}"),
            ("max_abs_diff", "{:.3g}"), ("max_abs_out", "{:.3g}")]  # fmt: skip
    return markdown(rows, cols)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--slots", type=int, default=2 * 1024 * 1024, help="KV pool slots (default 2M)")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--phase", nargs="+", choices=("decode", "extend"), default=["decode", "extend"])
    parser.add_argument("--launch", type=json.loads, default={},
                        help="JSON dict of grouped decode launch settings over fp4_attention.GROUPED_LAUNCH "
                             "(e.g. '{\"num_stages\": 3}'; bench/fp4_attention_launch.py compares them)")  # fmt: skip
    args = parser.parse_args()
    fa.GROUPED_LAUNCH.update(args.launch)
    print(f"grouped decode launch: {fa.GROUPED_LAUNCH}")
    shape = (args.slots, args.kv_heads, args.q_heads, args.head_dim)
    decode = run(*shape) if "decode" in args.phase else []
    extend = run_extend(*shape) if "extend" in args.phase else []
    rows = decode + extend
    print(versions() + "\n")
    print(table(decode) + "\n\n" + table(extend))
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "args": vars(args), "grouped_launch": fa.GROUPED_LAUNCH,
                          "rows": rows})  # fmt: skip


if __name__ == "__main__":
    main()
