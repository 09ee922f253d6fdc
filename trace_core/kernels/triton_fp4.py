"""Triton kernels: fused FP4 quantize-and-record, and guided fake-quant from a record.

Each kernel is the twin of a `trace_core` reference function and is tested against it bit for bit:
`_quantize_record_kernel` ↔ `quant.quantize` + `quant.dequantize` + `records.pack_low_bits`, and
`_guided_kernel` ↔ `guided.guided_quantize` + `quant.dequantize`. Exactness rules: FP32 throughout, IEEE division
(`div_rn`) where the contract divides, E4M3 and powers of two built from bits (no approximate conversions), the
KV exponent through libdevice `log2` (what torch's CUDA `log2` runs).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

# Format ids (constexpr): must match ops.FORMAT_IDS.
NVFP4 = tl.constexpr(0)
MXFP4 = tl.constexpr(1)
MXFP4_OCP = tl.constexpr(2)
KV_FP4 = tl.constexpr(3)
# Global-scale modes for nvfp4.
SCALE_NONE = tl.constexpr(0)  # E8M0 formats
SCALE_SCALAR = tl.constexpr(1)  # one static / per-tensor S_enc
SCALE_ROW = tl.constexpr(2)  # one static S_enc per row
SCALE_PER_TOKEN = tl.constexpr(3)  # S_enc computed from each row's amax

# The interpreter (TRITON_INTERPRET=1, CPU tests) has no libdevice; numpy's log2 stands in for it there.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
FLT_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH = tl.constexpr(0.1666666716337204)  # fp32(1/6)


@triton.jit
def _pow2(n):
    """2^n as FP32 for integer n in [-127, 127], built from bits (2^-127 is subnormal)."""
    normal = ((n + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(n >= -126, normal, tl.full(n.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True))


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
    """FP32 value of an E4M3 byte (non-negative scales only)."""
    e = (byte >> 3) & 0xF
    m = byte & 0x7
    normal = (((e - 7 + 127) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)


@triton.jit
def _e8m0_exponent(amax, FMT: tl.constexpr):
    """Integer block exponent of an E8M0 scale, as in `quant._e8m0_exponent`."""
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
def _magnitude(k):
    """E2M1 magnitude of index k (0..7)."""
    kf = k.to(tl.float32)
    return tl.where(k < 4, kf * 0.5, tl.where(k < 7, kf - 2.0, 6.0))


@triton.jit
def _round_index(a, TIES_UP: tl.constexpr):
    """Index of the E2M1 magnitude a >= 0 rounds to (RNE or ties-up), saturating at 7."""
    if TIES_UP:
        k = (a >= 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a >= 1.25).to(tl.int32)
        k += (a >= 1.75).to(tl.int32) + (a >= 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a >= 5.0).to(tl.int32)
    else:
        k = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
        k += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return k


@triton.jit
def _negative(z, FMT: tl.constexpr):
    """Sign bit of a code: signbit(z) for hardware-like formats, z < 0 for SGLang's KV."""
    if FMT == KV_FP4:
        neg = z < 0
    else:
        neg = z.to(tl.int32, bitcast=True) < 0
    return neg


