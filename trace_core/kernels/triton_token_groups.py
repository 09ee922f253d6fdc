"""Triton kernel: per-token nvfp4 quantize-and-record on a few rows per program taken as whole chunks ("token
groups", `launch.token_groups`), so that rows that are not a whole number of chunks (D = 7168 in chunks of 2048 or
4096) leave no thread masked. Each chunk is quantized and stored by `triton_fp4._quantize_chunk16`, as in the
row-wise kernel; the twin and the tests are those of `triton_fp4` (`test_per_token_rows_in_token_groups`, and the
interpreter's token-group cases)."""

from __future__ import annotations

import triton
import triton.language as tl

from trace_core.kernels.triton_fp4 import (
    NVFP4,
    SCALE_PER_TOKEN,
    _block_index,
    _half_offsets,
    _per_token_scale,
    _quantize_chunk16,
)


@triton.jit
def _slot(v0, v1, v2, v3, i: tl.constexpr):
    """v_i of (v0, v1, v2, v3): named registers indexed at compile time."""
    if i == 0:
        return v0
    elif i == 1:
        return v1
    elif i == 2:
        return v2
    return v3


@triton.jit
def _with_slot(v0, v1, v2, v3, v, i: tl.constexpr):
    """(v0, v1, v2, v3) with v_i replaced by v."""
    if i == 0:
        v0 = v
    elif i == 1:
        v1 = v
    elif i == 2:
        v2 = v
    else:
        v3 = v
    return v0, v1, v2, v3


@triton.jit
def _in_row(v, col, lo: tl.constexpr, D: tl.constexpr, C: tl.constexpr):
    """v where the chunk column col (of C) lies in the row whose columns there are [lo, lo + D), else 0."""
    if lo > 0:
        v = tl.where(col >= lo, v, 0.0)
    if lo + D < C:
        v = tl.where(col < lo + D, v, 0.0)
    return v


@triton.jit
def _quantize_record16_token_groups_kernel(
    x_ptr, out_ptr, rec_ptr, scale_ptr, tok_ptr, T, rec_stride, scale_stride, tok_stride,
    BITS: tl.constexpr, WRITE_OUT: tl.constexpr, D: tl.constexpr, G: tl.constexpr, C: tl.constexpr,
    REC_UNIT: tl.constexpr, AHEAD: tl.constexpr,
):  # fmt: skip
    """Per-token nvfp4 on G rows of D columns per program, taken as G * D / C chunks of C columns (x, the output
    and the record contiguous, `launch.token_groups`): where D is not a multiple of C, a row's last chunk would leave
    threads masked (at D = 7168 a quarter of the second 4096-column chunk); here every thread holds a block of the
    group. The chunks are streamed: chunk j + AHEAD is loaded before chunk j's block amaxes go into its rows'; a
    row's S_enc is taken once its last chunk is in, and a chunk is quantized, reading x again (from the L1: a few
    chunks back), as soon as the S_enc of each of its rows is known. A block's row is known at compile time from
    its column (a chunk spans one row or more), so the loops below unroll into straight code. Each thread holds
    whole blocks, so the record is stored before the output (`RECORD_FIRST`)."""
    tl.static_assert(G <= 4 and AHEAD <= 3, "4 register slots: at most 4 rows, 3 chunks loaded ahead")
    NB: tl.constexpr = C // 16
    NCH: tl.constexpr = G * D // C
    offs = _half_offsets(NB)
    col = tl.arange(0, NB)[None, :] * 16  # each block's first column within its chunk
    row0 = tl.program_id(0) * G
    rows64 = row0.to(tl.int64) + tl.arange(0, 1)
    x_grp = x_ptr + rows64[:, None, None] * D + offs
    lim = tl.minimum(T - row0, G) * D  # the group's columns that lie in rows < T
    xa0 = tl.zeros((1, NB, 8), x_ptr.dtype.element_ty)  # chunks loaded ahead, in slot j % 4
    xa1, xa2, xa3, xb0, xb1, xb2, xb3 = xa0, xa0, xa0, xa0, xa0, xa0, xa0
    a0 = tl.zeros((1, NB), tl.float32)  # each row's amax so far, per block
    a1, a2, a3 = a0, a0, a0
    s0 = tl.full((1, 1), 1.0, tl.float32)  # each row's S_enc
    s1, s2, s3 = s0, s0, s0
    for j in tl.static_range(NCH + AHEAD):
        if j < NCH:  # load chunk j
            m = j * C + offs < lim
            xa0, xa1, xa2, xa3 = _with_slot(xa0, xa1, xa2, xa3, tl.load(x_grp + j * C, mask=m, other=0.0), j % 4)
            xb0, xb1, xb2, xb3 = _with_slot(xb0, xb1, xb2, xb3, tl.load(x_grp + j * C + 8, mask=m, other=0.0), j % 4)
        if j >= AHEAD:  # chunk i = j - AHEAD: its amax into its rows'; the rows it ends; the chunks then quantizable
            xa = _slot(xa0, xa1, xa2, xa3, (j - AHEAD) % 4).to(tl.float32)
            xb = _slot(xb0, xb1, xb2, xb3, (j - AHEAD) % 4).to(tl.float32)
            amax_blk = tl.maximum(tl.max(tl.abs(xa), axis=2), tl.max(tl.abs(xb), axis=2))
            for r in tl.static_range(G):  # row r's columns within chunk i: [r * D - i * C, + D)
                if r * D - (j - AHEAD) * C < C:
                    if r * D - (j - AHEAD) * C + D > 0:
                        v = _in_row(amax_blk, col, r * D - (j - AHEAD) * C, D, C)
                        a0, a1, a2, a3 = _with_slot(a0, a1, a2, a3, tl.maximum(_slot(a0, a1, a2, a3, r), v), r)
            for r in tl.static_range(G):
                if ((r + 1) * D - 1) // C == j - AHEAD:  # chunk i is row r's last
                    s = _per_token_scale(
                        tl.max(_slot(a0, a1, a2, a3, r), axis=1),
                        tok_ptr,
                        rows64 + r,
                        tok_stride,
                        row0 + r + tl.arange(0, 1) < T,
                        BITS,
                    )  # [1, 1]
                    s0, s1, s2, s3 = _with_slot(s0, s1, s2, s3, s, r)
            for k in tl.static_range(NCH):
                if ((((k + 1) * C - 1) // D + 1) * D - 1) // C == j - AHEAD:  # chunk i ends chunk k's last row
                    s_enc = tl.zeros((1, NB), tl.float32) + _slot(s0, s1, s2, s3, k * C // D)  # its first row's
                    for r in tl.static_range(1, G):  # then each row that starts within chunk k
                        if r * D - k * C > 0:
                            if r * D - k * C < C:
                                s_enc = tl.where(col >= r * D - k * C, _slot(s0, s1, s2, s3, r), s_enc)
                    m = k * C + offs < lim
                    bmask = k * C + col < lim
                    xa = tl.load(x_grp + k * C, mask=m, other=0.0).to(tl.float32)
                    xb = tl.load(x_grp + k * C + 8, mask=m, other=0.0).to(tl.float32)
                    _quantize_chunk16(xa, xb, s_enc, rows64, bmask, k * C, offs, m, _block_index(k * C, NB), bmask,
                                      out_ptr, rec_ptr, scale_ptr, tok_ptr, D, rec_stride, scale_stride, tok_stride,
                                      NVFP4, SCALE_PER_TOKEN, BITS, WRITE_OUT, False, REC_UNIT, True)  # fmt: skip
