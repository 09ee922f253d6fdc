"""Quantization of one tensor role of a precision recipe: what every site of every engine calls.

The rollout (embedded engine, SGLang's expert path) and the trainer (Megatron sites) pass a `Role` of their recipe
and the rows; the format, the scale granularity and the kernel are chosen here only. FP4 roles run through
`trace_core.kernels` (Triton on CUDA, the `trace_core` reference elsewhere); MXFP8 roles through
`trace_core.numerics.mxfp8`. Rows are 2-D `[T, D]` with the block along D.
"""

from __future__ import annotations

import torch

from trace_core import kernels
from trace_core.numerics.formats import KV_FP4, NVFP4, FP4Format
from trace_core.numerics.guided import straight_through
from trace_core.numerics.mxfp8 import mxfp8_rtn
from trace_core.numerics.quant import Quantized, nvfp4_global_scale, quantize, static_global_scale
from trace_core.numerics.recipe import Role, Scale


def needs_row_amax(role: Role) -> bool:
    """Whether the role's scale comes from the amax of a whole row: a row split across tensor-parallel ranks then
    needs the max of the shards' `row_amax` (block-scaled roles are local to a block and need nothing)."""
    return role.scale is Scale.PER_TOKEN


def _fp4_scale(role: Role, x: torch.Tensor, row_amax: torch.Tensor | None) -> dict:
    """`quantize` / kernel scale arguments of an FP4 role for rows `x`."""
    if row_amax is not None:
        if not needs_row_amax(role):
            raise ValueError(f"{role.fmt.name} {role.scale.value}: a row amax does not apply")
        if tuple(row_amax.shape) != (x.shape[0], 1):
            raise ValueError(f"row_amax must be [{x.shape[0]}, 1], got {tuple(row_amax.shape)}")
        return {"global_scale": nvfp4_global_scale(row_amax)}
    if role.scale is Scale.PER_TOKEN:
        return {"per_token": True}
    if role.scale is Scale.PER_TENSOR:
        return {"global_scale": nvfp4_global_scale(x.detach().abs().amax())}
    if role.scale is Scale.STATIC:
        return {"global_scale": static_global_scale(x.device)}
    return {}


