"""Triton kernels: fused FP4 quantize-and-record, and guided fake-quant from a record.

Each kernel is the twin of `trace_core` reference functions and is tested against them bit for bit
(`tests/kernel_checks.py`, run on the GPU by `tests/kernels/test_kernels_gpu.py` and on the CPU under the Triton
interpreter by `tests/kernels/test_kernels.py::test_triton_kernel_under_the_interpreter`); `launch` picks the kernel:
- quantize-and-record ↔ `quant.quantize` + `quant.dequantize` + `records.pack_low_bits`:
  `_quantize_record16_kernel`, 16-element blocks (nvfp4, kv_fp4), one block per thread;
  `triton_token_groups._quantize_record16_token_groups_kernel`, the same for per-token nvfp4 rows taken a few per
  program as whole chunks (`launch.token_groups`);
  `_quantize_record32_halves_kernel`, 32-element blocks (mxfp4, mxfp4_ocp), half a block per thread;
  `_quantize_record_kernel`, one 8-element group per thread, only for nvfp4 with a record on tiles that do not give
  each thread whole blocks (rows of at most 256 columns with the default tile). Tests:
  `test_quantize_record_is_bit_exact` (every format and scale mode; nvfp4 records at D = 64 take the group kernel),
  `test_quantize_record_on_every_swept_tile`, `test_per_token_rows_wider_than_one_tile`,
  `test_per_token_rows_loaded_ahead`, `test_per_token_record_kernel_register_cap`,
  `test_rows_taken_as_whole_chunks_are_bit_exact` (the E8M0 formats), `test_per_token_rows_in_token_groups`;
- guided fake-quant ↔ `guided.guided_quantize` + `quant.dequantize`: `_guided_kernel`, one kernel for 16- and
  32-element blocks, 16 elements per thread. Tests: `test_guided_is_bit_exact`,
  `test_guided_with_other_row_tiles_per_program`.
Exactness rules: FP32 throughout, IEEE division (`div_rn`) where the contract divides, powers of two and E4M3 built
from bits or (the 16-element quantize kernel's scales) by the hardware's round-half-even converter: no approximate
conversions; the KV exponent through libdevice `log2` (what torch's CUDA `log2` runs).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

from trace_core.kernels.launch import ScaleMode
from trace_core.numerics import formats

# Format ids (constexpr), as the format definitions give them (`FP4Format.kernel_id`).
NVFP4 = tl.constexpr(formats.NVFP4.kernel_id)
MXFP4 = tl.constexpr(formats.MXFP4.kernel_id)
MXFP4_OCP = tl.constexpr(formats.MXFP4_OCP.kernel_id)
KV_FP4 = tl.constexpr(formats.KV_FP4.kernel_id)
# Global-scale modes (constexpr), as `launch.ScaleMode` defines them.
SCALE_NONE = tl.constexpr(ScaleMode.NONE.value)
SCALE_SCALAR = tl.constexpr(ScaleMode.SCALAR.value)
SCALE_ROW = tl.constexpr(ScaleMode.ROW.value)
SCALE_PER_TOKEN = tl.constexpr(ScaleMode.PER_TOKEN.value)

# The interpreter (TRITON_INTERPRET=1, CPU tests) has no libdevice; numpy's log2 stands in for it there.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
FLT_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH = tl.constexpr(0.1666666716337204)  # fp32(1/6)
TWO_22 = tl.constexpr(4194304.0)  # 2^22
TWO_M126 = tl.constexpr(1.1754943508222875e-38)  # 2^-126
TWO_126 = tl.constexpr(8.507059173023462e37)  # 2^126
SIGN_MASK = tl.constexpr(-2147483648)  # 0x80000000 as int32


@triton.jit
def _pow2(n):
    """2^n as FP32 for integer n in [-127, 127], built from bits (2^-127 is subnormal)."""
    normal = ((n + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(n >= -126, normal, tl.full(n.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def _rcp(x):
    """1 / x rounded to nearest even: `rcp.rn.f32` (libdevice `rcp_rn`), the same value as the IEEE division
    `div_rn(1, x)` and cheaper; the interpreter, without libdevice, divides."""
    if INTERPRET:
        return tl.math.div_rn(1.0, x)
    return libdevice.rcp_rn(x)


@triton.jit
def _e4m3_round(v):
    """Round FP32 v in [0, 448] to the nearest-even E4M3 value; returns (value, byte)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, -6)  # below 2^-6 the E4M3 quantum stays 2^-9 (subnormals)
    quantum = _pow2(exp - 3)
    # round-half-even of v / quantum (exact: power-of-two scaling), via the 2^23 magic constant
    n = (v * _pow2(3 - exp) + 8388608.0) - 8388608.0
    value = n * quantum
    vbits = value.to(tl.int32, bitcast=True)
    vexp = ((vbits >> 23) & 0xFF) - 127
    normal_byte = ((vexp + 7) << 3) | ((vbits >> 20) & 0x7)
    sub_byte = (value * 512.0).to(tl.int32)  # subnormal: value = m * 2^-9, m in 0..7
    byte = tl.where(value < 0.015625, sub_byte, normal_byte)
    return value, byte


