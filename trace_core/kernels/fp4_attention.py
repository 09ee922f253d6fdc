"""Paged decode attention that reads SGLang's FP4 KV pool directly: packed E2M1 codes and their scale bytes (E8M0
for `kv_fp4`, E4M3 for NVFP4 KV under its static unit global scale: `kv_fmt`) are dequantized to BF16 in registers,
then attended over exactly as SGLang's triton decode kernels attend over a BF16 buffer.

The kernels are SGLang 0.5.10.post1's `decode_attention.py` (`_fwd_kernel_stage1`, `_fwd_grouped_kernel_stage1`,
`_fwd_kernel_stage2`, same tiles and splits; the grouped kernel's pipeline stages and register cap are
`GROUPED_LAUNCH`) with the K and V loads replaced by `_fp4_tile`. The BF16 values a tile holds equal
`KVFP4QuantizeUtil.batched_dequantize` bit for bit (an E2M1 magnitude times a power of two, or times an E4M3 value,
is exact in FP32 and in BF16), and they reach the dots in the register layout SGLang's BF16 loads give them (see
`_fp4_tile`), so the attention math gets the same inputs, summed in the same order, as SGLang's
dequantize-then-attend path (`MHATokenToKVPoolFP4.get_key_buffer`, which converts the whole layer buffer on every
call) without materializing the buffer. GQA (the grouped kernel, TRACE's models) takes SGLang's math unchanged;
MHA sums q . k in FP32 where SGLang sums in BF16 (see `_fp4_kernel_stage1`). The pure-torch twin is
`trace_core.numerics.kv_attention.decode_attention_reference`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from trace_core.kernels.triton_fp4 import INTERPRET, NVFP4, TWO_126, _e4m3_decode, _pow2
from trace_core.numerics.formats import KV_FP4, FP4Format
from trace_core.numerics.kv_attention import check_kv_format

MIN_BLOCK_KV = 32  # SGLang's _MIN_BLOCK_KV: split lengths are multiples of it
MIN_HEAD_DIM = 16
"""Smallest head dim the decode and extend kernels take (powers of two; 16, 32, 64 and 128 are tested on the
H200, triton 3.6)."""
PAD_HEAD_DIM = 32
"""On CUDA the grouped decode kernel and the extend kernel run head dim 16 as a 32-column tile: triton 3.6
compiled the grouped decode kernel's 16-column tile wrong on the H200 when the tile was built from byte loads
(its dots then took the operand layout kWidth 8; the dequantized tile alone was exact, and so is SGLang's kernel;
docs/performance.md), and the extend kernel's prefix dot is built the same way. Since the tile
reaches the dots in SGLang's layout (`_fp4_tile`) the unpadded tile gives the twin's values too, but
the padding is what the GPU tests cover. The padded tile gives SGLang's values bit for bit on the H200: the
tensor-core dot's first 16-deep step takes the same products, the second adds exact zeros. The CPU interpreter
keeps the 16-column tile, which it computes right (its FP32 matmul would order a 32-deep sum differently)."""
KV_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
GROUPED_LAUNCH: dict[str, int] = {"num_warps": 4, "num_stages": 3, "maxnreg": 96}
"""Launch settings of the grouped stage-1 kernel. SGLang launches 4 warps and 2 pipeline stages; 3 stages (tiles
copied two blocks ahead) and a cap of 96 registers (5 programs per SM instead of 4, no spills) schedule the same
instructions and were fastest on the H200 (`bench/fp4_attention_launch.py`, which also checks that the outputs are
equal). The warps set the dots' layout and so the order of the softmax sums: they stay SGLang's."""


@contextlib.contextmanager
def grouped_launch(launch: dict[str, int]) -> Iterator[None]:
    """`GROUPED_LAUNCH` replaced by launch for the duration, restored in place after (benches of other settings)."""
    saved = dict(GROUPED_LAUNCH)
    try:
        GROUPED_LAUNCH.clear()
        GROUPED_LAUNCH.update(launch)
        yield
    finally:
        GROUPED_LAUNCH.clear()
        GROUPED_LAUNCH.update(saved)


@triton.jit
def _tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit
def _split(x, BITS: tl.constexpr):
    """[R, 2 C] of x [R, C] (uint32 items of 2 BITS bits): each item's low BITS bits, then its high BITS bits."""
    return tl.join(x & ((1 << BITS) - 1), x >> BITS).reshape(x.shape[0], 2 * x.shape[1])