def fake_quant(role: Role, x: torch.Tensor, *, row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Round-to-nearest quantize-dequantize of rows `x [T, D]` under `role`, straight-through backward.
    `row_amax [T, 1]`: for per-token roles, the amax over the full row when `x` holds a tensor-parallel shard."""
    if not isinstance(role.fmt, FP4Format):
        if row_amax is not None:
            raise ValueError(f"{role.fmt.name}: a row amax does not apply (block scales only)")
        return straight_through(x, mxfp8_rtn(x.detach()))
    return kernels.kernel_rtn_fake_quant(x, role.fmt, **_fp4_scale(role, x, row_amax))


def _per_tensor_format(role: Role) -> FP4Format:
    """The FP4 format of a per-tensor-scaled role (only FP4 formats with a global scale take one)."""
    if not isinstance(role.fmt, FP4Format) or not role.fmt.has_global_scale:
        raise ValueError(f"{role.fmt.name}: a per-tensor scale needs an FP4 format with a global scale")
    return role.fmt


def weight_rtn(role: Role, w: torch.Tensor, amax: torch.Tensor | None = None) -> torch.Tensor:
    """RTN values of one weight matrix `w [out, in]` under the weights role (no autograd). Per-tensor roles take
    their scale from `amax` when given (the full matrix's, e.g. of gate and up together when `w` is a shard)."""
    if role.scale is Scale.PER_TENSOR:
        fmt = _per_tensor_format(role)
        scale = nvfp4_global_scale(w.detach().abs().amax() if amax is None else amax)
        return kernels.kernel_rtn_fake_quant(w.detach(), fmt, global_scale=scale)
    return fake_quant(role, w.detach())


def expert_weights_rtn(role: Role, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """RTN values of all expert matrices `w [E, out, in]` (contiguous) under the weights role, each matrix its own
    per-tensor scale (FC1: gate and up are one matrix), all experts in one kernel launch. No autograd. `out`
    receives them (it may be `w` itself: each element is written only from its own block) and is returned."""
    w = w.detach()
    e, n, k = w.shape
    if out is not None and (out.shape != w.shape or out.dtype != w.dtype or not out.is_contiguous()):
        raise ValueError(
            f"out must be a contiguous {w.dtype} {tuple(w.shape)} tensor, got {out.dtype} {tuple(out.shape)}"
        )
    if role.scale is not Scale.PER_TENSOR:
        y = fake_quant(role, w.reshape(e * n, k)).view(e, n, k)
        return y if out is None else out.copy_(y)
    fmt = _per_tensor_format(role)
    amax = torch.linalg.vector_norm(w, ord=float("inf"), dim=(1, 2))  # max |w| per matrix, without a |w| copy
    rows = nvfp4_global_scale(amax).repeat_interleave(n).unsqueeze(1)  # the matrix scale as a per-row scale
    if out is None:
        return kernels.kernel_rtn_fake_quant(w.reshape(e * n, k), fmt, global_scale=rows).view(e, n, k)
    kernels.quantize_record(w.reshape(e * n, k), fmt, 0, global_scale=rows, out=out.detach().view(e * n, k))
    return out


def rollout_rtn(role: Role, x: torch.Tensor, bits: int, record=None) -> torch.Tensor:
    """The rollout's round-to-nearest values of rows `x [T, D]` under `role`; `record` (staging buffers with
    `low_bits`, `scales`, `global_scale`, e.g. `trace_core.records.capture.SiteBuffers`) receives the record in the same
    pass. CUDA-graph safe (no host sync)."""
    if record is not None and not role.recorded:
        raise ValueError(f"{role.fmt.name} role is not recorded under its recipe")
    if not isinstance(role.fmt, FP4Format):
        return mxfp8_rtn(x)
    out = torch.empty_like(x)
    scale = _fp4_scale(role, x, None)
    buffers = {}
    if record is not None:
        buffers = {"low_bits": record.low_bits, "scales": record.scales}
        if role.scale is Scale.PER_TOKEN:
            buffers["token_scale"] = record.global_scale  # the kernel writes each row's S_enc
        elif record.global_scale is not None:  # a static or per-tensor S_enc, repeated per row
            record.global_scale.copy_(scale["global_scale"].expand_as(record.global_scale))
    kernels.quantize_record(x, role.fmt, bits, out=out, **scale, **buffers)
    return out


def kv_pool_format(role: Role) -> FP4Format:
    """The format of the FP4 KV pool that holds a K/V role: `kv_fp4` (E8M0 scale bytes) or NVFP4 under the static
    unit S_enc (E4M3 scale bytes). ValueError for any other role: a pool keeps codes and block scale bytes, no
    scale per token or tensor."""
    for fmt, scale in ((KV_FP4, Scale.PER_BLOCK), (NVFP4, Scale.STATIC)):
        if (role.fmt, role.scale) == (fmt, scale):
            return fmt
    raise ValueError(
        f"an FP4 KV pool holds kv_fp4 or static-scale nvfp4 K/V; got {role.fmt.name} with scale {role.scale.value}"
    )


def kv_pool_bytes(role: Role, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP4 KV pool's bytes of K/V rows `x [N, W]` (W = heads * head_dim, blocks of 16 along W) under `role`
    (`kv_pool_format`): packed E2M1 codes uint8 `[N, W/2]` (element 2i in the low nibble) and scale bytes uint8
    `[N, W/16]` (E8M0, or E4M3 bit patterns for NVFP4), SGLang's `MHATokenToKVPoolFP4` layout. Through
    `trace_core.kernels` (Triton on CUDA): no host sync, shapes from x's only (CUDA-graph safe)."""
    fmt = kv_pool_format(role)
    codes, scales, _ = kernels.record_buffers(x.shape[0], x.shape[1], fmt, 4, x.device)
    kernels.quantize_record(x, fmt, 4, low_bits=codes, scales=scales, **_fp4_scale(role, x, None))
    return codes, scales


def quantize_role(role: Role, x: torch.Tensor, *, check_finite: bool = True) -> Quantized:
    """FP4 codes and scales of rows `x` under a recorded (FP4) role, with the reference quantizer."""
    if not isinstance(role.fmt, FP4Format):
        raise ValueError(f"{role.fmt.name} is not an FP4 format; only FP4 roles have codes to record")
    return quantize(x, role.fmt, check_finite=check_finite, **_fp4_scale(role, x, None))