@triton.jit
def _store_low_bits(
    rec_ptr, rows, row_mask, rec_stride, cols0, D, low, BITS: tl.constexpr, RB: tl.constexpr, C: tl.constexpr
):
    """Pack low code bits [RB, C] densely (element i at bit i*BITS, LSB first) and store them."""
    groups = tl.reshape(low, (RB, C // 8, 8))
    shifts = tl.arange(0, 8) * BITS
    word = tl.sum(groups << shifts[None, None, :], axis=2)  # [RB, C // 8], at most 32 bits
    gidx = (cols0 // 8) + tl.arange(0, C // 8)
    for j in tl.static_range(BITS):
        byte = ((word >> (8 * j)) & 0xFF).to(tl.uint8)
        ptrs = rec_ptr + rows[:, None] * rec_stride + gidx[None, :] * BITS + j
        tl.store(ptrs, byte, mask=row_mask[:, None] & (gidx[None, :] < D // 8))


@triton.jit
def _load_low_bits(
    rec_ptr, rows, row_mask, rec_stride, cols0, D, BITS: tl.constexpr, RB: tl.constexpr, C: tl.constexpr
):
    """Inverse of `_store_low_bits`: low code bits [RB, C] as int32."""
    gidx = (cols0 // 8) + tl.arange(0, C // 8)
    word = tl.zeros((RB, C // 8), tl.int32)
    for j in tl.static_range(BITS):
        ptrs = rec_ptr + rows[:, None] * rec_stride + gidx[None, :] * BITS + j
        gmask = row_mask[:, None] & (gidx[None, :] < D // 8)
        word |= tl.load(ptrs, mask=gmask, other=0).to(tl.int32) << (8 * j)
    shifts = tl.arange(0, 8) * BITS
    low = (word[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(low, (RB, C))


@triton.jit
def _block_scales(amax_blk, s_enc, FMT: tl.constexpr):
    """(decode, encode, byte) of each block from its amax (and S_enc for nvfp4)."""
    if FMT == NVFP4:
        sf = amax_blk * (s_enc * ONE_SIXTH)
        value, byte = _e4m3_round(tl.minimum(sf, 448.0))
        decode = value * tl.math.div_rn(1.0, s_enc)
        encode = tl.minimum(tl.math.div_rn(1.0, decode), FLT_MAX)
    else:
        e = _e8m0_exponent(amax_blk, FMT)
        byte = e + 127
        decode = _pow2(e)
        encode = _pow2(-e)
    return decode, encode, byte


@triton.jit
def _quantize_record_kernel(
    x_ptr, out_ptr, rec_ptr, scale_ptr, gs_ptr, tok_ptr,
    T, D, x_stride, out_stride, rec_stride, scale_stride, tok_stride, chunks_per_prog,
    FMT: tl.constexpr, SCALE_MODE: tl.constexpr, BITS: tl.constexpr, WRITE_OUT: tl.constexpr,
    BLOCK: tl.constexpr, RB: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    """Quantize rows [RB] x columns in chunks of C; write the fake-quantized output and/or the record."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * RB + tl.arange(0, RB)
    row_mask = rows < T
    rows64 = rows.to(tl.int64)
    NB: tl.constexpr = C // BLOCK

    if SCALE_MODE == SCALE_PER_TOKEN:
        amax_row = tl.zeros((RB,), tl.float32)
        for c0 in range(0, D, C):
            cols = c0 + tl.arange(0, C)
            m = row_mask[:, None] & (cols[None, :] < D)
            x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
            amax_row = tl.maximum(amax_row, tl.max(tl.abs(x), axis=1))
        s_enc = tl.where(amax_row > 0, tl.minimum(tl.math.div_rn(2688.0, amax_row), FLT_MAX), 1.0)
        if BITS > 0:
            tl.store(tok_ptr + rows64 * tok_stride, s_enc, mask=row_mask)
        s_enc = s_enc[:, None]
    elif SCALE_MODE == SCALE_ROW:
        s_enc = tl.load(gs_ptr + rows, mask=row_mask, other=1.0)[:, None]
    elif SCALE_MODE == SCALE_SCALAR:
        s_enc = tl.load(gs_ptr)
    else:
        s_enc = 1.0

    for ci in range(chunks_per_prog):
        c0 = (pid_c * chunks_per_prog + ci) * C
        cols = c0 + tl.arange(0, C)
        m = row_mask[:, None] & (cols[None, :] < D)
        x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=m, other=0.0)
        xf = tl.reshape(x.to(tl.float32), (RB, NB, BLOCK))
        amax_blk = tl.max(tl.abs(xf), axis=2)
        decode, encode, byte = _block_scales(amax_blk, s_enc, FMT)
        z = xf * encode[:, :, None]
        neg = _negative(z, FMT)
        k = _round_index(tl.abs(z), FMT == KV_FP4)
        if WRITE_OUT:
            mag = _magnitude(k) * decode[:, :, None]
            val = tl.reshape(tl.where(neg, -mag, mag), (RB, C))
            tl.store(out_ptr + rows64[:, None] * out_stride + cols[None, :], val.to(out_ptr.dtype.element_ty), mask=m)
        if BITS > 0:
            bcols = c0 // BLOCK + tl.arange(0, NB)
            bmask = row_mask[:, None] & (bcols[None, :] < D // BLOCK)
            tl.store(scale_ptr + rows64[:, None] * scale_stride + bcols[None, :], byte.to(tl.uint8), mask=bmask)
            code = tl.reshape(k | (neg.to(tl.int32) << 3), (RB, C))
            low = code & ((1 << BITS) - 1)
            _store_low_bits(rec_ptr, rows64, row_mask, rec_stride, c0, D, low, BITS, RB, C)


@triton.jit
def _guided_kernel(
    x_ptr, out_ptr, rec_ptr, scale_ptr, gs_ptr, has_ptr, redirect_ptr,
    T, D, x_stride, out_stride, rec_stride, scale_stride,
    FMT: tl.constexpr, SCALE_MODE: tl.constexpr, BITS: tl.constexpr, RECORD_BITS: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK: tl.constexpr, RB: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    """Guided rounding (DESIGN §2 steps 1-5) of rows [RB] x one chunk of C columns under the record's scales."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * RB + tl.arange(0, RB)
    row_mask = rows < T
    rows64 = rows.to(tl.int64)
    NB: tl.constexpr = C // BLOCK
    c0 = pid_c * C
    cols = c0 + tl.arange(0, C)
    m = row_mask[:, None] & (cols[None, :] < D)

    bcols = c0 // BLOCK + tl.arange(0, NB)
    bmask = row_mask[:, None] & (bcols[None, :] < D // BLOCK)
    byte = tl.load(scale_ptr + rows64[:, None] * scale_stride + bcols[None, :], mask=bmask, other=0).to(tl.int32)
    if FMT == NVFP4:
        if SCALE_MODE == SCALE_SCALAR:
            s_enc = tl.load(gs_ptr)
        else:
            s_enc = tl.load(gs_ptr + rows, mask=row_mask, other=1.0)[:, None]
        decode = _e4m3_decode(byte) * tl.math.div_rn(1.0, s_enc)
        encode = tl.minimum(tl.math.div_rn(1.0, decode), FLT_MAX)
    else:
        decode = _pow2(byte - 127)
        encode = _pow2(127 - byte)

    x = tl.load(x_ptr + rows64[:, None] * x_stride + cols[None, :], mask=m, other=0.0)
    xf = tl.reshape(x.to(tl.float32), (RB, NB, BLOCK))
    z = tl.minimum(tl.maximum(xf * encode[:, :, None], -6.0), 6.0)
    neg = _negative(z, FMT)
    a = tl.abs(z)
    lo = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32) + (a >= 2.0).to(tl.int32)
    lo += (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32) + (a >= 6.0).to(tl.int32)
    hi = tl.where(_magnitude(lo) == a, lo, tl.minimum(lo + 1, 7))
    rtn = _round_index(a, FMT == KV_FP4)
    c = _load_low_bits(rec_ptr, rows64, row_mask, rec_stride, c0, D, RECORD_BITS, RB, C) & ((1 << BITS) - 1)
    c = tl.reshape(c, (RB, NB, BLOCK))
    if BITS == 4:
        sign = tl.where(neg, -1.0, 1.0)
        q_roll = tl.where((c & 8) != 0, -_magnitude(c & 7), _magnitude(c & 7))
        d_lo = tl.abs(sign * _magnitude(lo) - q_roll)
        d_hi = tl.abs(sign * _magnitude(hi) - q_roll)
        k = tl.where(d_hi < d_lo, hi, lo)
    else:
        MASK: tl.constexpr = (1 << BITS) - 1
        below = lo - 1 - ((lo - 1 - c) & MASK)  # largest index < lo with matching low bits (< 0: none)
        above = hi + 1 + ((c - hi - 1) & MASK)  # smallest index > hi with matching low bits (> 7: none)
        twice = 2.0 * a
        mid = _magnitude(tl.maximum(below, 0)) + _magnitude(tl.minimum(above, 7))
        outer = tl.where(twice < mid, lo, tl.where(twice > mid, hi, rtn))
        outer = tl.where(below < 0, hi, tl.where(above > 7, lo, outer))
        k = tl.where((lo & MASK) == c, lo, tl.where((hi & MASK) == c, hi, outer))
    mag = _magnitude(k) * decode[:, :, None]
    val = tl.reshape(tl.where(neg, -mag, mag), (RB, C))
    tl.store(out_ptr + rows64[:, None] * out_stride + cols[None, :], val.to(out_ptr.dtype.element_ty), mask=m)
    counted = m
    if HAS_MASK:
        counted = counted & (tl.load(has_ptr + rows, mask=row_mask, other=0) != 0)[:, None]
    redirected = tl.where(tl.reshape(counted, (RB, NB, BLOCK)), (k != rtn).to(tl.int32), 0)
    # one partial count per program (a single atomic counter would serialize every program on one address)
    tl.store(
        redirect_ptr + pid_r * tl.num_programs(1) + pid_c, tl.sum(tl.sum(tl.sum(redirected, axis=2), axis=1), axis=0)
    )
