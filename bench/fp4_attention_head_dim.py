"""Where the FP4 decode kernel goes wrong at small head dims, on a CUDA GPU: variants against the pure-torch twin.

For head dims 16, 32 and 64, GQA (2 query heads per KV head: the grouped stage-1 kernel) and MHA, on one random
FP4 pool, the largest |difference| to `decode_attention_reference` of:
- `fp4`: `fp4_decode_attention` as launched (on CUDA the grouped kernel pads head dim 16 to a 32-column tile);
- `tile D, N warps`: the grouped stage-1 kernel with its tile as wide as the head dim (unpadded), 1, 2 or 4 warps;
- `sglang bf16`: SGLang's triton decode on the dequantized buffer (its own kernels at that head dim);
for the dequantized tile alone (`_fp4_tile`, [32, D]), the largest |difference| to `dequantize_kv`; and for the
kernel's two dots alone on that unpadded tile (`_two_dots_kernel`), their largest error relative to FP64.
Which of them fail at a head dim places the fault: the dequantization, one of the two dots as compiled for that
tile, or the attention kernels of either side at that size.

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


@triton.jit
def _two_dots_kernel(q_ptr, codes, scales, loc_ptr, qk_out, pv_out, stride_cs, stride_ch, stride_ss, D: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, KV_DTYPE: tl.constexpr):  # fmt: skip
    """The stage-1 kernel's two dots alone, on one tile as both K and V: qk = q . k^T (K tile transposed for the
    dot, as in the kernel), then qk in KV_DTYPE (its accumulator layout fed to the second dot, as p is) times v."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + offs_h[:, None] * D + offs_d[None, :])
    loc = tl.load(loc_ptr + offs_n)
    k = fa._fp4_tile(codes, scales, loc, 0, stride_cs, stride_ch, stride_ss, offs_n < BLOCK_N, D, BLOCK_N, KV_DTYPE)
    qk = tl.dot(q, tl.trans(k).to(q.dtype))
    tl.store(qk_out + offs_h[:, None] * BLOCK_N + offs_n[None, :], qk)
    pv = tl.dot(qk.to(k.dtype), k)
    tl.store(pv_out + offs_h[:, None] * D + offs_d[None, :], pv)


def two_dots(kc, ks, kb, loc, d: int) -> tuple[float, float]:
    """Relative max errors of `_two_dots_kernel`'s q . k^T against FP64 on the same values, and of its p . v against
    FP64 on the kernel's own qk rounded to the KV dtype."""
    gen = torch.Generator().manual_seed(5)
    q = (torch.randn(16, d, generator=gen) * 0.1).to(DTYPE).to(DEVICE)
    qk = torch.full((16, 32), float("nan"), device=DEVICE)
    pv = torch.full((16, d), float("nan"), device=DEVICE)
    kc, ks = fa.fp4_words(kc, ks)
    strides = (kc.stride(0), kc.stride(1), ks.stride(0))
    _two_dots_kernel[(1,)](q, kc, ks, loc, qk, pv, *strides, D=d, BLOCK_N=32, BLOCK_H=16,
                           KV_DTYPE=fa.KV_DTYPES[DTYPE])  # fmt: skip
    k = kb[loc, 0].double()
    want_qk = q.double() @ k.T
    want_pv = qk.to(DTYPE).double() @ k

    def rel(a, b):
        return ((a.double() - b).abs().max() / b.abs().max()).item()

    return rel(qk, want_qk), rel(pv, want_pv)


def grouped_stage1(q, kc, ks, vc, vs, indptr, indices, nsplit, logits, lse, sm, warps: int) -> None:
    """The grouped stage-1 kernel as `fp4_decode_attention` launches it, but with a tile as wide as the head dim
    and `warps` warps."""
    group = q.shape[1] // kc.shape[1]
    (kc, ks), (vc, vs) = fa.fp4_words(kc, ks), fa.fp4_words(vc, vs)
    grid = (q.shape[0], triton.cdiv(q.shape[1], min(16, group)), logits.shape[2])
    fa._fp4_grouped_kernel_stage1[grid](
        q, kc, ks, vc, vs, sm, indptr, indices, logits, lse, nsplit, q.stride(0), q.stride(1), kc.stride(0),
        kc.stride(1), ks.stride(0), vc.stride(0), vc.stride(1), vs.stride(0), logits.stride(0), logits.stride(1),
        logits.stride(2), kv_group_num=group, q_head_num=q.shape[1], BLOCK_DMODEL=q.shape[2], BLOCK_N=32, BLOCK_H=16,
        MIN_BLOCK_KV=fa.MIN_BLOCK_KV, logit_cap=0.0, xai_temperature_len=-1, KV_DTYPE=fa.KV_DTYPES[DTYPE],
        Lk=q.shape[2], **{**fa.GROUPED_LAUNCH, "num_warps": warps},
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

    logits, lse, o = buffers()
    fa.fp4_decode_attention(q, kc, ks, vc, vs, o, indptr, indices, logits, lse, nsplit, ms, sm, kv_dtype=DTYPE)
    row["fp4"] = diff(o)
    if group > 1:
        for warps in (1, 2, 4):
            logits, lse, o = buffers()
            grouped_stage1(q, kc, ks, vc, vs, indptr, indices, nsplit, logits, lse, sm, warps)
            fa._fwd_kernel_stage2[(b, hq)](
                logits, lse, o, 1.0, indptr, nsplit, None, logits.stride(0), logits.stride(1), logits.stride(2),
                o.stride(0), o.stride(1), MAX_KV_SPLITS=ms, MIN_BLOCK_KV=fa.MIN_BLOCK_KV, BLOCK_DV=d, Lv=d,
                HAS_SINK=False, num_warps=4, num_stages=2,
            )  # fmt: skip
            row[f"tile D, {warps} warps"] = diff(o)
    logits, lse, o = buffers()
    kb, vb = dequantize_kv(kc, ks, DTYPE), dequantize_kv(vc, vs, DTYPE)
    sglang_decode_attention()(q, kb, vb, o, indptr, indices, logits, lse, nsplit, ms, sm, 1.0, 1.0)
    row["sglang bf16"] = diff(o)
    loc = indices[:32].contiguous()
    tile = torch.full((32, d), float("nan"), dtype=DTYPE, device=DEVICE)
    kw, sw = fa.fp4_words(kc, ks)
    _tile_kernel[(1,)](kw, sw, loc, tile, kw.stride(0), kw.stride(1), sw.stride(0), D=d, BLOCK_N=32,
                       KV_DTYPE=fa.KV_DTYPES[DTYPE])  # fmt: skip
    row["tile"] = (tile.float() - kb[loc, 0].float()).abs().max().item()
    row["q.k^T (rel)"], row["p.v (rel)"] = two_dots(kc, ks, kb, loc, d)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = [run(d, group) for d in (16, 32, 64) for group in (2, 1)]
    cols = ["head_dim", "q_heads_per_kv_head", "fp4", "tile D, 1 warps", "tile D, 2 warps", "tile D, 4 warps",
            "sglang bf16", "tile", "q.k^T (rel)", "p.v (rel)"]  # fmt: skip
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
