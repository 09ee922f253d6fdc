"""Pure-torch decode attention over an FP4 KV cache: the reference twin of `trace_core.kernels.fp4_attention`.

The cache layout is SGLang's `MHATokenToKVPoolFP4` per layer: codes uint8 `[slots, heads, D/2]` (element 2i in the
low nibble of byte i), scale bytes uint8 `[slots, heads * D / 16]` (16 elements per byte), i.e. rows of
`heads * D` elements of the pool's format (`KV_FORMATS`): `kv_fp4` (E8M0 bytes, exponent + 127), or NVFP4 KV (E4M3
bytes under the static global scale S_enc = 1: `trace_core.numerics.recipe.Scale.STATIC`). Requests are paged as in
SGLang's triton backend: request b attends over slots `kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`.

The twin follows the kernels' algorithm step by step (SGLang's split-KV decode: per split, blocks of `block_n`
slots with an online softmax, the probabilities cast to the value dtype before the P V product on the grouped
path, then the splits merged by log-sum-exp), so kernel and twin differ only in the order of FP32 sums and in
`exp` (the GPU's `ex2.approx`): see `tests/kernels/test_fp4_attention.py` for the tolerance this gives.
"""

from __future__ import annotations

import math

import torch

from trace_core.numerics.e2m1 import unpack_fp4
from trace_core.numerics.formats import KV_FP4, NVFP4, FP4Format
from trace_core.numerics.quant import Quantized, dequantize, static_global_scale

MIN_BLOCK_KV = 32
KV_FORMATS = (KV_FP4, NVFP4)
"""Formats of an FP4 KV pool the attention kernels and twins read."""


def check_kv_format(fmt: FP4Format) -> FP4Format:
    """`fmt` if it is one of `KV_FORMATS`, else ValueError naming it."""
    if fmt not in KV_FORMATS:
        name = getattr(fmt, "name", repr(fmt))
        raise ValueError(f"FP4 KV attention reads {[f.name for f in KV_FORMATS]} pools, not {name}")
    return fmt


def dequantize_kv(
    codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *, fmt: FP4Format = KV_FP4
) -> torch.Tensor:
    """Values `[slots, heads, D]` of FP4 pool rows of format `fmt` (`KV_FORMATS`; for kv_fp4 what
    `KVFP4QuantizeUtil.batched_dequantize` returns, for NVFP4 e2m1 x e4m3 under S_enc = 1, exact)."""
    check_kv_format(fmt)
    slots, heads, half = codes.shape
    codes = unpack_fp4(codes).reshape(slots, heads * 2 * half)
    gs = static_global_scale(codes.device) if fmt.has_global_scale else None
    q = Quantized(codes=codes, scales=scales, global_scale=gs, fmt=fmt)
    return dequantize(q, dtype).view(slots, heads, 2 * half)


def _split_attention(q, k, v, sm_scale, logit_cap, block_n, cast_p):
    """(acc / e_sum, lse) of query heads q `[Hq, D]` over one split's keys `[n, Hq, D]` (heads already expanded)."""
    e_max = torch.full((q.shape[0],), -math.inf)
    e_sum = torch.zeros(q.shape[0])
    acc = torch.zeros(q.shape[0], v.shape[-1])
    for s in range(0, k.shape[0], block_n):
        kb, vb = k[s : s + block_n].float(), v[s : s + block_n]
        qk = torch.einsum("hd,nhd->hn", q.float(), kb) * sm_scale
        if logit_cap > 0:
            qk = logit_cap * (2 * torch.sigmoid(2 * (qk / logit_cap)) - 1)
        n_e_max = torch.maximum(qk.max(dim=1).values, e_max)
        re_scale = torch.exp(e_max - n_e_max)
        p = torch.exp(qk - n_e_max[:, None])
        pv = p.to(vb.dtype) if cast_p else p
        acc = acc * re_scale[:, None] + torch.einsum("hn,nhd->hd", pv.float(), vb.float())
        e_sum = e_sum * re_scale + p.sum(dim=1)
        e_max = n_e_max
    return acc / e_sum[:, None], e_max + torch.log(e_sum)


