"""Paged extend (prefill) attention that reads the cached prefix from SGLang's FP4 KV pool directly.

The kernel is SGLang 0.5.10.post1's `extend_attention.py` `_fwd_kernel` (same tiles, launch settings and math):
each program takes `BLOCK_M` new tokens of one query head, attends first over the request's cached prefix (paged
through `kv_indices`) and then over the new tokens themselves (`k_extend` / `v_extend`, BF16, causal), with one
online softmax. Only the prefix's K and V tile loads change: packed E2M1 codes and their scale bytes (E8M0 for
`kv_fp4`, E4M3 for NVFP4 KV: `kv_fmt`) are dequantized in registers by `_fp4_tile`, to the BF16 values
`MHATokenToKVPoolFP4.get_key_buffer` would have materialized for the whole layer. The pure-torch twin is
`trace_core.numerics.kv_attention.extend_attention_reference`.

Supported: causal or bidirectional extend, logit cap, attention sinks, k/v scales. Refused by name (SGLang
features the twin does not replay): a custom mask (speculative-decoding verify), a sliding window, xai
temperature.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from trace_core.kernels.fp4_attention import KV_DTYPES, PAD_HEAD_DIM, _fp4_tile, _tanh, check_fp4_cache, fp4_words
from trace_core.numerics.formats import KV_FP4, FP4Format
from trace_core.numerics.kv_attention import check_kv_format, extend_tiles


@triton.jit
def _online_step(qk, final_mask, v, acc, deno, e_max, logit_cap: tl.constexpr, v_scale, HAS_V_SCALE: tl.constexpr):
    """One key block of SGLang's online softmax, shared by both stages: the scaled logits qk [BLOCK_M, BLOCK_N]
    capped and masked, the running max e_max, denominator deno and output acc updated with the block's values v,
    p cast to v's dtype for the dot (the prefix stage multiplies its P V by v_scale, as SGLang does)."""
    if logit_cap > 0:
        qk = logit_cap * _tanh(qk / logit_cap)
    qk = tl.where(final_mask, qk, float("-inf"))
    row_max = tl.max(qk, 1)
    row_max_fixed = tl.where(row_max == float("-inf"), -1e20, row_max)
    n_e_max = tl.maximum(row_max_fixed, e_max)
    re_scale = tl.exp(e_max - n_e_max)
    p = tl.exp(qk - n_e_max[:, None])
    deno = deno * re_scale + tl.sum(p, 1)
    p = p.to(v.dtype)
    if HAS_V_SCALE:
        acc = acc * re_scale[:, None] + tl.dot(p, v) * v_scale
    else:
        acc = acc * re_scale[:, None] + tl.dot(p, v)
    return acc, deno, n_e_max