@triton.jit
def _nibble_bits(words, J: tl.constexpr):
    """FP32 bits of nibble J of int32 words (an E2M1 code): its sign at bit 31, its magnitude bits at 22..24."""
    return ((words << (28 - 4 * J)) >> 6) & -2118123520  # 0x81C00000


@triton.jit
def _scale_values(sw, KV_FMT: tl.constexpr):
    """FP32 values of scale bytes `sw` (int32 0..255) of the pool format KV_FMT (a kernel id): E8M0, 2^(s - 127)
    (KV_FP4), or an E4M3 bit pattern decoded exactly from its bits (NVFP4, `triton_fp4._e4m3_decode`: exponent
    field e = (s >> 3) & 15, mantissa m = s & 7, (8 + m) 2^(e - 10) for e > 0, m 2^-9 for e = 0; a scale's sign
    bit is never set and it is never NaN, sf saturating at 448)."""
    if KV_FMT == NVFP4:
        return _e4m3_decode(sw)
    return _pow2(sw - 127)


@triton.jit
def _fp4_tile(codes_ptr, scale_ptr, loc, head, stride_cs, stride_ch, stride_ss, n_mask, D: tl.constexpr,
              BLOCK_N: tl.constexpr, KV_DTYPE: tl.constexpr, LD: tl.constexpr = 0,
              KV_FMT: tl.constexpr = KV_FP4.kernel_id):  # fmt: skip
    """[BLOCK_N, D] values of KV head `head` at pool slots `loc`, from the pool's codes read as int32 words
    (strides in words) and its scale bytes read as words of 1, 2 or 4 bytes (`fp4_words`; stride in words):
    nibble j of a head's code word w (bits 4 j ... 4 j + 3) is element 8 w + j; scale byte i (`_scale_values` of
    the pool format KV_FMT, the lowest-addressed byte of a word first) scales elements [16 i, 16 i + 16). Masked
    rows are 0, as SGLang's masked loads. LD > 0: the pool's head dim, narrower than the tile (columns from LD on
    are 0).

    Whole words keep the loads wide enough for triton to pipeline them (asynchronous copies issued blocks ahead,
    the scale bytes too). On the GPU the tile leaves through an identity `mov` that triton cannot see through:
    triton sizes a dot operand's register layout (kWidth) by the narrowest type loaded behind it, halved per
    `join`, and the packed codes would give kWidth 8 (triton 3.6) where SGLang's BF16 loads give 2, i.e. hand
    the tensor-core steps the products in another grouping, which changed the last bits of 0.03 - 0.07 % of the
    outputs. Behind the `mov` both dots take SGLang's layout and sums; ptxas drops the move."""
    SB: tl.constexpr = scale_ptr.dtype.element_ty.primitive_bitwidth // 8
    W: tl.constexpr = D // 8  # code words per tile row
    SW: tl.constexpr = D // 16 // SB  # scale words per tile row
    offs_w = tl.arange(0, W)
    offs_s = tl.arange(0, SW)
    if LD == 0:
        head_words: tl.constexpr = D // 16 // SB
        code_mask = n_mask[:, None]
        scale_mask = n_mask[:, None]
    else:
        head_words: tl.constexpr = LD // 16 // SB  # type: ignore[no-redef]  # a Triton constexpr set per branch
        code_mask = n_mask[:, None] & (offs_w[None, :] < LD // 8)
        scale_mask = n_mask[:, None] & (offs_s[None, :] < head_words)
    words = tl.load(codes_ptr + loc[:, None] * stride_cs + head * stride_ch + offs_w[None, :], mask=code_mask,
                    other=0)  # fmt: skip
    # nibble j's sign at FP32 bit 31, its E2M1 magnitude bits at 22..24: a subnormal, times 2^126 the E2M1 value
    # (see triton_fp4._magnitude)
    even = tl.join(tl.join(_nibble_bits(words, 0), _nibble_bits(words, 4)),
                   tl.join(_nibble_bits(words, 2), _nibble_bits(words, 6)))  # fmt: skip
    odd = tl.join(tl.join(_nibble_bits(words, 1), _nibble_bits(words, 5)),
                  tl.join(_nibble_bits(words, 3), _nibble_bits(words, 7)))  # fmt: skip
    bits = tl.join(even, odd)  # [BLOCK_N, W, 2, 2, 2]: nibble 4 a + 2 b + c at [:, :, a, b, c]
    mag = bits.reshape(BLOCK_N, D).to(tl.float32, bitcast=True) * TWO_126
    sw = tl.load(scale_ptr + loc[:, None] * stride_ss + head * head_words + offs_s[None, :], mask=scale_mask,
                 other=0).to(tl.int32).to(tl.uint32, bitcast=True)  # fmt: skip
    if SB == 4:
        sw = _split(_split(sw, 16), 8)  # [BLOCK_N, D / 16] scale bytes
    elif SB == 2:
        sw = _split(sw & 0xFFFF, 8)
    # times the scale: exact in FP32, and in BF16 (packed, half the instructions) for a BF16 tile on the GPU (the
    # interpreter has no BF16 arithmetic); the product's one rounding (subnormal or overflowing values) is the same
    MUL: tl.constexpr = tl.bfloat16 if KV_DTYPE == tl.bfloat16 and not INTERPRET else tl.float32
    scale = _scale_values(sw.to(tl.int32), KV_FMT).to(MUL)
    val = (mag.to(MUL).reshape(BLOCK_N, D // 16, 16) * scale[:, :, None]).reshape(BLOCK_N, D).to(KV_DTYPE)
    if not INTERPRET and KV_DTYPE.primitive_bitwidth == 16:
        val = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [val], dtype=val.dtype, is_pure=False, pack=2)
    return val


@triton.jit
def _kv_split(kv_indptr, num_kv_splits, cur_batch, split_kv_id, MIN_BLOCK_KV: tl.constexpr):
    """SGLang's split of request `cur_batch`'s keys: its first entry in kv_indices, its length, and the key range
    [start, end) of split `split_kv_id` (splits of whole MIN_BLOCK_KV blocks; the last ones short or empty)."""
    cur_batch_kv_start_idx = tl.load(kv_indptr + cur_batch)
    cur_batch_seq_len = tl.load(kv_indptr + cur_batch + 1) - cur_batch_kv_start_idx
    kv_splits = tl.load(num_kv_splits + cur_batch)
    kv_len_per_split = tl.cdiv(tl.cdiv(cur_batch_seq_len, kv_splits), MIN_BLOCK_KV) * MIN_BLOCK_KV
    split_kv_start = kv_len_per_split * split_kv_id
    split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)
    return cur_batch_kv_start_idx, cur_batch_seq_len, split_kv_start, split_kv_end


@triton.jit
def _xai_temperature(cur_batch_seq_len, xai_temperature_len: tl.constexpr):
    """SGLang's xAI temperature of the query at the request's last position: log2 of the position over
    log2(xai_temperature_len) past that length, else 1."""
    offs_qidx = cur_batch_seq_len - 1
    xai_temperature_scale = 1.0 / tl.log2(float(xai_temperature_len))
    _qtemp = tl.log2(offs_qidx.to(tl.float32)) * xai_temperature_scale
    return tl.where(offs_qidx > xai_temperature_len, _qtemp, 1.0)


@triton.jit
def _fp4_kernel_stage1(
    Q, K_Codes, K_Scales, V_Codes, V_Scales, sm_scale_withk, kv_indptr, kv_indices, Att_Out, Att_Lse, num_kv_splits,
    stride_qbs, stride_qh, stride_kcs, stride_kch, stride_kss, stride_vcs, stride_vch, stride_vss,
    stride_mid_ob, stride_mid_oh, stride_mid_os,
    kv_group_num: tl.constexpr, BLOCK_DMODEL: tl.constexpr, BLOCK_N: tl.constexpr, MIN_BLOCK_KV: tl.constexpr,
    logit_cap: tl.constexpr, xai_temperature_len: tl.constexpr, KV_DTYPE: tl.constexpr, KV_FMT: tl.constexpr,
):  # fmt: skip
    """SGLang's `_fwd_kernel_stage1` (one query head per program, MHA) over the FP4 pool, except that q . k is
    summed in FP32: SGLang's kernel multiplies and sums BF16 q and k in BF16, in an order set by the register
    layout of its K tile, which the FP4 tile does not reproduce; the same BF16 rounding cannot be matched, so the
    exact sum is taken instead."""
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    split_kv_id = tl.program_id(2)
    cur_kv_head = cur_head // kv_group_num
    offs_d = tl.arange(0, BLOCK_DMODEL)

    cur_batch_kv_start_idx, cur_batch_seq_len, split_kv_start, split_kv_end = _kv_split(
        kv_indptr, num_kv_splits, cur_batch, split_kv_id, MIN_BLOCK_KV
    )
    if xai_temperature_len > 0:
        xai_temperature_reg = _xai_temperature(cur_batch_seq_len, xai_temperature_len)
    off_q = cur_batch * stride_qbs + cur_head * stride_qh + offs_d

    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_DMODEL], dtype=tl.float32)
    if split_kv_end > split_kv_start:
        q = tl.load(Q + off_q)
        for start_n in range(split_kv_start, split_kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_mask = offs_n < split_kv_end
            kv_loc = tl.load(kv_indices + cur_batch_kv_start_idx + offs_n, mask=n_mask, other=0)
            k = _fp4_tile(K_Codes, K_Scales, kv_loc, cur_kv_head, stride_kcs, stride_kch, stride_kss, n_mask,
                          BLOCK_DMODEL, BLOCK_N, KV_DTYPE, 0, KV_FMT)  # fmt: skip
            qk = tl.sum(q[None, :].to(tl.float32) * k.to(tl.float32), 1)  # SGLang: BF16 products and sums
            qk *= sm_scale_withk
            if logit_cap > 0:
                qk = logit_cap * _tanh(qk / logit_cap)
            if xai_temperature_len > 0:
                qk *= xai_temperature_reg
            qk = tl.where(n_mask, qk, float("-inf"))
            v = _fp4_tile(V_Codes, V_Scales, kv_loc, cur_kv_head, stride_vcs, stride_vch, stride_vss, n_mask,
                          BLOCK_DMODEL, BLOCK_N, KV_DTYPE, 0, KV_FMT)  # fmt: skip
            n_e_max = tl.maximum(tl.max(qk, 0), e_max)
            re_scale = tl.exp(e_max - n_e_max)
            p = tl.exp(qk - n_e_max)
            acc *= re_scale
            acc += tl.sum(p[:, None] * v, 0)
            e_sum = e_sum * re_scale + tl.sum(p, 0)
            e_max = n_e_max
        offs_mid_o = cur_batch * stride_mid_ob + cur_head * stride_mid_oh + split_kv_id * stride_mid_os + offs_d
        tl.store(Att_Out + offs_mid_o, acc / e_sum)
        offs_lse = (cur_batch * stride_mid_ob + cur_head * stride_mid_oh + split_kv_id * stride_mid_os) // BLOCK_DMODEL
        tl.store(Att_Lse + offs_lse, e_max + tl.log(e_sum))


@triton.jit
def _fp4_grouped_kernel_stage1(
    Q, K_Codes, K_Scales, V_Codes, V_Scales, sm_scale_withk, kv_indptr, kv_indices, Att_Out, Att_Lse, num_kv_splits,
    stride_qbs, stride_qh, stride_kcs, stride_kch, stride_kss, stride_vcs, stride_vch, stride_vss,
    stride_mid_ob, stride_mid_oh, stride_mid_os,
    kv_group_num: tl.constexpr, q_head_num: tl.constexpr, BLOCK_DMODEL: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, MIN_BLOCK_KV: tl.constexpr, logit_cap: tl.constexpr, xai_temperature_len: tl.constexpr,
    KV_DTYPE: tl.constexpr, Lk: tl.constexpr, KV_FMT: tl.constexpr,
):  # fmt: skip
    """SGLang's `_fwd_grouped_kernel_stage1` (BLOCK_H query heads of one KV head per program, GQA) over the FP4
    pool; the K tile is built [BLOCK_N, D] and transposed for the dot, as SGLang loads it [D, BLOCK_N].

    Lk is the head dim; BLOCK_DMODEL is wider for head dim 16 on CUDA (`PAD_HEAD_DIM`), with zeros in the extra
    columns of q, K and V: the extra terms of q . k are exact zeros and the extra output columns are dropped."""
    cur_batch = tl.program_id(0)
    cur_head_id = tl.program_id(1)
    cur_kv_head = cur_head_id // tl.cdiv(kv_group_num, BLOCK_H)
    split_kv_id = tl.program_id(2)
    if BLOCK_H < kv_group_num:
        VALID_BLOCK_H: tl.constexpr = BLOCK_H
    else:
        VALID_BLOCK_H: tl.constexpr = kv_group_num  # type: ignore[no-redef]  # a Triton constexpr set per branch
    cur_head = cur_head_id * VALID_BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = cur_head < (cur_head_id + 1) * VALID_BLOCK_H
    mask_h = mask_h & (cur_head < q_head_num)
    offs_d = tl.arange(0, BLOCK_DMODEL)

    cur_batch_kv_start_idx, cur_batch_seq_len, split_kv_start, split_kv_end = _kv_split(
        kv_indptr, num_kv_splits, cur_batch, split_kv_id, MIN_BLOCK_KV
    )
    if xai_temperature_len > 0:
        xai_temperature_reg = _xai_temperature(cur_batch_seq_len, xai_temperature_len)
    offs_q = cur_batch * stride_qbs + cur_head[:, None] * stride_qh + offs_d[None, :]
    if BLOCK_DMODEL > Lk:
        mask_hd = mask_h[:, None] & (offs_d[None, :] < Lk)
        PAD: tl.constexpr = Lk
    else:
        mask_hd = mask_h[:, None]
        PAD: tl.constexpr = 0  # type: ignore[no-redef]  # a Triton constexpr set per branch

    e_max = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    e_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DMODEL], dtype=tl.float32)
    if split_kv_end > split_kv_start:
        q = tl.load(Q + offs_q, mask=mask_hd, other=0.0)
        for start_n in range(split_kv_start, split_kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_mask = offs_n < split_kv_end
            kv_loc = tl.load(kv_indices + cur_batch_kv_start_idx + offs_n, mask=n_mask, other=0)
            k = _fp4_tile(K_Codes, K_Scales, kv_loc, cur_kv_head, stride_kcs, stride_kch, stride_kss, n_mask,
                          BLOCK_DMODEL, BLOCK_N, KV_DTYPE, PAD, KV_FMT)  # fmt: skip
            qk = tl.dot(q, tl.trans(k).to(q.dtype))
            qk *= sm_scale_withk
            if logit_cap > 0:
                qk = logit_cap * _tanh(qk / logit_cap)
            if xai_temperature_len > 0:
                qk *= xai_temperature_reg[:, None]
            qk = tl.where(mask_h[:, None] & n_mask[None, :], qk, float("-inf"))
            v = _fp4_tile(V_Codes, V_Scales, kv_loc, cur_kv_head, stride_vcs, stride_vch, stride_vss, n_mask,
                          BLOCK_DMODEL, BLOCK_N, KV_DTYPE, PAD, KV_FMT)  # fmt: skip
            n_e_max = tl.maximum(tl.max(qk, 1), e_max)
            re_scale = tl.exp(e_max - n_e_max)
            p = tl.exp(qk - n_e_max[:, None])
            acc *= re_scale[:, None]
            acc += tl.dot(p.to(v.dtype), v)
            e_sum = e_sum * re_scale + tl.sum(p, 1)
            e_max = n_e_max
        offs_mid_o = (cur_batch * stride_mid_ob + cur_head[:, None] * stride_mid_oh + split_kv_id * stride_mid_os
                      + offs_d[None, :])  # fmt: skip
        tl.store(Att_Out + offs_mid_o, acc / e_sum[:, None], mask=mask_hd)
        offs_lse = (cur_batch * stride_mid_ob + cur_head * stride_mid_oh + split_kv_id * stride_mid_os) // Lk
        tl.store(Att_Lse + offs_lse, e_max + tl.log(e_sum), mask=mask_h)


@triton.jit
def _fwd_kernel_stage2(
    Mid_O, Mid_O_1, Out, v_scale, kv_indptr, num_kv_splits, sink_ptr,
    stride_mid_ob, stride_mid_oh, stride_mid_os, stride_obs, stride_oh,
    MAX_KV_SPLITS: tl.constexpr, MIN_BLOCK_KV: tl.constexpr, BLOCK_DV: tl.constexpr, Lv: tl.constexpr,
    HAS_SINK: tl.constexpr,
):  # fmt: skip
    """SGLang's `_fwd_kernel_stage2` unchanged: merges the splits' partial outputs by their log-sum-exp."""
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    cur_batch_seq_len = tl.load(kv_indptr + cur_batch + 1) - tl.load(kv_indptr + cur_batch)
    kv_splits = tl.load(num_kv_splits + cur_batch)
    offs_d = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < Lv
    e_sum = 0.0
    e_max = -float("inf")
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    offs_v = cur_batch * stride_mid_ob + cur_head * stride_mid_oh + offs_d
    offs_logic = (cur_batch * stride_mid_ob + cur_head * stride_mid_oh) // Lv
    kv_len_per_split = tl.cdiv(tl.cdiv(cur_batch_seq_len, kv_splits), MIN_BLOCK_KV) * MIN_BLOCK_KV
    for split_kv_id in range(0, MAX_KV_SPLITS):
        split_kv_start = kv_len_per_split * split_kv_id
        split_kv_end = tl.minimum(split_kv_start + kv_len_per_split, cur_batch_seq_len)
        if split_kv_end > split_kv_start:
            tv = tl.load(Mid_O + offs_v + split_kv_id * stride_mid_os, mask=mask_d, other=0.0)
            tlogic = tl.load(Mid_O_1 + offs_logic + split_kv_id * stride_mid_os // Lv)
            n_e_max = tl.maximum(tlogic, e_max)
            old_scale = tl.exp(e_max - n_e_max)
            acc *= old_scale
            exp_logic = tl.exp(tlogic - n_e_max)
            acc += exp_logic * tv
            e_sum = e_sum * old_scale + exp_logic
            e_max = n_e_max
    if HAS_SINK:
        cur_sink = tl.load(sink_ptr + cur_head)
        e_sum += tl.exp(cur_sink - e_max)
    tl.store(Out + cur_batch * stride_obs + cur_head * stride_oh + offs_d, acc / e_sum * v_scale, mask=mask_d)


def check_fp4_cache(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor, v_codes: torch.Tensor,
                    v_scales: torch.Tensor) -> tuple[int, int]:  # fmt: skip
    """(KV heads, head dim) of an FP4 pool layer, or ValueError naming what does not fit (q `[B, Hq, D]`, codes
    uint8 `[S, H, D/2]`, scales uint8 `[S, H * D / 16]`, unit last strides, D a power of two >= `MIN_HEAD_DIM`)."""
    if k_codes.dim() != 3 or k_codes.dtype != torch.uint8 or v_codes.shape != k_codes.shape:
        got = f"{k_codes.dtype} {tuple(k_codes.shape)} and {v_codes.dtype} {tuple(v_codes.shape)}"
        raise ValueError(f"FP4 KV codes must be uint8 [slots, heads, head_dim / 2] for K and V, got {got}")
    slots, heads, half = k_codes.shape
    d = 2 * half
    if d < MIN_HEAD_DIM or d & (d - 1):
        raise ValueError(f"FP4 attention needs a power-of-two head dim >= {MIN_HEAD_DIM}, got {d}")
    for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
        if s.dtype != torch.uint8 or tuple(s.shape) != (slots, heads * d // 16):
            raise ValueError(f"{name} must be uint8 {(slots, heads * d // 16)}, got {s.dtype} {tuple(s.shape)}")
    for name, t in (("q", q), ("k_codes", k_codes), ("v_codes", v_codes), ("k_scales", k_scales),
                    ("v_scales", v_scales)):  # fmt: skip
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride, got strides {t.stride()}")
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % heads:
        raise ValueError(f"q must be [batch, q_heads, {d}] with q_heads a multiple of {heads}, got {tuple(q.shape)}")
    return heads, d


SCALE_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def fp4_words(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The views the kernels read an FP4 pool layer through (`_fp4_tile`): the codes as int32 words `[S, H, D/8]`
    and the scale bytes as words of min(4, D / 16) bytes, so that one head's scales are whole words; ValueError
    where the buffers' offsets or strides are not multiples of those words (SGLang's pool buffers are)."""
    d = 2 * codes.shape[-1]
    width = min(4, d // 16)
    try:
        return codes.view(torch.int32), scales.view(SCALE_WORDS[width])
    except RuntimeError as e:
        raise ValueError(f"FP4 KV codes must be readable as 4-byte words and scale bytes as {width}-byte words "
                         f"(offsets and strides multiples of them): {e}") from e  # fmt: skip


def fp4_decode_attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    sm_scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    xai_temperature_len: int = -1,
    kv_dtype: torch.dtype = torch.bfloat16,
    *,
    kv_fmt: FP4Format = KV_FP4,
) -> None:
    """`decode_attention_fwd` of SGLang's triton backend (same arguments, same result) with each K/V buffer given
    as the FP4 pool's codes and scale bytes of one layer. `kv_dtype` is the dtype the values are dequantized to
    (SGLang's pool returns BF16; FP32 serves the CPU-interpreter tests); `kv_fmt` the pool's format, `KV_FP4`
    (E8M0 scale bytes) or `NVFP4` (E4M3 scale bytes, static unit global scale; `check_kv_format`)."""
    kv_id = check_kv_format(kv_fmt).kernel_id
    heads, d = check_fp4_cache(q, k_codes, k_scales, v_codes, v_scales)
    batch, q_heads = q.shape[0], q.shape[1]
    if max_kv_splits != attn_logits.shape[2] or batch > kv_indptr.shape[0] - 1 or batch > attn_logits.shape[0]:
        raise ValueError("attn_logits [batch, heads, max_kv_splits, D] and kv_indptr [batch + 1] must cover q")
    group = q_heads // heads
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype} is not one of {tuple(KV_DTYPES)}")
    common = dict(MIN_BLOCK_KV=MIN_BLOCK_KV, logit_cap=logit_cap, xai_temperature_len=xai_temperature_len,
                  KV_DTYPE=KV_DTYPES[kv_dtype], KV_FMT=kv_id)  # fmt: skip
    (kc, ks), (vc, vs) = fp4_words(k_codes, k_scales), fp4_words(v_codes, v_scales)
    args = (
        q, kc, ks, vc, vs, sm_scale * k_scale, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), ks.stride(0), vc.stride(0), vc.stride(1), vs.stride(0),
        attn_logits.stride(0), attn_logits.stride(1), attn_logits.stride(2),
    )  # fmt: skip
    if group == 1:
        _fp4_kernel_stage1[(batch, q_heads, max_kv_splits)](
            *args, kv_group_num=group, BLOCK_DMODEL=d, BLOCK_N=64, num_warps=4, num_stages=2, **common
        )
    else:
        block_h = 16
        grid = (batch, triton.cdiv(q_heads, min(block_h, group)), max_kv_splits)
        block_d = max(d, PAD_HEAD_DIM) if q.is_cuda else d
        _fp4_grouped_kernel_stage1[grid](
            *args, kv_group_num=group, q_head_num=q_heads, BLOCK_DMODEL=block_d, BLOCK_N=32, BLOCK_H=block_h, Lk=d,
            **GROUPED_LAUNCH, **common,
        )  # fmt: skip
    _fwd_kernel_stage2[(batch, q_heads)](
        attn_logits, attn_lse, o, v_scale, kv_indptr, num_kv_splits, sinks, attn_logits.stride(0),
        attn_logits.stride(1), attn_logits.stride(2), o.stride(0), o.stride(1), MAX_KV_SPLITS=max_kv_splits,
        MIN_BLOCK_KV=MIN_BLOCK_KV, BLOCK_DV=d, Lv=d, HAS_SINK=sinks is not None, num_warps=4, num_stages=2,
    )  # fmt: skip