def decode_attention_reference(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_kv_splits: torch.Tensor,
    sm_scale: float,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_dtype: torch.dtype = torch.bfloat16,
    kv_fmt: FP4Format = KV_FP4,
) -> torch.Tensor:
    """Decode attention output `[B, Hq, D]` (q's dtype) of queries q `[B, Hq, D]` over the FP4 cache of format
    `kv_fmt` (`KV_FORMATS`), computed on the CPU in the kernels' order (MHA: blocks of 64 slots, FP32
    probabilities; GQA: blocks of 32, probabilities cast to `kv_dtype`)."""
    check_kv_format(kv_fmt)
    heads = k_codes.shape[1]
    group = q.shape[1] // heads
    block_n, cast_p = (64, False) if group == 1 else (32, True)
    indptr, indices, splits = kv_indptr.cpu().long(), kv_indices.cpu().long(), num_kv_splits.cpu().long()
    out = torch.empty(q.shape, dtype=q.dtype)
    for b in range(q.shape[0]):
        slots = indices[indptr[b] : indptr[b + 1]]
        k = dequantize_kv(k_codes[slots.to(k_codes.device)].cpu(), k_scales[slots.to(k_codes.device)].cpu(), kv_dtype,
                          fmt=kv_fmt)  # fmt: skip
        v = dequantize_kv(v_codes[slots.to(v_codes.device)].cpu(), v_scales[slots.to(v_codes.device)].cpu(), kv_dtype,
                          fmt=kv_fmt)  # fmt: skip
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        n = slots.numel()
        per_split = math.ceil(math.ceil(n / int(splits[b])) / MIN_BLOCK_KV) * MIN_BLOCK_KV
        e_max = torch.full((q.shape[1],), -math.inf)
        e_sum = torch.zeros(q.shape[1])
        acc = torch.zeros(q.shape[1], q.shape[2])
        for start in range(0, n, per_split):
            o_s, lse = _split_attention(q[b].cpu(), k[start : start + per_split], v[start : start + per_split],
                                        sm_scale * k_scale, logit_cap, block_n, cast_p)  # fmt: skip
            n_e_max = torch.maximum(lse, e_max)
            old = torch.exp(e_max - n_e_max)
            w = torch.exp(lse - n_e_max)
            acc = acc * old[:, None] + w[:, None] * o_s
            e_sum = e_sum * old + w
            e_max = n_e_max
        if sinks is not None:
            e_sum = e_sum + torch.exp(sinks.cpu().float() - e_max)
        out[b] = (acc / e_sum[:, None] * v_scale).to(q.dtype)
    return out.to(q.device)


def extend_tiles(d: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) SGLang's triton extend attention uses for head dim `d` (a power of two) on
    `device` (`_get_block_sizes_for_extend_attention`, CUDA rows; no CUDA: its row for older GPUs)."""
    major, minor = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    if major == 12:
        tiles = (64, 128) if d <= 128 else (64, 64) if d <= 256 else (32, 32)
    elif major >= 9:
        tiles = (128, 64) if d <= 256 else (32, 64)
    elif major == 8 and minor in (6, 9):
        tiles = (64, 128) if d <= 128 else (64, 64) if d <= 256 else (32, 32)
    elif major == 8:
        tiles = (128, 128) if d <= 128 else (64, 64) if d <= 256 else (32, 64)
    else:
        tiles = (64, 64) if d <= 128 else (32, 32)
    return (*tiles, 4 if d <= 64 else 8)


def _online_block(state, q, k, v, allowed, sm_scale, logit_cap, v_scale):
    """One key block of SGLang's extend kernel: q `[M, H, D]`, k/v `[N, H, D]` (heads expanded), `allowed`
    `[M, N]`; state (acc `[H, M, D]`, deno `[H, M]`, e_max `[H, M]`) updated as the kernel does, probabilities cast
    to v's dtype."""
    acc, deno, e_max = state
    qk = torch.einsum("mhd,nhd->hmn", q.float(), k.float()) * sm_scale
    if logit_cap > 0:
        qk = logit_cap * (2 * torch.sigmoid(2 * (qk / logit_cap)) - 1)
    qk = qk.masked_fill(~allowed, -math.inf)
    row_max = qk.max(dim=2).values
    n_e_max = torch.maximum(torch.where(row_max == -math.inf, -1e20, row_max), e_max)
    re_scale = torch.exp(e_max - n_e_max)
    p = torch.exp(qk - n_e_max[..., None])
    deno = deno * re_scale + p.sum(dim=2)
    acc = acc * re_scale[..., None] + torch.einsum("hmn,nhd->hmd", p.to(v.dtype).float(), v.float()) * v_scale
    return acc, deno, n_e_max