@triton.jit
def _fp4_extend_kernel(
    Q_Extend, K_Extend, V_Extend, O_Extend, K_Codes, K_Scales, V_Codes, V_Scales, qo_indptr, kv_indptr, kv_indices,
    sink_ptr, sm_scale, k_scale, v_scale, kv_group_num,
    stride_qbs, stride_qh, stride_kbs, stride_kh, stride_vbs, stride_vh, stride_obs, stride_oh,
    stride_kcs, stride_kch, stride_kss, stride_vcs, stride_vch, stride_vss,
    logit_cap: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_SINK: tl.constexpr, KV_DTYPE: tl.constexpr, Lk: tl.constexpr,
    KV_FMT: tl.constexpr,
):  # fmt: skip
    """SGLang's `_fwd_kernel` without the features refused above (module docstring); prefix K/V from the FP4
    pool, the K tile built [BLOCK_N, D] and transposed for the dot, as SGLang loads it [D, BLOCK_N].

    Lk is the head dim; D is wider for head dim 16 on CUDA (`PAD_HEAD_DIM`, as in the decode kernel), with zeros
    in the extra columns of q, K and V: the extra terms of q . k are exact zeros and the extra output columns are
    not stored."""
    cur_seq = tl.program_id(0)
    cur_head = tl.program_id(1)
    cur_block_m = tl.program_id(2)
    cur_kv_head = cur_head // kv_group_num

    cur_seq_extend_start_idx = tl.load(qo_indptr + cur_seq)
    cur_seq_len_extend = tl.load(qo_indptr + cur_seq + 1) - cur_seq_extend_start_idx
    cur_seq_kv_start_idx = tl.load(kv_indptr + cur_seq)
    cur_seq_len_prefix = tl.load(kv_indptr + cur_seq + 1) - cur_seq_kv_start_idx

    offs_d = tl.arange(0, D)
    mask_d = offs_d < Lk
    if D > Lk:
        PAD: tl.constexpr = Lk
    else:
        PAD: tl.constexpr = 0  # type: ignore[no-redef]  # a Triton constexpr set per branch
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = (cur_block_m * BLOCK_M + offs_m) < cur_seq_len_extend
    offs_q = (cur_seq_extend_start_idx + cur_block_m * BLOCK_M + offs_m[:, None]) * stride_qbs + cur_head * stride_qh
    q = tl.load(Q_Extend + offs_q + offs_d[None, :], mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    offs_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    deno = tl.zeros([BLOCK_M], dtype=tl.float32)
    e_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")

    # stage 1: the cached prefix, from the FP4 pool
    for start_n in range(0, cur_seq_len_prefix, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        mask_n = (start_n + offs_n) < cur_seq_len_prefix
        final_mask = mask_m[:, None] & mask_n[None, :]
        offs_kv_loc = tl.load(kv_indices + cur_seq_kv_start_idx + start_n + offs_n, mask=mask_n, other=0)
        k = tl.trans(_fp4_tile(K_Codes, K_Scales, offs_kv_loc, cur_kv_head, stride_kcs, stride_kch, stride_kss,
                               mask_n, D, BLOCK_N, KV_DTYPE, PAD, KV_FMT))  # fmt: skip
        qk = tl.dot(q.to(k.dtype), k)
        qk *= sm_scale * k_scale
        v = _fp4_tile(V_Codes, V_Scales, offs_kv_loc, cur_kv_head, stride_vcs, stride_vch, stride_vss, mask_n, D,
                      BLOCK_N, KV_DTYPE, PAD, KV_FMT)  # fmt: skip
        acc, deno, e_max = _online_step(qk, final_mask, v, acc, deno, e_max, logit_cap, v_scale, True)

    # stage 2: the new tokens (SGLang's "triangle part"), from k_extend / v_extend
    cur_block_m_end = (
        cur_seq_len_extend if not IS_CAUSAL else tl.minimum(cur_seq_len_extend, (cur_block_m + 1) * BLOCK_M)
    )
    for start_n in range(0, cur_block_m_end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        mask_n = (start_n + offs_n) < cur_block_m_end
        final_mask = mask_m[:, None] & mask_n[None, :]
        if IS_CAUSAL:
            mask_causal = (cur_block_m * BLOCK_M + offs_m[:, None]) >= (start_n + offs_n[None, :])
            mask_causal &= mask_m[:, None] & mask_n[None, :]
            final_mask &= mask_causal
        offs_k = (cur_seq_extend_start_idx + start_n + offs_n[None, :]) * stride_kbs + cur_kv_head * stride_kh
        k = tl.load(K_Extend + offs_k + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        qk = tl.dot(q, k, out_dtype=tl.float32)
        qk *= sm_scale
        offs_v = (cur_seq_extend_start_idx + start_n + offs_n[:, None]) * stride_vbs + cur_kv_head * stride_vh
        v = tl.load(V_Extend + offs_v + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        acc, deno, e_max = _online_step(qk, final_mask, v, acc, deno, e_max, logit_cap, 1.0, False)

    if HAS_SINK:
        cur_sink = tl.load(sink_ptr + cur_head)
        deno += tl.exp(cur_sink - e_max)
    offs_o = (cur_seq_extend_start_idx + cur_block_m * BLOCK_M + offs_m[:, None]) * stride_obs + cur_head * stride_oh
    tl.store(O_Extend + offs_o + offs_d[None, :], acc / deno[:, None], mask=mask_m[:, None] & mask_d[None, :])


def fp4_extend_attention(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None,
    is_causal: bool,
    mask_indptr: torch.Tensor | None,
    max_len_extend: int,
    k_scale: float,
    v_scale: float,
    sm_scale: float | None = None,
    logit_cap: float = 0.0,
    skip_prefix_custom_mask: bool = True,
    sliding_window_size: int = -1,
    sinks: torch.Tensor | None = None,
    window_kv_offsets: torch.Tensor | None = None,
    xai_temperature_len: int = -1,
    kv_dtype: torch.dtype = torch.bfloat16,
    *,
    kv_fmt: FP4Format = KV_FP4,
) -> None:
    """`extend_attention_fwd` of SGLang's triton backend (same arguments, same result) with the layer's K/V
    buffers given as the FP4 pool's codes and scale bytes of format `kv_fmt` (`KV_FP4` or `NVFP4`, as
    `fp4_decode_attention`); ValueError for the features this kernel refuses."""
    kv_id = check_kv_format(kv_fmt).kernel_id
    if custom_mask is not None:
        raise ValueError("FP4 extend attention does not take a custom mask (speculative-decoding verify)")
    if sliding_window_size is not None and sliding_window_size > -1:
        raise ValueError(f"FP4 extend attention does not take a sliding window (got {sliding_window_size})")
    if xai_temperature_len > 0:
        raise ValueError(f"FP4 extend attention does not take xai_temperature_len (got {xai_temperature_len})")
    heads, d = check_fp4_cache(q_extend, k_codes, k_scales, v_codes, v_scales)
    for name, t in (("k_extend", k_extend), ("v_extend", v_extend)):
        if t.dim() != 3 or t.shape[1:] != (heads, d) or t.shape[0] != q_extend.shape[0] or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [tokens, {heads}, {d}] like q_extend, got {tuple(t.shape)}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype} is not one of {tuple(KV_DTYPES)}")
    block_m, block_n, warps = extend_tiles(d, q_extend.device)
    batch, q_heads = qo_indptr.shape[0] - 1, q_extend.shape[1]
    grid = (batch, q_heads, triton.cdiv(max_len_extend, block_m))
    (kc, ks), (vc, vs) = fp4_words(k_codes, k_scales), fp4_words(v_codes, v_scales)
    _fp4_extend_kernel[grid](
        q_extend, k_extend, v_extend, o_extend, kc, ks, vc, vs, qo_indptr, kv_indptr, kv_indices, sinks,
        sm_scale or 1.0 / (d**0.5), k_scale, v_scale, q_heads // heads,
        q_extend.stride(0), q_extend.stride(1), k_extend.stride(0), k_extend.stride(1), v_extend.stride(0),
        v_extend.stride(1), o_extend.stride(0), o_extend.stride(1), kc.stride(0), kc.stride(1), ks.stride(0),
        vc.stride(0), vc.stride(1), vs.stride(0),
        logit_cap=logit_cap, D=max(d, PAD_HEAD_DIM) if q_extend.is_cuda else d, BLOCK_M=block_m, BLOCK_N=block_n,
        IS_CAUSAL=is_causal, HAS_SINK=sinks is not None, KV_DTYPE=KV_DTYPES[kv_dtype], num_warps=warps, num_stages=1,
        Lk=d, KV_FMT=kv_id,
    )  # fmt: skip
