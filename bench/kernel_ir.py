"""Compile the FP4 Triton kernels for Hopper (sm_90) without a GPU and print static cost indicators.

Per kernel configuration: layout conversions (`convert_layout`) and shared-memory ops (`local_alloc`,
`local_load`, `local_store`) in the TTGIR, shared memory bytes, PTX instruction count (body lines that are
instructions) and a hash of them (`ptx_sha`: equal kernels from different `--module` sources), and, when the
triton install ships ptxas (and cuobjdump), registers, spill bytes, the static SASS instruction count, and the
instructions and global loads / stores of the widest loop's body (`outer_loop`), also per 16 elements a thread
handles in it, and each global store as width@position in the SASS (`stg_at`).
The local triton may be newer than the GPU's, so the counts are indicative; compare kernel versions with the same
triton.

Usage: python bench/kernel_ir.py [--module path/to/triton_fp4.py] [--d 4096] [--rows R --chunk C --warps W]
       [--dump DIR]
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
from triton.backends.compiler import GPUTarget

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trace_core.kernels import ops, triton_token_groups  # noqa: E402

PTR_TYPES = {
    "x_ptr": "*bf16",
    "out_ptr": "*bf16",
    "rec_ptr": "*u8",
    "scale_ptr": "*u8",
    "gs_ptr": "*fp32",
    "tok_ptr": "*fp32",
    "has_ptr": "*i1",
    "redirect_ptr": "*i32",
}


def load_module(path: str | None):
    if path is None:
        from trace_core.kernels import triton_fp4

        return triton_fp4
    spec = importlib.util.spec_from_file_location("triton_fp4_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def configs(mod, d: int, rows: int | None, chunk: int | None, warps: int | None) -> list[tuple]:
    """(label, kernel, constexprs, warps) of the representative configurations, tiled as `ops` launches them for
    rows of width d unless rows / chunk / warps are given."""

    def launch(fmt: str, kernel: str = "quant", per_token: bool = False) -> dict:
        rb, c, w = ops._launch_shape(ops.get_format(fmt), d, kernel, per_token=per_token)
        c = chunk or c
        return {"RB": rows or rb, "C": c, "ONE_PASS": -(-d // c) == 1, "num_warps": warps or w}

    def unit(bits: int) -> int:  # an aligned record buffer
        return next((u for u in (4, 2) if u == 2 * bits or bits % u == 0), 1) if bits else 1

    def quant(
        fmt: str, mode: int, bits: int, block_kernel: bool | None = None, rec_unit: int | None = None, prefetch: int = 0
    ) -> tuple:
        tile = launch(fmt, per_token=mode == ops.SCALE_PER_TOKEN)
        block = ops.get_format(fmt).block
        fmt_obj = ops.get_format(fmt)  # the kernel ops launches (triton_quantize_record), unless block_kernel says
        first = ops.record_first(tile["RB"], tile["C"], tile["num_warps"])
        use16 = ops.block_per_thread(fmt_obj, bool(bits), first, rec_unit or unit(bits))
        use16 = use16 if block_kernel is None else block_kernel
        kernel = getattr(mod, "_quantize_record16_kernel", None) if use16 else None
        if block == 32:  # half a block per thread, where the module has that kernel
            kernel = getattr(mod, "_quantize_record32_halves_kernel", None)
        args = {**tile, "FMT": fmt_obj.kernel_id, "SCALE_MODE": mode, "BITS": bits, "WRITE_OUT": True, "BLOCK": block,
                "REC_UNIT": rec_unit or unit(bits), "RECORD_FIRST": first,
                "ROW_LOOP": prefetch or ops.LAUNCH["quant"]["row_loop"], "PREFETCH": bool(prefetch)}  # fmt: skip
        regs = ops.record_regs(bool(bits), mode, 1 if tile["ONE_PASS"] else 2, bool(prefetch))
        if kernel and regs:  # as ops caps the 16-element kernel
            args["maxnreg"] = regs
        return kernel or mod._quantize_record_kernel, args

    def guided(fmt: str, mode: int, bits: int, loop: int | None = None) -> tuple:
        f = ops.get_format(fmt)
        block = f.block
        # one guided kernel for every block size; a module from before has `_guided16_kernel` for 16-element blocks
        kernel = getattr(mod, "_guided16_kernel", None) if block == 16 else None
        args = {**launch(fmt, "guided"), "FMT": f.kernel_id, "SCALE_MODE": mode, "BITS": bits, "RECORD_BITS": bits,
                "HAS_MASK": False, "BLOCK": block, "REC_UNIT": unit(bits),
                "ROW_LOOP": loop or ops.LAUNCH["guided"]["row_loop"]}  # fmt: skip
        return kernel or mod._guided_kernel, args

    loop, p = ops.LAUNCH["quant"]["prefetch_loop"], ops.SCALE_PER_TOKEN
    per_token_tile = launch("nvfp4", per_token=True)
    ahead = -(-d // per_token_tile["C"]) <= 2  # rows of one or two chunks: also loaded ahead (ops.prefetched)
    table = [
        ("quant nvfp4 per-token b=1", quant("nvfp4", ops.SCALE_PER_TOKEN, 1)),
        ("quant nvfp4 per-token b=1 group kernel", quant("nvfp4", ops.SCALE_PER_TOKEN, 1, False)),
        ("quant nvfp4 per-token no-record", quant("nvfp4", ops.SCALE_PER_TOKEN, 0)),
        ("quant kv_fp4 b=1", quant("kv_fp4", ops.SCALE_NONE, 1)),
        ("quant kv_fp4 b=1 wide record stores", quant("kv_fp4", ops.SCALE_NONE, 1, rec_unit=16)),
        ("quant nvfp4 per-token b=1 wide record stores", quant("nvfp4", ops.SCALE_PER_TOKEN, 1, True, rec_unit=16)),
        ("quant kv_fp4 no-record", quant("kv_fp4", ops.SCALE_NONE, 0)),
        ("quant nvfp4 row b=4", quant("nvfp4", ops.SCALE_ROW, 4)),
        ("quant mxfp4 b=2", quant("mxfp4", ops.SCALE_NONE, 2)),
        ("guided nvfp4 b=1", guided("nvfp4", ops.SCALE_ROW, 1)),
        ("guided nvfp4 b=1, 4 row tiles per program", guided("nvfp4", ops.SCALE_ROW, 1, loop=4)),
        ("guided kv_fp4 b=1", guided("kv_fp4", ops.SCALE_NONE, 1)),
        ("guided nvfp4 b=2", guided("nvfp4", ops.SCALE_ROW, 2)),
        ("guided nvfp4 b=4", guided("nvfp4", ops.SCALE_ROW, 4)),
    ]
    if ahead:
        table[3:3] = [(f"quant nvfp4 per-token b=1, {loop} row tiles prefetched", quant("nvfp4", p, 1, prefetch=loop)),
                     (f"quant nvfp4 per-token no-record, {loop} row tiles prefetched",
                      quant("nvfp4", p, 0, prefetch=loop))]  # fmt: skip
    tile = ops._launch_shape(ops.get_format("nvfp4"), d, per_token=True)
    for bits in (1, 0):  # per-token rows in token groups, where ops takes them so (with enough rows)
        if groups := ops.token_groups(1 << 20, d, tile, p, [], torch.device("cpu"), bool(bits)):
            g, c, w = groups
            ahead = ops.LAUNCH["quant"]["group_ahead"]
            args = {"RB": 1, "C": c, "num_warps": w, "BITS": bits, "WRITE_OUT": True, "D": d, "G": g,
                    "REC_UNIT": unit(bits), "AHEAD": ahead}  # fmt: skip
            label = f"quant nvfp4 per-token {f'b={bits}' if bits else 'no-record'}, token groups of {g} rows"
            table.append((label, (triton_token_groups._quantize_record16_token_groups_kernel, args)))
    return [(label, kernel, args) for label, (kernel, args) in table]


def compile_kernel(kernel, constexprs: dict, types: dict[str, str] | None = None):
    """The kernel compiled for sm_90 with the constexprs and launch options (`num_warps`, `num_stages`, `maxnreg`)
    in `constexprs`; other arguments are typed by `types`, else `*_ptr` by PTR_TYPES and the rest i32."""
    names = kernel.arg_names
    options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in constexprs}
    # non-constexpr params the kernel actually declares; keep only constexprs it knows
    constexprs = {k: v for k, v in constexprs.items() if k in names}
    types = {**{name: PTR_TYPES.get(name, "*fp32") for name in names if name.endswith("_ptr")}, **(types or {})}
    signature = {}
    attrs = {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        # pointers, D = 4096 and the strides of contiguous buffers
        if signature[name].startswith("*") or signature[name] == "i32" and name not in ("T", "chunks_per_prog"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


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


def ptxas_info(ptx: str) -> dict:
    import subprocess
    import tempfile

    from triton.backends.nvidia import compiler as nv

    try:
        ptxas = nv.get_ptxas(90).path
    except TypeError:  # older triton: no arch argument
        ptxas = nv.get_ptxas().path
    cuobjdump = Path(ptxas).with_name("cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "k.ptx"
        p.write_text(ptx)
        out = subprocess.run([ptxas, "-v", "-arch=sm_90a", str(p), "-o", str(Path(d) / "k.o")], capture_output=True,
                             text=True).stderr  # fmt: skip
        sass = ""
        if cuobjdump.exists():
            dump = subprocess.run([str(cuobjdump), "-sass", str(Path(d) / "k.o")], capture_output=True, text=True)
            sass = dump.stdout
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    # SASS instructions (static, NOP padding excluded): what the scheduler issues, closer to the profile than PTX
    instr = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"^\s+/\*([0-9a-f]{4})\*/\s+([^;]*);", sass, re.M)
             if "NOP" not in m.group(2)]  # fmt: skip
    # each global store's width and position in the SASS: a thread's two 16-byte output stores merge into whole
    # sectors in the L1 only when issued back to back (docs/performance.md, "the record before the output")
    stores = " ".join(f"{m.group(1) or '32'}@{i}" for i, (_, t) in enumerate(instr)
                      if (m := re.search(r"\bSTG\.E(?:\.(\w+))?", t)))  # fmt: skip
    return {"n_regs": int(regs.group(1)) if regs else None, "n_spills": int(spill.group(1)) if spill else None,
            "sass_instr": len(instr) or None, **outer_loop(instr), "stg_at": stores or None}  # fmt: skip


def outer_loop(instr: list[tuple[int, str]]) -> dict:
    """SASS instructions and global loads / stores in the body of the widest loop (a backward branch): the
    chunk loop of the quantize kernels, run once per chunk of a program's rows, so per-element work without the
    program's fixed cost."""
    best: list[tuple[int, str]] = []
    for addr, text in instr:
        target = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [i for i in instr if int(target.group(1), 16) <= i[0] <= addr]
            best = max(best, body, key=len)
    if not best:
        return {}
    return {"loop_sass": len(best), "loop_ldg_stg": sum(1 for _, t in best if re.search(r"\b(LDG|STG)", t))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", help="a triton_fp4.py to compile instead of the package's (old vs new)")
    parser.add_argument("--d", type=int, default=4096, help="row width the tiles are chosen for (default 4096)")
    parser.add_argument("--rows", type=int, help="rows per program (default: as ops launches)")
    parser.add_argument("--chunk", type=int, help="chunk columns (default: as ops launches)")
    parser.add_argument("--warps", type=int, help="warps (default: as ops launches)")
    parser.add_argument("--dump", help="write each kernel's TTGIR and PTX into this folder")
    args = parser.parse_args()
    mod = load_module(args.module)
    print(f"triton {triton.__version__}, target sm_90, D={args.d}, LAUNCH={ops.LAUNCH}")
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
