"""Where the FP4 decode kernel goes wrong at small head dims, on a CUDA GPU: variants against the pure-torch twin.

For head dims 16, 32 and 64, GQA (2 query heads per KV head: the grouped stage-1 kernel) and MHA, on one random
FP4 pool, the largest |difference| to `decode_attention_reference` of:
- `fp4 (4 warps)`: `fp4_decode_attention` as launched;
- `fp4 (1 warp)`, `fp4 (2 warps)`: the same stage-1 kernel launched with fewer warps (GQA);
- `sglang bf16`: SGLang's triton decode on the dequantized buffer (its own kernels at that head dim);
and, for the dequantized tile alone (`_fp4_tile`, [32, D]), the largest |difference| to `dequantize_kv`.
Which of them fail at a head dim places the fault: the dequantization, the stage-1 kernel's compiled layout for
that tile (the warp count changes it), or the attention kernels of either side at that size.

Usage: python bench/fp4_attention_head_dim.py [--out head_dim.json] [--device cpu (under TRITON_INTERPRET=1)]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fp4_attention_checks import make_case, sglang_decode_attention
from trace_core.kernels import fp4_attention as fa
from trace_core.kv_attention import decode_attention_reference, dequantize_kv

LENS, SPLITS = [6, 9, 70], [8, 8, 8]
DEVICE, DTYPE = "cuda", torch.bfloat16  # --device cpu (TRITON_INTERPRET=1): a smoke run of this script, in FP32


@triton.jit
def _tile_kernel(codes, scales, loc_ptr, out, stride_cs, stride_ch, stride_ss, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 KV_DTYPE: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, BLOCK_N)
    loc = tl.load(loc_ptr + offs)
    v = fa._fp4_tile(codes, scales, loc, 0, stride_cs, stride_ch, stride_ss, offs < BLOCK_N, D, BLOCK_N, KV_DTYPE)
    tl.store(out + offs[:, None] * D + tl.arange(0, D)[None, :], v)


def grouped_stage1(q, kc, ks, vc, vs, indptr, indices, nsplit, logits, lse, sm, warps: int) -> None:
    """The grouped stage-1 kernel as `fp4_decode_attention` launches it, with `warps` warps."""
    group = q.shape[1] // kc.shape[1]
    grid = (q.shape[0], triton.cdiv(q.shape[1], min(16, group)), logits.shape[2])
    fa._fp4_grouped_kernel_stage1[grid](
        q, kc, ks, vc, vs, sm, indptr, indices, logits, lse, nsplit, q.stride(0), q.stride(1), kc.stride(0),
        kc.stride(1), ks.stride(0), vc.stride(0), vc.stride(1), vs.stride(0), logits.stride(0), logits.stride(1),
        logits.stride(2), kv_group_num=group, q_head_num=q.shape[1], BLOCK_DMODEL=q.shape[2], BLOCK_N=32, BLOCK_H=16,
        MIN_BLOCK_KV=fa.MIN_BLOCK_KV, logit_cap=0.0, xai_temperature_len=-1, KV_DTYPE=fa.KV_DTYPES[DTYPE],
        num_warps=warps, num_stages=2,
    )  # fmt: skip


def run(d: int, group: int) -> dict:
    q, kc, ks, vc, vs, indptr, indices, nsplit = make_case(2, group, d, LENS, SPLITS, DTYPE, DEVICE)
    b, hq, ms = q.shape[0], q.shape[1], max(SPLITS)
    sm = 1 / math.sqrt(d)
    ref = decode_attention_reference(q, kc, ks, vc, vs, indptr, indices, nsplit, sm, kv_dtype=DTYPE)
    row: dict = {"head_dim": d, "q_heads_per_kv_head": group}

    def buffers():
        return (torch.full((b, hq, ms, d), float("nan"), device=DEVICE), torch.full((b, hq, ms), float("nan"),
                device=DEVICE), torch.full_like(q, float("nan")))  # fmt: skip

    def diff(o):
        return (o.float() - ref.float()).abs().max().item()

    saved = fa.MIN_HEAD_DIM
    fa.MIN_HEAD_DIM = 16  # the refusal is what this measures
    try:
        logits, lse, o = buffers()
        fa.fp4_decode_attention(q, kc, ks, vc, vs, o, indptr, indices, logits, lse, nsplit, ms, sm, kv_dtype=DTYPE)
        row["fp4 (4 warps)"] = diff(o)
        if group > 1:
            for warps in (1, 2):
                logits, lse, o = buffers()
                grouped_stage1(q, kc, ks, vc, vs, indptr, indices, nsplit, logits, lse, sm, warps)
                fa._fwd_kernel_stage2[(b, hq)](
                    logits, lse, o, 1.0, indptr, nsplit, None, logits.stride(0), logits.stride(1), logits.stride(2),
                    o.stride(0), o.stride(1), MAX_KV_SPLITS=ms, MIN_BLOCK_KV=fa.MIN_BLOCK_KV, BLOCK_DV=d, Lv=d,
                    HAS_SINK=False, num_warps=4, num_stages=2,
                )  # fmt: skip
                row[f"fp4 ({warps} warp{'s' if warps > 1 else ''})"] = diff(o)
    finally:
        fa.MIN_HEAD_DIM = saved
    logits, lse, o = buffers()
    kb, vb = dequantize_kv(kc, ks, DTYPE), dequantize_kv(vc, vs, DTYPE)
    sglang_decode_attention()(q, kb, vb, o, indptr, indices, logits, lse, nsplit, ms, sm, 1.0, 1.0)
    row["sglang bf16"] = diff(o)
    loc = indices[:32].contiguous()
    tile = torch.full((32, d), float("nan"), dtype=DTYPE, device=DEVICE)
    strides = (kc.stride(0), kc.stride(1), ks.stride(0))
    _tile_kernel[(1,)](kc, ks, loc, tile, *strides, D=d, BLOCK_N=32, KV_DTYPE=fa.KV_DTYPES[DTYPE])
    row["tile"] = (tile.float() - kb[loc, 0].float()).abs().max().item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = [run(d, group) for d in (16, 32, 64) for group in (2, 1)]
    cols = ["head_dim", "q_heads_per_kv_head", "fp4 (4 warps)", "fp4 (1 warp)", "fp4 (2 warps)", "sglang bf16", "tile"]
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"GPU: {gpu}  triton {triton.__version__}  max |out - twin| (tile: vs dequantized)")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols]
        print("| " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": gpu, "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
