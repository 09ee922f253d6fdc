"""Benchmark decode attention over SGLang's FP4 KV pool on a CUDA GPU; every ratio is measured within one run.

Three paths at the same batch, sequence lengths and pool (GQA 32 query / 4 KV heads, head dim 128 by default,
like Qwen3-30B-A3B on one GPU; requests on random slots of a pool of `--slots` slots, 8 KV splits):
- fp4: `fp4_decode_attention`, reading the packed codes and scale bytes directly;
- bf16: SGLang's triton `decode_attention_fwd` over a BF16 pool (the BF16-KV baseline);
- dequant: what SGLang does today with `--kv-cache-dtype fp4_e2m1` on the triton backend: `get_key_buffer` and
  `get_value_buffer` dequantize the whole layer (`KVFP4QuantizeUtil.batched_dequantize`), then the BF16 kernel.
Each path is captured in a CUDA graph and replayed (median, L2 flushed). The fp4 output is checked against the
dequant path's (bit for bit) before timing.

Usage: python bench/fp4_attention.py [--out results.json] [--slots 2097152] [--kv-heads 4]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import graph_ms
from tests.fp4_attention_checks import sglang_decode_attention, sglang_module
from trace_core.kernels.fp4_attention import fp4_decode_attention
from trace_core.kv_attention import dequantize_kv

CASES = [(1, 8192), (16, 4096), (64, 2048), (64, 8192), (256, 1024)]  # (batch, tokens per request)
SPLITS = 8  # SGLang's default --triton-attention-num-kv-splits


def dequant_decode(decode_attention_fwd, util, q, codes, scales, out, common) -> None:
    """SGLang's FP4-pool decode today: both layer buffers dequantized whole, then the BF16 kernel."""
    k = util.batched_dequantize(codes[0], scales[0])
    v = util.batched_dequantize(codes[1], scales[1])
    decode_attention_fwd(q, k, v, out, *common, 1.0, 1.0)


def run(slots: int, kv_heads: int, q_heads: int, d: int) -> list[dict]:
    decode_attention_fwd = sglang_decode_attention()
    KVFP4QuantizeUtil = sglang_module("srt/layers/quantization/kvfp4_tensor.py").KVFP4QuantizeUtil

    dev = "cuda"
    codes = [torch.randint(0, 256, (slots, kv_heads, d // 2), dtype=torch.uint8, device=dev) for _ in range(2)]
    scales = [torch.randint(118, 130, (slots, kv_heads * d // 16), dtype=torch.uint8, device=dev) for _ in range(2)]
    bf16 = [KVFP4QuantizeUtil.batched_dequantize(c, s) for c, s in zip(codes, scales, strict=True)]
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
        dequant_path = partial(dequant_decode, decode_attention_fwd, KVFP4QuantizeUtil, q, codes, scales,
                               outs["dequant"], common)  # fmt: skip

        fp4()
        dequant_path()
        # the BF16 kernel once more over the requests' slots dequantized by trace_core (eager), as a second witness
        compact = [dequantize_kv(c[indices], s[indices]) for c, s in zip(codes, scales, strict=True)]
        order = torch.arange(indices.numel(), device=dev)
        decode_attention_fwd(q, *compact, outs["eager"], indptr, order, logits, lse, nsplit, SPLITS, sm, 1.0, 1.0)
        diff = (outs["fp4"].float() - outs["dequant"].float()).abs()
        checks = {
            "fp4_equals_dequant_path": torch.equal(outs["fp4"], outs["dequant"]),
            "fp4_equals_eager_dequant": torch.equal(outs["fp4"], outs["eager"]),
            "dequant_equals_eager_dequant": torch.equal(outs["dequant"], outs["eager"]),
            "max_abs_diff": diff.max().item(),
            "unequal_fraction": (diff > 0).float().mean().item(),
            "max_abs_out": outs["dequant"].float().abs().max().item(),
        }
        t = {"fp4": graph_ms(fp4), "bf16": graph_ms(bf16_path), "dequant": graph_ms(dequant_path)}
        kv_bytes = 2 * batch * length * kv_heads * (d // 2 + d // 16)
        rows.append({
            "batch": batch, "tokens": length, "slots": slots, "kv_heads": kv_heads, "q_heads": q_heads, "head_dim": d,
            "fp4_us": 1e3 * t["fp4"], "bf16_us": 1e3 * t["bf16"], "dequant_path_us": 1e3 * t["dequant"],
            "fp4_over_bf16": t["fp4"] / t["bf16"], "dequant_over_fp4": t["dequant"] / t["fp4"],
            "fp4_kv_GBps": kv_bytes / t["fp4"] / 1e6, **checks,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    cols = [("batch", "{}"), ("tokens", "{}"), ("fp4_us", "{:.1f}"), ("bf16_us", "{:.1f}"),
            ("dequant_path_us", "{:.0f}"), ("fp4_over_bf16", "{:.2f}"), ("dequant_over_fp4", "{:.0f}"),
            ("fp4_kv_GBps", "{:.0f}"), ("fp4_equals_dequant_path", "{}"), ("fp4_equals_eager_dequant", "{}"),
            ("unequal_fraction", "{:.2g}"),
            ("max_abs_diff", "{:.3g}"), ("max_abs_out", "{:.3g}")]  # fmt: skip
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f.format(r[c]) for c, f in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--slots", type=int, default=2 * 1024 * 1024, help="KV pool slots (default 2M)")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    rows = run(args.slots, args.kv_heads, args.q_heads, args.head_dim)
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}\n")
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
