"""Triton kernels compiled for Hopper (sm_90) on a machine without a GPU, and what the ptxas and cuobjdump that
triton ships say about the result: registers, spills, SASS instruction counts, the position of each global store.
Used by the compiled-code tests of the FP4 kernels and by bench/kernel_ir.py. Importing this module needs triton."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

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


def compile_kernel(kernel, constexprs: dict, types: dict[str, str] | None = None):
    """The kernel compiled for sm_90 with the constexprs and launch options (`num_warps`, `num_stages`, `maxnreg`)
    in `constexprs` (a constexpr parameter left out takes its default); other arguments are typed by `types`, else
    `*_ptr` by PTR_TYPES and the rest i32."""
    names = kernel.arg_names
    options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in constexprs}
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    constexprs = {**defaults, **constexprs}
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


def ptxas_info(ptx: str) -> dict:
    """What ptxas (and cuobjdump, where the triton install ships it) say about a kernel's PTX for sm_90a: registers,
    spill bytes, static SASS instructions (NOP padding excluded), the widest loop's body (`outer_loop`) and each
    global store as width@position in the SASS (`stg_at`)."""
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