@triton.jit
def _e4m3_decode(byte):
    """FP32 value of an E4M3 byte (int32 0..255), exact, from its bits: exponent field e = (byte >> 3) & 15,
    mantissa m = byte & 7, (8 + m) 2^(e - 10) for e > 0, m 2^-9 for e = 0, the sign from bit 7. The NaN bytes
    0x7F / 0xFF decode as +-480 (a scale never is NaN: sf saturates at 448)."""
    e = (byte >> 3) & 0xF
    m = byte & 0x7
    normal = (((e - 7 + 127) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return (value.to(tl.int32, bitcast=True) | ((byte & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_exponent(amax, FMT: tl.constexpr):
    """Integer block exponent of an E8M0 scale, as in `quant.e8m0_exponent`."""
    if FMT == KV_FP4:
        v = tl.maximum(tl.math.div_rn(amax, 6.0), 1e-10)
        if INTERPRET:
            log2_v = tl.log2(v)
        else:
            log2_v = libdevice.log2(v)
        e = tl.ceil(log2_v).to(tl.int32)
    else:
        if FMT == MXFP4:
            src = tl.math.div_rn(amax, 6.0)
        else:
            src = amax
        bits = src.to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        mant = bits & 0x7FFFFF
        if FMT == MXFP4:
            e = tl.where(mant == 0, biased - 127, biased - 126)
            # subnormal quotient: ceil(log2) is -127 up to 2^-127, -126 above
            e = tl.where(biased == 0, tl.where(bits <= 0x00400000, -127, -126), e)
        else:
            e = tl.where(biased == 0, -127, biased - 127 - 2)
        e = tl.where(src > 0, e, -127)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _binade(a):
    """The E2M1 binade base around a in [0, 6]: 1 below 2, else 2^floor(log2 a); half of it is the grid step."""
    return (tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _fma_directed(a, b, c, UP: tl.constexpr):
    """a * b + c rounded toward zero, or up with UP, without flushing subnormals (libdevice's directed FMAs flush
    them under triton). The interpreter computes it in FP64, exact for the operands here (b a power of two, a * b
    and c within 2^25 of each other or c negligible) and then truncated; rounding up adds one ulp where that
    truncation is inexact (c >= 0 here, so truncation is rounding down)."""
    if INTERPRET:
        exact = a.to(tl.float64) * b + c
        down = exact.to(tl.float32, fp_downcast_rounding="rtz")
        if UP:
            inexact = down.to(tl.float64) != exact
            down = (down.to(tl.int32, bitcast=True) + tl.where(inexact, 1, 0)).to(tl.float32, bitcast=True)
        return down
    if UP:
        return tl.inline_asm_elementwise("fma.rp.f32 $0, $1, $2, $3;", "=f,f,f,f", [a, b, c], dtype=tl.float32,
                                         is_pure=True, pack=1)  # fmt: skip
    return tl.inline_asm_elementwise("fma.rz.f32 $0, $1, $2, $3;", "=f,f,f,f", [a, b, c], dtype=tl.float32,
                                     is_pure=True, pack=1)  # fmt: skip


@triton.jit
def _e2m1_round(a, TIES_UP: tl.constexpr):
    """(q, base, t): a in [0, 6] rounded to the E2M1 grid (RNE, or ties up), its binade base (`_binade`), and
    t = q + base * 2^22, whose FP32 ulp is the grid step: the low bit of t's bits is the parity of q's E2M1 index
    (`_odd`).

    RNE: FP32 addition rounds a + base * 2^22 to a multiple of the step, so one add and one subtract do the
    rounding. Ties up: t = rz(rz(a + step / 2) + base * 2^22) is floor(a / step + 1 / 2) steps exactly (the inner
    rounding goes down to the largest FP32 at or below a + step / 2, which keeps every multiple of the step that
    lies below it), two fused multiply-adds instead of RNE and a tie fix-up."""
    base = _binade(a)
    big = base * TWO_22
    if TIES_UP:
        t = _fma_directed(base, TWO_22, _fma_directed(base, 0.25, a, False), False)
    else:
        t = a + big
    return t - big, base, t


@triton.jit
def _odd(t):
    """Bit 0 of the E2M1 index of the q that `_e2m1_round` returns with t (int32 0 or 1)."""
    return t.to(tl.int32, bitcast=True) & 1


@triton.jit
def _index(q):
    """E2M1 index (0..7) of a grid magnitude q: the FP32 bits of q * 2^-126 are index << 22 (0.5 is subnormal)."""
    return (q * TWO_M126).to(tl.int32, bitcast=True) >> 22


@triton.jit
def _magnitude(k):
    """E2M1 magnitude of index k (0..7), the inverse of `_index`."""
    return (k << 22).to(tl.float32, bitcast=True) * TWO_126


@triton.jit
def _with_sign(m, z):
    """Magnitude m with the sign bit of z."""
    return (m.to(tl.int32, bitcast=True) | (z.to(tl.int32, bitcast=True) & SIGN_MASK)).to(tl.float32, bitcast=True)


@triton.jit
def _code_sign(z, FMT: tl.constexpr):
    """z with the sign its code takes: SGLang's KV sets it for z < 0 only (-0.0 becomes +0.0); the others keep
    signbit(z)."""
    if FMT == KV_FP4:
        z = z + 0.0
    return z


@triton.jit
def _block_scales(amax_blk, s_enc, FMT: tl.constexpr, HW_E4M3: tl.constexpr = False):
    """(decode, encode, byte) of each block from its amax (and S_enc for nvfp4); HW_E4M3 rounds the E4M3 scale
    with the hardware FP8 conversion instead of the bit arithmetic (same values)."""
    if FMT == NVFP4:
        sf = tl.minimum(amax_blk * (s_enc * ONE_SIXTH), 448.0)
        if HW_E4M3:
            value, byte = _e4m3_round_hw(sf)
        else:
            value, byte = _e4m3_round(sf)
        decode = value * tl.math.div_rn(1.0, s_enc)
        encode = tl.minimum(tl.math.div_rn(1.0, decode), FLT_MAX)
    else:
        e = _e8m0_exponent(amax_blk, FMT)
        byte = e + 127
        decode = _pow2(e)
        encode = _pow2(-e)
    return decode, encode, byte


@triton.jit
def _token_scale(amax_row):
    """Per-token nvfp4 S_enc = min(2688 / amax, FLT_MAX), 1 where the row is all zeros."""
    return tl.where(amax_row > 0, tl.minimum(tl.math.div_rn(2688.0, amax_row), FLT_MAX), 1.0)


@triton.jit
def _static_scale(gs_ptr, rows, row_mask, SCALE_MODE: tl.constexpr, NDIM: tl.constexpr):
    """nvfp4's S_enc in a static scale mode, broadcastable against [RB, ...] tensors of NDIM dimensions: a load per
    row (SCALE_ROW), the scalar (SCALE_SCALAR), or 1 (SCALE_NONE, the E8M0 formats)."""
    if SCALE_MODE == SCALE_ROW:
        s_enc = tl.load(gs_ptr + rows, mask=row_mask, other=1.0)[:, None]
        if NDIM == 3:
            s_enc = s_enc[:, :, None]
    elif SCALE_MODE == SCALE_SCALAR:
        s_enc = tl.load(gs_ptr)
    else:
        s_enc = 1.0
    return s_enc


@triton.jit
def _row_amax(x_ptr, rows64, row_mask, x_stride, D, RB: tl.constexpr, C: tl.constexpr):
    """Amax of each of the rows [RB] over all D columns, read in [RB, C] tiles (the first pass of per-token nvfp4
    when a row is wider than one chunk; a max, so the tile layout does not change the result)."""
    cols = tl.arange(0, C)[None, :]
    amax_row = tl.zeros((RB,), tl.float32)
    for c0 in range(0, D, C):
        m = row_mask[:, None] & (c0 + cols < D)
        x = tl.load(x_ptr + rows64[:, None] * x_stride + c0 + cols, mask=m, other=0.0).to(tl.float32)
        amax_row = tl.maximum(amax_row, tl.max(tl.abs(x), axis=1))
    return amax_row


@triton.jit
def _per_token_scale(amax_row, tok_ptr, rows64, tok_stride, row_mask, BITS: tl.constexpr):
    """Per-token S_enc [RB, 1] of rows with amax `amax_row` [RB], stored as the record's token scale when there is
    a record."""
    s_enc = _token_scale(amax_row)
    if BITS > 0:
        tl.store(tok_ptr + rows64 * tok_stride, s_enc, mask=row_mask)
    return s_enc[:, None]


@triton.jit
def _tile(NB: tl.constexpr, G: tl.constexpr):
    """Column offsets [1, NB, G, 8] within a chunk: NB scale blocks of G groups of 8 elements (8 elements fill
    BITS bytes of the record). Every tensor of the kernels lives in this layout or a reduction of it."""
    blk = tl.arange(0, NB)[None, :, None, None]
    grp = tl.arange(0, G)[None, None, :, None]
    ele = tl.arange(0, 8)[None, None, None, :]
    return blk * (G * 8) + grp * 8 + ele


@triton.jit
def _group_index(c0, NB: tl.constexpr, G: tl.constexpr):
    """Index [1, NB, G] of each 8-element group of the chunk starting at column c0, within its row. Declared
    non-contiguous: the byte loads and stores indexed by it then keep the layout of the tile reduced over its last
    axis (one byte per thread, consecutive threads on consecutive groups) instead of a wider one that would need
    a layout conversion through shared memory."""
    idx = c0 // 8 + tl.arange(0, NB)[None, :, None] * G + tl.arange(0, G)[None, None, :]
    return tl.max_contiguous(idx, [1, 1, 1])


@triton.jit
def _quantize_record_kernel(
    x_ptr, out_ptr, rec_ptr, scale_ptr, gs_ptr, tok_ptr,
    T, D, x_stride, out_stride, rec_stride, scale_stride, tok_stride, chunks_per_prog,
    FMT: tl.constexpr, SCALE_MODE: tl.constexpr, BITS: tl.constexpr, WRITE_OUT: tl.constexpr,
    BLOCK: tl.constexpr, RB: tl.constexpr, C: tl.constexpr, ONE_PASS: tl.constexpr,
):  # fmt: skip
    """Quantize rows [RB] x columns in chunks of C; write the fake-quantized output and/or the record.

    x is loaded as [RB, C / BLOCK, BLOCK / 8, 8] and stays in that register layout: block amax and per-token amax
    are reductions of it, scales broadcast back into it, and the record's bit groups are sums over its last axis.
    Per-token nvfp4 with ONE_PASS (the row fits in one chunk) reads x once; otherwise a first pass takes the amax.
    `launch` launches it only for nvfp4 with a record on tiles that do not give each thread whole 16-element blocks
    (rows of at most 256 columns with the default tile); every other launch takes one of the kernels below.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * RB + tl.arange(0, RB)
    row_mask = rows < T
    rows64 = rows.to(tl.int64)
    NB: tl.constexpr = C // BLOCK
    G: tl.constexpr = BLOCK // 8
    offs = _tile(NB, G)
    x_rows = x_ptr + rows64[:, None, None, None] * x_stride

    if SCALE_MODE != SCALE_PER_TOKEN:
        s_enc = _static_scale(gs_ptr, rows, row_mask, SCALE_MODE, 2)
    elif not ONE_PASS:
        s_enc = _per_token_scale(_row_amax(x_ptr, rows64, row_mask, x_stride, D, RB, C), tok_ptr, rows64, tok_stride,
                                 row_mask, BITS)  # fmt: skip

    first = tl.arange(0, G)[None, None, :] == 0  # one group of each block stores its scale byte
    for ci in range(chunks_per_prog):
        c0 = (pid_c * chunks_per_prog + ci) * C
        m = row_mask[:, None, None, None] & (c0 + offs < D)
        gidx = _group_index(c0, NB, G)
        gmask = row_mask[:, None, None] & (gidx < D // 8)  # D is a multiple of BLOCK, BLOCK of 8
        x = tl.load(x_rows + c0 + offs, mask=m, other=0.0).to(tl.float32)
        amax_blk = tl.max(tl.max(tl.abs(x), axis=3), axis=2)
        if SCALE_MODE == SCALE_PER_TOKEN and ONE_PASS:
            s_enc = _per_token_scale(tl.max(amax_blk, axis=1), tok_ptr, rows64, tok_stride, row_mask, BITS)
        decode, encode, byte = _block_scales(amax_blk, s_enc, FMT)
        z = _code_sign(x * encode[:, :, None, None], FMT)
        q, _, t = _e2m1_round(tl.minimum(tl.abs(z), 6.0), FMT == KV_FP4)
        if WRITE_OUT:
            val = _with_sign(q, z) * decode[:, :, None, None]
            tl.store(out_ptr + rows64[:, None, None, None] * out_stride + c0 + offs, val.to(out_ptr.dtype.element_ty),
                     mask=m)  # fmt: skip
        if BITS > 0:
            sptr = scale_ptr + rows64[:, None, None] * scale_stride + gidx // G
            tl.store(sptr, byte.to(tl.uint8)[:, :, None] + tl.zeros((1, 1, G), tl.uint8), mask=gmask & first)
            if BITS == 1:
                code = _odd(t)
            elif BITS == 4:
                code = _index(q) | ((z.to(tl.int32, bitcast=True) >> 28) & 8)
            else:
                code = _index(q) & ((1 << BITS) - 1)
            # element i of a group at bit i * BITS: BITS bytes per group of 8
            word = tl.sum(code << (tl.arange(0, 8) * BITS)[None, None, None, :], axis=3)
            rec = rec_ptr + rows64[:, None, None] * rec_stride + gidx * BITS
            for j in tl.static_range(BITS):
                tl.store(rec + j, ((word >> (8 * j)) & 0xFF).to(tl.uint8), mask=gmask)


@triton.jit
def _count(counter_ptr, n):
    """Add a program's count n into the int64 counter (relaxed: only the sum is read, after the kernel), skipping
    zeros; integer addition makes the total independent of the order."""
    tl.atomic_add(counter_ptr, n.to(tl.int64), mask=n > 0, sem="relaxed")


# ----------------------------------------------------------------------------------------------------------------
# 16-element blocks (nvfp4, kv_fp4): one block per thread. A block is loaded as two 8-element halves ([RB, NB, 8]
# each, one 16-byte vector per half for BF16), so its amax, scale and record word stay in the thread that holds it:
# no cross-thread reduction, each scale computed and stored once, and the record's 2 * BITS bytes of a block go out
# in as few stores as the buffer's alignment allows (REC_UNIT bytes each). The guided kernel below holds 16 elements
# per thread the same way for 32-element blocks too (half a block per thread).


@triton.jit
def _half_offsets(NB: tl.constexpr):
    """Column offsets [1, NB, 8] of the first half of each of NB consecutive 16-element blocks."""
    return tl.arange(0, NB)[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]


@triton.jit
def _block_index(c0, NB: tl.constexpr):
    """Index [1, NB] of each block of the chunk starting at column c0, within its row; declared non-contiguous,
    like `_group_index`, so that the scale and record accesses keep the layout of the tile reduced over its halves
    (one block per thread) instead of a vectorized one that would go through shared memory."""
    return tl.max_contiguous(c0 // 16 + tl.arange(0, NB)[None, :], [1, 1])


@triton.jit
def _e4m3_round_hw(v):
    """`_e4m3_round` by the hardware converter (`cvt.rn.satfinite.e4m3x2.f32`, round-half-even like torch's
    `.to(float8_e4m3fn)`); v in [0, 448]. The interpreter's converter does not round to nearest even, so the CPU
    tests run the bit construction instead."""
    if INTERPRET:
        return _e4m3_round(v)
    f8 = v.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    return f8.to(tl.float32), f8.to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def _elements(v):
    """The 8 elements of v [RB, NB, 8], in order, as 8 tensors [RB, NB] (splits within each thread: no data
    movement)."""
    RB: tl.constexpr = v.shape[0]
    NB: tl.constexpr = v.shape[1]
    even, odd = tl.split(tl.reshape(v, (RB, NB, 4, 2)))  # 0 2 4 6 / 1 3 5 7
    e04, e26 = tl.split(tl.reshape(even, (RB, NB, 2, 2)))
    e15, e37 = tl.split(tl.reshape(odd, (RB, NB, 2, 2)))
    e0, e4 = tl.split(e04)
    e2, e6 = tl.split(e26)
    e1, e5 = tl.split(e15)
    e3, e7 = tl.split(e37)
    return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def _shift_in(word, v, BITS: tl.constexpr):
    """word (uint32) shifted right by BITS with the low BITS bits of v entering at the top: one funnel shift."""
    return (word >> BITS) | (v.to(tl.uint32, bitcast=True) << (32 - BITS))


@triton.jit
def _shift_in_half(word, code, BITS: tl.constexpr):
    """`_shift_in` of the 8 codes [RB, NB, 8] of a half, element 0 first."""
    c0, c1, c2, c3, c4, c5, c6, c7 = _elements(code)
    word = _shift_in(_shift_in(_shift_in(_shift_in(word, c0, BITS), c1, BITS), c2, BITS), c3, BITS)
    return _shift_in(_shift_in(_shift_in(_shift_in(word, c4, BITS), c5, BITS), c6, BITS), c7, BITS)


@triton.jit
def _half_word(q, t, z, BITS: tl.constexpr, FMT: tl.constexpr):
    """Low BITS bits of the 8 codes of a half [RB, NB, 8] (q, t from `_e2m1_round`), element i at bit i * BITS:
    int32 [RB, NB]."""
    if BITS == 1:
        code = _odd(t)
    elif BITS == 4:
        code = _index(q) | ((z.to(tl.int32, bitcast=True) >> 28) & 8)
    else:
        code = _index(q) & ((1 << BITS) - 1)
    return tl.sum(code << (tl.arange(0, 8) * BITS)[None, None, :], axis=2)


@triton.jit
def _block_words_by_shifts(qa, ta, qb, tb, BITS: tl.constexpr):
    """(wa, wb) as two `_half_word` for b = 1 or 2, in one word by funnel shifts, one per element: each code (t's
    bit 0, or q's index) enters the word at its top as the word shifts right by BITS, so the first of the 16 ends
    at bit 32 - 16 * BITS. The sum of shifted codes takes a shift and a masking or per element."""
    zero = tl.zeros(qa.shape[:2], tl.uint32)
    if BITS == 1:
        word = _shift_in_half(_shift_in_half(zero, ta.to(tl.int32, bitcast=True), 1), tb.to(tl.int32, bitcast=True), 1)
    else:
        word = _shift_in_half(_shift_in_half(zero, _index(qa), 2), _index(qb), 2)
    word = word >> (32 - 16 * BITS)
    wa = (word & ((1 << (8 * BITS)) - 1)).to(tl.int32, bitcast=True)
    wb = (word >> (8 * BITS)).to(tl.int32, bitcast=True)
    return wa, wb


@triton.jit
def _record_words(qa, ta, za, qb, tb, zb, BITS: tl.constexpr, FMT: tl.constexpr, SHIFTS: tl.constexpr):
    """The record words (wa, wb) of the 16 elements a thread holds as halves a and b (`_half_word` each): by funnel
    shifts (`_block_words_by_shifts`) for b <= 2 where SHIFTS, else as sums of shifted codes."""
    if BITS <= 2 and SHIFTS:
        wa, wb = _block_words_by_shifts(qa, ta, qb, tb, BITS)
    else:
        wa = _half_word(qa, ta, za, BITS, FMT)
        wb = _half_word(qb, tb, zb, BITS, FMT)
    return wa, wb


@triton.jit
def _store_record16(rec, wa, wb, mask, BITS: tl.constexpr, REC_UNIT: tl.constexpr):
    """Store a block's 2 * BITS record bytes (first half's word wa, then wb) at byte pointers rec [RB, NB]."""
    if REC_UNIT == 2 * BITS:  # b = 1 (one 16-bit store) or b = 2 (one 32-bit store)
        if BITS == 1:
            tl.store(rec.to(tl.pointer_type(tl.int16)), (wa | (wb << 8)).to(tl.int16), mask=mask)
        else:
            tl.store(rec.to(tl.pointer_type(tl.int32)), wa | (wb << 16), mask=mask)
    elif REC_UNIT == 4:  # b = 4
        tl.store(rec.to(tl.pointer_type(tl.int32)), wa, mask=mask)
        tl.store((rec + 4).to(tl.pointer_type(tl.int32)), wb, mask=mask)
    elif REC_UNIT == 2:  # b = 2 or 4 on 2-byte alignment
        for j in tl.static_range(BITS // 2):
            tl.store((rec + 2 * j).to(tl.pointer_type(tl.int16)), (wa >> (16 * j)).to(tl.int16), mask=mask)
            tl.store((rec + BITS + 2 * j).to(tl.pointer_type(tl.int16)), (wb >> (16 * j)).to(tl.int16), mask=mask)
    else:
        for j in tl.static_range(BITS):
            tl.store(rec + j, ((wa >> (8 * j)) & 0xFF).to(tl.uint8), mask=mask)
            tl.store(rec + BITS + j, ((wb >> (8 * j)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _load_record16(rec, mask, BITS: tl.constexpr, REC_UNIT: tl.constexpr):
    """(wa, wb): the record words of both halves of a block, loaded as `_store_record16` stores them."""
    if REC_UNIT == 2 * BITS:
        if BITS == 1:
            w = tl.load(rec.to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32)
            wa, wb = w & 0xFF, (w >> 8) & 0xFF
        else:
            w = tl.load(rec.to(tl.pointer_type(tl.int32)), mask=mask, other=0)
            wa, wb = w & 0xFFFF, (w >> 16) & 0xFFFF
    elif REC_UNIT == 4:
        wa = tl.load(rec.to(tl.pointer_type(tl.int32)), mask=mask, other=0)
        wb = tl.load((rec + 4).to(tl.pointer_type(tl.int32)), mask=mask, other=0)
    elif REC_UNIT == 2:
        wa = tl.zeros(mask.shape, tl.int32)
        wb = tl.zeros(mask.shape, tl.int32)
        for j in tl.static_range(BITS // 2):
            ha = tl.load((rec + 2 * j).to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32) & 0xFFFF
            hb = tl.load((rec + BITS + 2 * j).to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32) & 0xFFFF
            wa |= ha << (16 * j)
            wb |= hb << (16 * j)
    else:
        wa = tl.zeros(mask.shape, tl.int32)
        wb = tl.zeros(mask.shape, tl.int32)
        for j in tl.static_range(BITS):
            wa |= tl.load(rec + j, mask=mask, other=0).to(tl.int32) << (8 * j)
            wb |= tl.load(rec + BITS + j, mask=mask, other=0).to(tl.int32) << (8 * j)
    return wa, wb


@triton.jit
def _spread(v, N: tl.constexpr):
    """v [RB, NB / N] back on the [RB, NB] entries it was reduced from, N per group (`_pair_max`): each entry gets
    its group's value, which the threads of the group already hold (no data movement)."""
    RB: tl.constexpr = v.shape[0]
    G: tl.constexpr = v.shape[1]
    return tl.reshape(tl.broadcast_to(v[:, :, None], (RB, G, N)), (RB, G * N))


@triton.jit
def _store_halves(o, qa, za, qb, zb, decode, m):
    """Store a block's fake-quantized halves [RB, NB, 8] (magnitudes q, signs of z) at pointers o and o + 8."""
    ty = o.dtype.element_ty
    tl.store(o, (_with_sign(qa, za) * decode[:, :, None]).to(ty), mask=m)
    tl.store(o + 8, (_with_sign(qb, zb) * decode[:, :, None]).to(ty), mask=m)


@triton.jit
def _quantize_chunk16(
    xa, xb, s_enc, rows64, row_mask, c0, offs, m, blk, bmask, out_ptr, rec_ptr, scale_ptr, tok_ptr,
    out_stride, rec_stride, scale_stride, tok_stride,
    FMT: tl.constexpr, SCALE_MODE: tl.constexpr, BITS: tl.constexpr, WRITE_OUT: tl.constexpr,
    ONE_PASS: tl.constexpr, REC_UNIT: tl.constexpr, RECORD_FIRST: tl.constexpr, BLOCK: tl.constexpr = 16,
):  # fmt: skip
    """Quantize the chunk of rows [RB] (`rows64`, `row_mask`) from column c0 whose 16-element units' halves xa, xb
    [RB, NB, 8] (FP32, at offsets c0 + offs: element mask m, unit index blk within the row, unit mask bmask) are
    loaded, and store its output and / or record. A unit is a block (BLOCK 16: `_quantize_record16_kernel` and the
    token-group kernel) or half of one (BLOCK 32: `_quantize_record32_halves_kernel`, whose pairs of neighbouring
    threads share a block's amax and its first stores the scale byte). s_enc is unused where the scales are per
    token and the row is this chunk (ONE_PASS): they are computed here."""
    amax_blk = tl.maximum(tl.max(tl.abs(xa), axis=2), tl.max(tl.abs(xb), axis=2))
    if BLOCK == 32:
        amax_blk = _pair_max(amax_blk)
    if SCALE_MODE == SCALE_PER_TOKEN and ONE_PASS:
        s_enc = _per_token_scale(tl.max(amax_blk, axis=1), tok_ptr, rows64, tok_stride, row_mask, BITS)
    decode, encode, byte = _block_scales(amax_blk, s_enc, FMT, HW_E4M3=True)
    za = _code_sign(xa * encode[:, :, None], FMT)
    zb = _code_sign(xb * encode[:, :, None], FMT)
    qa, _, ta = _e2m1_round(tl.minimum(tl.abs(za), 6.0), FMT == KV_FP4)
    qb, _, tb = _e2m1_round(tl.minimum(tl.abs(zb), 6.0), FMT == KV_FP4)
    if WRITE_OUT and not RECORD_FIRST:
        _store_halves(out_ptr + rows64[:, None, None] * out_stride + c0 + offs, qa, za, qb, zb, decode, m)
    if BITS > 0:
        # per-token rows in one chunk keep the sum: 1.9 % slower by shifts (H200, nvfp4, D = 4096, T = 65536)
        shifts = not (SCALE_MODE == SCALE_PER_TOKEN and ONE_PASS)
        wa, wb = _record_words(qa, ta, za, qb, tb, zb, BITS, FMT, shifts)
        if BLOCK == 32:
            smask = bmask & (blk % 2 == 0)
        else:
            smask = bmask
        tl.store(scale_ptr + rows64[:, None] * scale_stride + blk // (BLOCK // 16), byte.to(tl.uint8), mask=smask)
        _store_record16(rec_ptr + rows64[:, None] * rec_stride + blk * (2 * BITS), wa, wb, bmask, BITS,
                        REC_UNIT)  # fmt: skip
    if WRITE_OUT and RECORD_FIRST:
        _store_halves(out_ptr + rows64[:, None, None] * out_stride + c0 + offs, qa, za, qb, zb, decode, m)


@triton.jit
def _halves_amax(xa, xb):
    """Amax of each row [RB] of block halves xa, xb [RB, NB, 8] (in x's dtype)."""
    a = tl.maximum(tl.max(tl.abs(xa.to(tl.float32)), axis=2), tl.max(tl.abs(xb.to(tl.float32)), axis=2))
    return tl.max(a, axis=1)


@triton.jit
def _two_chunk_amax(a0, b0, a1, b1):
    """Amax of each row [RB] of two chunks' block halves [RB, NB, 8] (`_two_chunk_loads`, in x's dtype)."""
    return tl.maximum(_halves_amax(a0, b0), _halves_amax(a1, b1))


@triton.jit
def _two_chunk_loads(x_rows, row_mask, offs, D, C: tl.constexpr):
    """The block halves (a0, b0, a1, b1) of rows of at most two chunks of C columns, at x_rows (+ offs) (row_mask
    [RB, 1, 1]), in x's dtype: all four loads issued before any is used."""
    a0 = tl.load(x_rows, mask=row_mask & (offs < D), other=0.0)
    b0 = tl.load(x_rows + 8, mask=row_mask & (offs < D), other=0.0)
    a1 = tl.load(x_rows + C, mask=row_mask & (C + offs < D), other=0.0)
    b1 = tl.load(x_rows + C + 8, mask=row_mask & (C + offs < D), other=0.0)
    return a0, b0, a1, b1


@triton.jit
def _quantize_record16_kernel(
    x_ptr, out_ptr, rec_ptr, scale_ptr, gs_ptr, tok_ptr,
    T, D, x_stride, out_stride, rec_stride, scale_stride, tok_stride, chunks_per_prog,
    FMT: tl.constexpr, SCALE_MODE: tl.constexpr, BITS: tl.constexpr, WRITE_OUT: tl.constexpr,
    RB: tl.constexpr, C: tl.constexpr, ONE_PASS: tl.constexpr, REC_UNIT: tl.constexpr, RECORD_FIRST: tl.constexpr,
    ROW_LOOP: tl.constexpr = 1, PREFETCH: tl.constexpr = False,
):  # fmt: skip
    """`_quantize_record_kernel` for 16-element blocks, one block per thread (see above); each program takes
    ROW_LOOP tiles of RB rows one after the other, unrolled (its warps stay resident while earlier stores drain).
    With PREFETCH (per-token rows of one or two chunks, `launch.prefetched`) they are a loop instead, and each tile's
    x is loaded before the previous tile is quantized: the loads stay in flight across the row reduction and the
    stores. Rows of two chunks take their amax from those loads and read x again for the quantize pass.

    RECORD_FIRST (`launch.record_first`: the tile gives each thread whole blocks) stores the record before the
    output. Such a thread's two 16-byte output stores fill the two halves of the same 32-byte sectors (lanes are
    32 bytes apart); issued back to back, the L1 merges them into whole sectors. With the record after them,
    ptxas issues the first half's store as soon as it is computed, about 100 instructions before the second: the
    halves reach the L2 apart, as 1.5 x the write sectors, on a unit already near its limit (H200, kv_fp4,
    T = 65536, D = 4096: the record's cost fell from +30 % to +0.5 %; docs/performance.md). Stores keep their
    order and the record needs both halves, so the output's stores follow it together. Where a block spans two
    threads (a tile of fewer blocks than threads: rows of at most 256 columns by default), their stores are
    adjacent either way and the output goes first."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    NB: tl.constexpr = C // 16
    offs = _half_offsets(NB)
    if PREFETCH and not ONE_PASS:
        tl.static_assert(SCALE_MODE == SCALE_PER_TOKEN)
        rows = pid_r * ROW_LOOP * RB + tl.arange(0, RB)
        x_rows = x_ptr + rows.to(tl.int64)[:, None, None] * x_stride + offs
        a0, b0, a1, b1 = _two_chunk_loads(x_rows, (rows < T)[:, None, None], offs, D, C)
        s_enc = _per_token_scale(
            _two_chunk_amax(a0, b0, a1, b1), tok_ptr, rows.to(tl.int64), tok_stride, rows < T, BITS
        )
        for ri in range(ROW_LOOP):
            row_mask = rows < T
            rows64 = rows.to(tl.int64)
            ahead = (rows + RB < T) & (ri + 1 < ROW_LOOP)
            na0, nb0, na1, nb1 = _two_chunk_loads(x_rows + RB * x_stride, ahead[:, None, None], offs, D, C)
            for ci in range(chunks_per_prog):
                c0 = ci * C
                m = row_mask[:, None, None] & (c0 + offs < D)
                blk = _block_index(c0, NB)
                xa = tl.load(x_rows + c0, mask=m, other=0.0).to(tl.float32)
                xb = tl.load(x_rows + c0 + 8, mask=m, other=0.0).to(tl.float32)
                _quantize_chunk16(xa, xb, s_enc, rows64, row_mask, c0, offs, m, blk,
                                  row_mask[:, None] & (blk < D // 16), out_ptr, rec_ptr, scale_ptr, tok_ptr,
                                  out_stride, rec_stride, scale_stride, tok_stride, FMT, SCALE_MODE, BITS, WRITE_OUT,
                                  ONE_PASS, REC_UNIT, RECORD_FIRST)  # fmt: skip
            s_enc = _per_token_scale(_two_chunk_amax(na0, nb0, na1, nb1), tok_ptr, rows64 + RB, tok_stride, ahead, BITS)
            rows += RB
            x_rows += RB * x_stride
    elif PREFETCH:
        tl.static_assert(SCALE_MODE == SCALE_PER_TOKEN)
        blk = _block_index(0, NB)
        cols = offs < D
        rows = pid_r * ROW_LOOP * RB + tl.arange(0, RB)
        x_rows = x_ptr + rows.to(tl.int64)[:, None, None] * x_stride + offs
        m = (rows < T)[:, None, None] & cols
        xa, xb = tl.load(x_rows, mask=m, other=0.0), tl.load(x_rows + 8, mask=m, other=0.0)
        for ri in range(ROW_LOOP):
            row_mask = rows < T
            m = row_mask[:, None, None] & cols
            nxt = (rows + RB < T)[:, None, None] & cols & (ri + 1 < ROW_LOOP)
            na = tl.load(x_rows + RB * x_stride, mask=nxt, other=0.0)
            nb = tl.load(x_rows + RB * x_stride + 8, mask=nxt, other=0.0)
            _quantize_chunk16(xa.to(tl.float32), xb.to(tl.float32), 1.0, rows.to(tl.int64), row_mask, 0, offs, m, blk,
                              row_mask[:, None] & (blk < D // 16), out_ptr, rec_ptr, scale_ptr, tok_ptr, out_stride,
                              rec_stride, scale_stride, tok_stride, FMT, SCALE_MODE, BITS, WRITE_OUT, ONE_PASS,
                              REC_UNIT, RECORD_FIRST)  # fmt: skip
            rows += RB
            x_rows += RB * x_stride
            xa, xb = na, nb
    else:
        for ri in tl.static_range(ROW_LOOP):
            rows = (pid_r * ROW_LOOP + ri) * RB + tl.arange(0, RB)
            row_mask = rows < T
            rows64 = rows.to(tl.int64)
            x_rows = x_ptr + rows64[:, None, None] * x_stride

            s_enc = 1.0  # per-token rows in one chunk: computed in the chunk
            if SCALE_MODE != SCALE_PER_TOKEN:
                s_enc = _static_scale(gs_ptr, rows, row_mask, SCALE_MODE, 2)
            elif not ONE_PASS:
                s_enc = _per_token_scale(_row_amax(x_ptr, rows64, row_mask, x_stride, D, RB, C), tok_ptr, rows64,
                                         tok_stride, row_mask, BITS)  # fmt: skip

            for ci in range(chunks_per_prog):
                c0 = (pid_c * chunks_per_prog + ci) * C
                m = row_mask[:, None, None] & (c0 + offs < D)  # D is a multiple of 16: both halves share the mask
                blk = _block_index(c0, NB)
                bmask = row_mask[:, None] & (blk < D // 16)
                xa = tl.load(x_rows + c0 + offs, mask=m, other=0.0).to(tl.float32)
                xb = tl.load(x_rows + c0 + 8 + offs, mask=m, other=0.0).to(tl.float32)
                _quantize_chunk16(xa, xb, s_enc, rows64, row_mask, c0, offs, m, blk, bmask, out_ptr, rec_ptr,
                                  scale_ptr, tok_ptr, out_stride, rec_stride, scale_stride, tok_stride, FMT, SCALE_MODE,
                                  BITS, WRITE_OUT, ONE_PASS, REC_UNIT, RECORD_FIRST)  # fmt: skip


@triton.jit
def _guided_half(x, encode, decode, word, BITS: tl.constexpr, RECORD_BITS: tl.constexpr, FMT: tl.constexpr):
    """Guided value, redirected flags and flip flags (int32) of a half [RB, NB, 8] from its record word [RB, NB]: a
    flip is a guided code whose low RECORD_BITS bits differ from the record's."""
    recorded = (word[:, :, None] >> (tl.arange(0, 8) * RECORD_BITS)[None, None, :]) & ((1 << RECORD_BITS) - 1)
    c = recorded & ((1 << BITS) - 1)
    z = _code_sign(x * encode[:, :, None], FMT)  # only its sign is used: clamping |z| to 6 is clamping z
    a = tl.minimum(tl.abs(z), 6.0)
    if BITS == 1:
        # the bracket end whose index bit 0 is the rollout's: a rounded down or up to the grid (the same point when
        # a is on it), as t = q + base * 2^22, whose low bit is that parity (`_e2m1_round`)
        base = _binade(a)
        t_lo = _fma_directed(base, TWO_22, a, False)
        t_hi = _fma_directed(base, TWO_22, a, True)
        t = tl.where((_odd(t_lo) ^ c) == 0, t_lo, t_hi)
        _, _, t_rtn = _e2m1_round(a, FMT == KV_FP4)
        mag = t - base * TWO_22
        return (
            _with_sign(mag, z) * decode[:, :, None],
            tl.where(t != t_rtn, 1, 0),
            _flipped(mag, z, recorded, RECORD_BITS),
        )
    q, base, _ = _e2m1_round(a, False)
    d = a - q
    step = base * 0.5
    if FMT == KV_FP4:
        rtn = tl.where(d == base * 0.25, q + step, q)  # ties up: a tie has a above q
    else:
        rtn = q
    lo = tl.where(d < 0, q - step, q)
    hi = tl.where(d > 0, q + step, q)
    if BITS == 4:
        q_roll = (((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True) * TWO_126
        d_lo = tl.abs(_with_sign(lo, z) - q_roll)
        d_hi = tl.abs(_with_sign(hi, z) - q_roll)
        mag = tl.where(d_hi < d_lo, hi, lo)
    else:
        MASK: tl.constexpr = (1 << BITS) - 1
        k_lo = _index(lo)
        k_hi = _index(hi)
        below = k_lo - 1 - ((k_lo - 1 - c) & MASK)
        above = k_hi + 1 + ((c - k_hi - 1) & MASK)
        mid = _magnitude(tl.maximum(below, 0)) + _magnitude(tl.minimum(above, 7))
        twice = 2.0 * a
        outer = tl.where(twice < mid, lo, tl.where(twice > mid, hi, rtn))
        outer = tl.where(below < 0, hi, tl.where(above > 7, lo, outer))
        mag = tl.where((k_lo & MASK) == c, lo, tl.where((k_hi & MASK) == c, hi, outer))
    return _with_sign(mag, z) * decode[:, :, None], tl.where(mag != rtn, 1, 0), _flipped(mag, z, recorded, RECORD_BITS)


@triton.jit
def _flipped(mag, z, recorded, RECORD_BITS: tl.constexpr):
    """1 where the code of magnitude `mag` with the sign of z differs from the record's code bits in its low
    RECORD_BITS bits (the sign is bit 3), else 0 (int32)."""
    code = _index(mag) | ((z.to(tl.int32, bitcast=True) >> 28) & 8)
    return tl.where((code & ((1 << RECORD_BITS) - 1)) != recorded, 1, 0)


@triton.jit
def _guided_kernel(
    x_ptr, out_ptr, rec_ptr, scale_ptr, gs_ptr, has_ptr, redirect_ptr, flip_ptr,
    T, D, x_stride, out_stride, rec_stride, scale_stride,
    FMT: tl.constexpr, SCALE_MODE: tl.constexpr, BITS: tl.constexpr, RECORD_BITS: tl.constexpr, HAS_MASK: tl.constexpr,
    RB: tl.constexpr, C: tl.constexpr, REC_UNIT: tl.constexpr, BLOCK: tl.constexpr, ROW_LOOP: tl.constexpr = 1,
):  # fmt: skip
    """Guided rounding (docs/numerics.md, "Guided rounding", steps 1-5) of rows [RB] x one chunk of C columns under
    the record's scales, 16 elements per thread as two 8-element halves: a block of BLOCK = 16, or half of one of
    32 (whose two threads each load its scale byte). A thread's scale byte and record words are loaded and decoded
    once. Each program takes ROW_LOOP tiles of RB rows one after the other (a loop, not unrolled: the
    registers of one tile) and adds their redirected and flip counts into the two counters once: fewer atomic adds
    on each address."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    NB: tl.constexpr = C // 16
    c0 = pid_c * C
    offs = _half_offsets(NB)
    blk = _block_index(c0, NB)
    redirected = tl.zeros((RB, NB), tl.int32)  # per block: a sum within each thread
    flipped = tl.zeros((RB, NB), tl.int32)
    for ri in range(ROW_LOOP):
        rows = (pid_r * ROW_LOOP + ri) * RB + tl.arange(0, RB)
        row_mask = rows < T
        rows64 = rows.to(tl.int64)
        m = row_mask[:, None, None] & (c0 + offs < D)
        bmask = row_mask[:, None] & (blk < D // 16)

        byte = tl.load(scale_ptr + rows64[:, None] * scale_stride + blk // (BLOCK // 16), mask=bmask, other=0)
        if FMT == NVFP4:
            s_enc = _static_scale(gs_ptr, rows, row_mask, SCALE_MODE, 2)
            if INTERPRET:
                sf = _e4m3_decode(byte.to(tl.int32))
            else:
                sf = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            decode = sf * _rcp(s_enc)
            encode = tl.minimum(_rcp(decode), FLT_MAX)
        else:
            e = byte.to(tl.int32) - 127
            decode = _pow2(e)
            encode = _pow2(-e)
        wa, wb = _load_record16(rec_ptr + rows64[:, None] * rec_stride + blk * (2 * RECORD_BITS), bmask, RECORD_BITS,
                                REC_UNIT)  # fmt: skip

        x_rows = x_ptr + rows64[:, None, None] * x_stride + c0 + offs
        o_rows = out_ptr + rows64[:, None, None] * out_stride + c0 + offs
        xa = tl.load(x_rows, mask=m, other=0.0).to(tl.float32)
        xb = tl.load(x_rows + 8, mask=m, other=0.0).to(tl.float32)
        va, ra, fa = _guided_half(xa, encode, decode, wa, BITS, RECORD_BITS, FMT)
        vb, rb, fb = _guided_half(xb, encode, decode, wb, BITS, RECORD_BITS, FMT)
        tl.store(o_rows, va.to(out_ptr.dtype.element_ty), mask=m)
        tl.store(o_rows + 8, vb.to(out_ptr.dtype.element_ty), mask=m)
        counted = m
        if HAS_MASK:
            counted = counted & (tl.load(has_ptr + rows, mask=row_mask, other=0) != 0)[:, None, None]
        redirected += tl.sum(tl.where(counted, ra + rb, 0), axis=2)
        flipped += tl.sum(tl.where(counted, fa + fb, 0), axis=2)
    _count(redirect_ptr, tl.sum(tl.sum(redirected, axis=1), axis=0))
    _count(flip_ptr, tl.sum(tl.sum(flipped, axis=1), axis=0))


# ----------------------------------------------------------------------------------------------------------------
# 32-element blocks (mxfp4, mxfp4_ocp): half a block per thread. A thread holds 16 consecutive elements as two
# 8-element halves, as the 16-element kernels hold a block (one 16-byte vector per half for BF16), and a block's two
# halves lie in neighbouring threads: its amax is the larger of theirs (one warp shuffle), each computes the block's
# scale, and each stores the record bytes of its own 16 elements.


@triton.jit
def _pair_max(v):
    """The larger of each pair of neighbouring entries of v [RB, NH] (the two halves of a 32-element block), on
    both of them: a reduction over the two threads that hold them and a broadcast back (`_spread`)."""
    RB: tl.constexpr = v.shape[0]
    NH: tl.constexpr = v.shape[1]
    return _spread(tl.max(tl.reshape(v, (RB, NH // 2, 2)), axis=2), 2)


@triton.jit
def _quantize_record32_halves_kernel(
    x_ptr, out_ptr, rec_ptr, scale_ptr, T, D, x_stride, out_stride, rec_stride, scale_stride,
    FMT: tl.constexpr, BITS: tl.constexpr, WRITE_OUT: tl.constexpr, RB: tl.constexpr, C: tl.constexpr,
    REC_UNIT: tl.constexpr, RECORD_FIRST: tl.constexpr,
):  # fmt: skip
    """`_quantize_record_kernel` for 32-element blocks with E8M0 scales, half a block per thread (see above): rows
    [RB] x one chunk of C columns. RECORD_FIRST (`launch.record_first`: each thread holds whole halves) stores the
    record before the output, so that a thread's two 16-byte output stores issue back to back (the reason is in
    `_quantize_record16_kernel`)."""
    pid_r = tl.program_id(0)
    c0 = tl.program_id(1) * C
    NH: tl.constexpr = C // 16
    offs = _half_offsets(NH)
    rows = pid_r * RB + tl.arange(0, RB)
    row_mask = rows < T
    rows64 = rows.to(tl.int64)
    m = row_mask[:, None, None] & (c0 + offs < D)  # D is a multiple of 32: both halves share the mask
    half = _block_index(c0, NH)  # index of each 16-element half-block within its row
    x_rows = x_ptr + rows64[:, None, None] * x_stride + c0 + offs
    xa = tl.load(x_rows, mask=m, other=0.0).to(tl.float32)
    xb = tl.load(x_rows + 8, mask=m, other=0.0).to(tl.float32)
    # scale_ptr stands in for the token-scale pointer, which E8M0 formats do not use
    _quantize_chunk16(xa, xb, 1.0, rows64, row_mask, c0, offs, m, half, row_mask[:, None] & (half < D // 16), out_ptr,
                      rec_ptr, scale_ptr, scale_ptr, out_stride, rec_stride, scale_stride, 0, FMT, SCALE_NONE, BITS,
                      WRITE_OUT, False, REC_UNIT, RECORD_FIRST, 32)  # fmt: skip
