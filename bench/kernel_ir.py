"""Compile the FP4 Triton kernels for Hopper (sm_90) without a GPU and print static cost indicators.

Per kernel configuration: layout conversions (`convert_layout`) and shared-memory ops (`local_alloc`,
`local_load`, `local_store`) in the TTGIR, shared memory bytes, PTX instruction count (body lines that are
instructions) and a hash of them (`ptx_sha`: equal kernels from different `--module` sources), and, when the
triton install ships ptxas (and cuobjdump), registers, spill bytes, the static SASS instruction count, and the
instructions and global loads / stores of the widest loop's body (`outer_loop`), also per 16 elements a thread
handles in it, and each global store as width@position in the SASS (`stg_at`).

`--attention`: the grouped decode stage-1 kernels instead, the FP4 one (`trace_core.kernels.fp4_attention`, or an
older copy of that file given by `--module`) and SGLang's BF16 one, at the attention bench's shape (32 query / 4 KV
heads, head dim 128, BLOCK_N 32, BLOCK_H 16): the dots' operand layouts (`kWidth` in the TTGIR: SGLang's BF16 loads
give 2), the loads the software pipeline turns into asynchronous copies, layout conversions, shared memory,
registers, spills, and the instructions of the loop over key blocks.

The local triton may be newer than the GPU's, so the counts are indicative; compare kernel versions with the same
triton (for the attention kernels, the one the GPU runs).

Usage: python bench/kernel_ir.py [--module path/to/triton_fp4.py] [--d 4096] [--rows R --chunk C --warps W]
       [--dump DIR]
       python bench/kernel_ir.py --attention [--module old/fp4_attention.py]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import re
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from tests.sm90 import compile_kernel, ptxas_info
from trace_core.kernels import launch, triton_token_groups
from trace_core.kernels.launch import ScaleMode
from trace_core.numerics.formats import get_format


def load_module(path: str | None):
    """The package's `triton_fp4` module, or the kernel file at `path` (another version of a kernel module)."""
    if path is None:
        from trace_core.kernels import triton_fp4

        return triton_fp4
    spec = importlib.util.spec_from_file_location("triton_fp4_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def configs(mod, d: int, rows: int | None, chunk: int | None, warps: int | None) -> list[tuple]:
    """(label, kernel, constexprs, warps) of the representative configurations, tiled as `launch` picks them for
    rows of width d unless rows / chunk / warps are given."""

    def tile_of(fmt: str, kernel: str = "quant", per_token: bool = False) -> dict:
        rb, c, w = launch.launch_shape(get_format(fmt), d, kernel, per_token=per_token)
        c = chunk or c
        return {"RB": rows or rb, "C": c, "ONE_PASS": -(-d // c) == 1, "num_warps": warps or w}

    def unit(bits: int) -> int:  # an aligned record buffer
        return next((u for u in (4, 2) if u == 2 * bits or bits % u == 0), 1) if bits else 1

    def quant(fmt: str, mode: ScaleMode, bits: int, block_kernel: bool | None = None, prefetch: int = 0) -> tuple:
        tile = tile_of(fmt, per_token=mode == ScaleMode.PER_TOKEN)
        block = get_format(fmt).block
        fmt_obj = get_format(fmt)  # the kernel `launch` picks (triton_quantize_record), unless block_kernel says
        first = launch.record_first(tile["RB"], tile["C"], tile["num_warps"])
        use16 = launch.block_per_thread(fmt_obj, bool(bits), first)
        use16 = use16 if block_kernel is None else block_kernel
        kernel = getattr(mod, "_quantize_record16_kernel", None) if use16 else None
        if block == 32:  # half a block per thread, where the module has that kernel
            kernel = getattr(mod, "_quantize_record32_halves_kernel", None)
        args = {**tile, "FMT": fmt_obj.kernel_id, "SCALE_MODE": mode, "BITS": bits, "WRITE_OUT": True, "BLOCK": block,
                "REC_UNIT": unit(bits), "RECORD_FIRST": first,
                "ROW_LOOP": prefetch or launch.LAUNCH["quant"]["row_loop"], "PREFETCH": bool(prefetch)}  # fmt: skip
        regs = launch.record_regs(bool(bits), mode, 1 if tile["ONE_PASS"] else 2, bool(prefetch))
        if kernel and regs:  # as `launch` caps the 16-element kernel
            args["maxnreg"] = regs
        return kernel or mod._quantize_record_kernel, args

    def guided(fmt: str, mode: ScaleMode, bits: int, loop: int | None = None) -> tuple:
        f = get_format(fmt)
        block = f.block
        # one guided kernel for every block size; a module from before has `_guided16_kernel` for 16-element blocks
        kernel = getattr(mod, "_guided16_kernel", None) if block == 16 else None
        args = {**tile_of(fmt, "guided"), "FMT": f.kernel_id, "SCALE_MODE": mode, "BITS": bits, "RECORD_BITS": bits,
                "HAS_MASK": False, "BLOCK": block, "REC_UNIT": unit(bits),
                "ROW_LOOP": loop or launch.LAUNCH["guided"]["row_loop"]}  # fmt: skip
        return kernel or mod._guided_kernel, args

    loop, p = launch.LAUNCH["quant"]["prefetch_loop"], ScaleMode.PER_TOKEN
    per_token_tile = tile_of("nvfp4", per_token=True)
    ahead = -(-d // per_token_tile["C"]) <= 2  # rows of one or two chunks: also loaded ahead (launch.prefetched)
    table = [
        ("quant nvfp4 per-token b=1", quant("nvfp4", ScaleMode.PER_TOKEN, 1)),
        ("quant nvfp4 per-token b=1 group kernel", quant("nvfp4", ScaleMode.PER_TOKEN, 1, False)),
        ("quant nvfp4 per-token no-record", quant("nvfp4", ScaleMode.PER_TOKEN, 0)),
        ("quant kv_fp4 b=1", quant("kv_fp4", ScaleMode.NONE, 1)),
        ("quant kv_fp4 no-record", quant("kv_fp4", ScaleMode.NONE, 0)),
        ("quant nvfp4 row b=4", quant("nvfp4", ScaleMode.ROW, 4)),
        ("quant mxfp4 b=2", quant("mxfp4", ScaleMode.NONE, 2)),
        ("guided nvfp4 b=1", guided("nvfp4", ScaleMode.ROW, 1)),
        ("guided nvfp4 b=1, 4 row tiles per program", guided("nvfp4", ScaleMode.ROW, 1, loop=4)),
        ("guided kv_fp4 b=1", guided("kv_fp4", ScaleMode.NONE, 1)),
        ("guided nvfp4 b=2", guided("nvfp4", ScaleMode.ROW, 2)),
        ("guided nvfp4 b=4", guided("nvfp4", ScaleMode.ROW, 4)),
    ]
    if ahead:
        table[3:3] = [(f"quant nvfp4 per-token b=1, {loop} row tiles prefetched", quant("nvfp4", p, 1, prefetch=loop)),
                     (f"quant nvfp4 per-token no-record, {loop} row tiles prefetched",
                      quant("nvfp4", p, 0, prefetch=loop))]  # fmt: skip
    tile = launch.launch_shape(get_format("nvfp4"), d, per_token=True)
    for bits in (1, 0):  # per-token rows in token groups, where `launch` takes them so (with enough rows)
        if groups := launch.token_groups(1 << 20, d, tile, p, [], torch.device("cpu"), bool(bits)):
            g, c, w = groups
            ahead = launch.LAUNCH["quant"]["group_ahead"]
            args = {"RB": 1, "C": c, "num_warps": w, "BITS": bits, "WRITE_OUT": True, "D": d, "G": g,
                    "REC_UNIT": unit(bits), "AHEAD": ahead}  # fmt: skip
            label = f"quant nvfp4 per-token {f'b={bits}' if bits else 'no-record'}, token groups of {g} rows"
            table.append((label, (triton_token_groups._quantize_record16_token_groups_kernel, args)))
    return [(label, kernel, args) for label, (kernel, args) in table]


PTX_SKIP = re.compile(r"^\s*($|//|\.|\{|\}|\$|[A-Za-z_$][\w$]*:)")


def stats(compiled) -> dict:
    ttgir = compiled.asm["ttgir"]
    ptx = compiled.asm["ptx"]
    body = ptx[ptx.find(".entry") :]
    n_ptx = sum(1 for line in body.splitlines() if not PTX_SKIP.match(line))
    row = {
        "convert_layout": len(re.findall(r"convert_layout", ttgir)),
        "local_alloc": len(re.findall(r"local_alloc", ttgir)),
        "local_load/store": len(re.findall(r"local_(?:load|store)", ttgir)),
        "shared_B": compiled.metadata.shared,
        "ptx_shared_ops": len(re.findall(r"\b(?:ld|st)\.shared", body)),
        "ptx_bar_sync": len(re.findall(r"\bbar\.sync|barrier\.sync", body)),
        "ptx_instr": n_ptx,
        "ptx_sha": ptx_sha(body),
    }
    if "cubin" in compiled.asm:
        try:  # ptxas-reported registers through the kernel binary
            row.update(ptxas_info(ptx))
        except Exception as e:
            row["ptxas"] = f"unavailable ({e})"
    return row


def ptx_sha(body: str) -> str:
    """Short hash of a kernel's PTX instructions (source locations and comments left out): equal hashes, equal
    compiled kernels, whichever source file (`--module`) they came from."""
    lines = []
    for line in body.splitlines():
        text = line.strip()
        if text.startswith(".section") or "-- End function" in text:
            break
        if text and not text.startswith((".loc", ".file", "//", "$L__tmp")):  # $L__tmp: debug-scope labels
            lines.append(text)
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:10]


ATTENTION_SHAPE = dict(kv_group_num=8, q_head_num=32, BLOCK_N=32, BLOCK_H=16, MIN_BLOCK_KV=32, logit_cap=0.0,
                       xai_temperature_len=-1, Lk=128)  # fmt: skip
ATTENTION_TYPES = dict(Q="*bf16", kv_indptr="*i32", kv_indices="*i64", Att_Out="*fp32", Att_Lse="*fp32",
                       num_kv_splits="*i32", sm_scale_withk="fp32")  # fmt: skip


def attention_stats(compiled) -> dict:
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


def attention(module: str | None) -> None:
    """`--attention`: the grouped decode stage-1 kernels, SGLang's BF16 one and the FP4 one under SGLang's launch
    and under `GROUPED_LAUNCH` (where it differs)."""
    from tests.fp4_attention_checks import sglang_module
    from trace_core.kernels import fp4_attention

    fa = load_module(module) if module else fp4_attention
    words = hasattr(fa, "fp4_words")  # since the tile reads whole words: codes int32, scale bytes int32 at D = 128
    ptr = "*i32" if words else "*u8"
    fp4 = {name: ptr for name in ("K_Codes", "K_Scales", "V_Codes", "V_Scales")}
    sglang = sglang_module("srt/layers/attention/triton_ops/decode_attention.py")
    launches = [("SGLang's launch", {"num_warps": 4, "num_stages": 2})]
    if getattr(fa, "GROUPED_LAUNCH", launches[0][1]) != launches[0][1]:
        launches.append((f"GROUPED_LAUNCH {fa.GROUPED_LAUNCH}", fa.GROUPED_LAUNCH))
    rows = [(f"SGLang BF16, {launches[0][0]}", attention_stats(compile_kernel(
        sglang._fwd_grouped_kernel_stage1,
        {**ATTENTION_SHAPE, "BLOCK_DMODEL": 128, "BLOCK_DPE": 0, "BLOCK_DV": 128, "Lv": 128, **launches[0][1]},
        {**ATTENTION_TYPES, "K_Buffer": "*bf16", "V_Buffer": "*bf16"})))]  # fmt: skip
    for label, options in launches:
        kernel = fa._fp4_grouped_kernel_stage1
        constexprs = {**ATTENTION_SHAPE, "BLOCK_DMODEL": 128, "KV_DTYPE": tl.bfloat16, **options}
        rows.append((f"FP4 {Path(module).name if module else 'package'}, {label}",
                     attention_stats(compile_kernel(kernel, constexprs, {**ATTENTION_TYPES, **fp4}))))  # fmt: skip
    print(f"triton {triton.__version__}, target sm_90")
    header = ["kernel", "kWidth", "async copies", "convert_layout", "shared_B", "n_regs", "n_spills", "sass_instr",
              "loop_sass", "loop_ldg_stg"]  # fmt: skip
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for label, row in rows:
        print("| " + " | ".join([label] + [str(row.get(h, "-")) for h in header[1:]]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", help="a triton_fp4.py (with --attention: fp4_attention.py) to compile instead of "
                        "the package's (old vs new)")  # fmt: skip
    parser.add_argument("--d", type=int, default=4096, help="row width the tiles are chosen for (default 4096)")
    parser.add_argument("--rows", type=int, help="rows per program (default: as `launch` picks)")
    parser.add_argument("--chunk", type=int, help="chunk columns (default: as `launch` picks)")
    parser.add_argument("--warps", type=int, help="warps (default: as `launch` picks)")
    parser.add_argument("--dump", help="write each kernel's TTGIR and PTX into this folder")
    parser.add_argument("--attention", action="store_true", help="the grouped decode attention kernels instead")
    args = parser.parse_args()
    if args.attention:
        attention(args.module)
        return
    mod = load_module(args.module)
    print(f"triton {triton.__version__}, target sm_90, D={args.d}, LAUNCH={launch.LAUNCH}")
    header = ["kernel", "tile", "convert_layout", "local_alloc", "local_load/store", "shared_B", "ptx_shared_ops",
              "ptx_bar_sync", "ptx_instr", "ptx_sha", "sass_instr", "n_regs", "n_spills", "loop_sass", "loop_ldg_stg",
              "loop_sass_per_16", "stg_at"]  # fmt: skip
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for label, kernel, constexprs in configs(mod, args.d, args.rows, args.chunk, args.warps):
        tile = f"{constexprs['RB']}x{constexprs['C']}/{constexprs['num_warps']}w"
        compiled = compile_kernel(kernel, dict(constexprs))
        row = {"tile": tile, **stats(compiled)}
        if "loop_sass" in row:  # elements per thread per chunk iteration: the loop body per 16 of them
            per_thread = constexprs["RB"] * constexprs["C"] // (32 * constexprs["num_warps"])
            row["loop_sass_per_16"] = round(row["loop_sass"] * 16 / per_thread, 1)
        print("| " + " | ".join([label] + [str(row.get(h, "-")) for h in header[1:]]) + " |")
        if args.dump:
            out = Path(args.dump)
            out.mkdir(parents=True, exist_ok=True)
            stem = re.sub(r"\W+", "_", label)
            (out / f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
            (out / f"{stem}.ptx").write_text(compiled.asm["ptx"])


if __name__ == "__main__":
    main()
