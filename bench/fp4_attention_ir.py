"""Compile the grouped decode stage-1 kernels for Hopper (sm_90) without a GPU and print static cost indicators.

For the FP4 kernel (`trace_core.kernels.fp4_attention`, or an older copy of the file given by `--module`) and for
SGLang's BF16 kernel, at the bench's shape (32 query / 4 KV heads, head dim 128, BLOCK_N 32, BLOCK_H 16): the
dots' operand layouts (`kWidth` in the TTGIR: SGLang's BF16 loads give 2), the loads the software pipeline turns
into asynchronous copies, layout conversions, shared memory, and through the triton install's ptxas registers,
spills, and the instructions of the loop over key blocks (`bench.kernel_ir`). Use the triton version the GPU runs
(the counts differ between versions).

Usage: python bench/fp4_attention_ir.py [--module old/fp4_attention.py]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_ir import compile_kernel, load_module, ptxas_info
from tests.fp4_attention_checks import sglang_module
from trace_core.kernels import fp4_attention

SHAPE = dict(kv_group_num=8, q_head_num=32, BLOCK_N=32, BLOCK_H=16, MIN_BLOCK_KV=32, logit_cap=0.0,
             xai_temperature_len=-1, Lk=128)  # fmt: skip
COMMON = dict(Q="*bf16", kv_indptr="*i32", kv_indices="*i64", Att_Out="*fp32", Att_Lse="*fp32",
              num_kv_splits="*i32", sm_scale_withk="fp32")  # fmt: skip


def stats(compiled) -> dict:
    ttgir = compiled.asm["ttgir"]
    row = {
        "kWidth": sorted(set(re.findall(r"kWidth = (\d+)", ttgir))),
        "async copies": len(re.findall(r"async_copy_global_to_local", ttgir)),
        "convert_layout": len(re.findall(r"convert_layout", ttgir)),
        "shared_B": compiled.metadata.shared,
    }
    row.update(ptxas_info(compiled.asm["ptx"]))
    row.pop("stg_at", None)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", help="an fp4_attention.py to compile instead of the package's (old vs new)")
    args = parser.parse_args()
    fa = load_module(args.module) if args.module else fp4_attention
    words = hasattr(fa, "fp4_words")  # since the tile reads whole words: codes int32, scale bytes int32 at D = 128
    ptr = "*i32" if words else "*u8"
    fp4 = {name: ptr for name in ("K_Codes", "K_Scales", "V_Codes", "V_Scales")}
    sglang = sglang_module("srt/layers/attention/triton_ops/decode_attention.py")
    launches = [("SGLang's launch", {"num_warps": 4, "num_stages": 2})]
    if getattr(fa, "GROUPED_LAUNCH", launches[0][1]) != launches[0][1]:
        launches.append((f"GROUPED_LAUNCH {fa.GROUPED_LAUNCH}", fa.GROUPED_LAUNCH))
    rows = [(f"SGLang BF16, {launches[0][0]}", stats(compile_kernel(
        sglang._fwd_grouped_kernel_stage1,
        {**SHAPE, "BLOCK_DMODEL": 128, "BLOCK_DPE": 0, "BLOCK_DV": 128, "Lv": 128, **launches[0][1]},
        {**COMMON, "K_Buffer": "*bf16", "V_Buffer": "*bf16"})))]  # fmt: skip
    for label, launch in launches:
        kernel = fa._fp4_grouped_kernel_stage1
        constexprs = {**SHAPE, "BLOCK_DMODEL": 128, "KV_DTYPE": tl.bfloat16, **launch}
        rows.append((f"FP4 {Path(args.module).name if args.module else 'package'}, {label}",
                     stats(compile_kernel(kernel, constexprs, {**COMMON, **fp4}))))  # fmt: skip
    print(f"triton {triton.__version__}, target sm_90")
    header = ["kernel", "kWidth", "async copies", "convert_layout", "shared_B", "n_regs", "n_spills", "sass_instr",
              "loop_sass", "loop_ldg_stg"]  # fmt: skip
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for label, row in rows:
        print("| " + " | ".join([label] + [str(row.get(h, "-")) for h in header[1:]]) + " |")


if __name__ == "__main__":
    main()