def extend_attention_reference(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    is_causal: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    logit_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    kv_dtype: torch.dtype = torch.bfloat16,
    kv_fmt: FP4Format = KV_FP4,
    tiles: tuple[int, int] = (64, 64),
) -> torch.Tensor:
    """Extend attention output `[tokens, Hq, D]` (q's dtype): request b's new tokens `q_extend[qo_indptr[b]:
    qo_indptr[b + 1]]` attend over its cached prefix (FP4 pool slots `kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`)
    and over its new K/V (causally when `is_causal`), in the order of `trace_core.kernels.fp4_extend_attention`:
    query blocks of `tiles[0]`, key blocks of `tiles[1]` (prefix first), one online softmax, probabilities cast
    to the values' dtype before P V; the pool of format `kv_fmt` (`KV_FORMATS`). Computed on the CPU."""
    check_kv_format(kv_fmt)
    block_m, block_n = tiles
    group = q_extend.shape[1] // k_codes.shape[1]
    qo, kvp, idx = qo_indptr.cpu().long(), kv_indptr.cpu().long(), kv_indices.cpu().long()
    q_all, k_new, v_new = q_extend.cpu(), k_extend.cpu(), v_extend.cpu()
    out = torch.empty(q_extend.shape, dtype=q_extend.dtype)
    for b in range(qo.numel() - 1):
        slots = idx[kvp[b] : kvp[b + 1]].to(k_codes.device)
        k_pre = dequantize_kv(k_codes[slots].cpu(), k_scales[slots].cpu(), kv_dtype, fmt=kv_fmt)
        v_pre = dequantize_kv(v_codes[slots].cpu(), v_scales[slots].cpu(), kv_dtype, fmt=kv_fmt)
        k_pre, v_pre = k_pre.repeat_interleave(group, 1), v_pre.repeat_interleave(group, 1)
        q, k, v = (t[qo[b] : qo[b + 1]] for t in (q_all, k_new, v_new))
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        n_ext, n_pre = q.shape[0], slots.numel()
        for m0 in range(0, n_ext, block_m):
            qm = q[m0 : m0 + block_m].to(kv_dtype)  # the kernel's q.to(k.dtype) before the prefix dot
            rows = torch.arange(m0, m0 + qm.shape[0])
            state = (torch.zeros(q.shape[1], qm.shape[0], q.shape[2]), torch.zeros(q.shape[1], qm.shape[0]),
                     torch.full((q.shape[1], qm.shape[0]), -math.inf))  # fmt: skip
            for s in range(0, n_pre, block_n):
                allowed = torch.ones(qm.shape[0], min(block_n, n_pre - s), dtype=torch.bool)
                state = _online_block(state, qm, k_pre[s : s + block_n], v_pre[s : s + block_n], allowed,
                                      sm_scale * k_scale, logit_cap, v_scale)  # fmt: skip
            end = min(n_ext, m0 + block_m) if is_causal else n_ext
            for s in range(0, end, block_n):
                cols = torch.arange(s, min(s + block_n, end))
                allowed = (
                    rows[:, None] >= cols[None, :] if is_causal else torch.ones(len(rows), len(cols), dtype=torch.bool)
                )
                state = _online_block(state, q[m0 : m0 + block_m], k[cols], v[cols], allowed, sm_scale, logit_cap, 1.0)
            acc, deno, e_max = state
            if sinks is not None:
                deno = deno + torch.exp(sinks.cpu().float()[:, None] - e_max)
            out[qo[b] + m0 : qo[b] + m0 + qm.shape[0]] = (acc / deno[..., None]).transpose(0, 1).to(out.dtype)
    return out.to(q_extend.device)
