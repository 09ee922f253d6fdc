"""MXFP8: FP8 E4M3 elements with one E8M0 scale per 32, the activation format of the W4A8 recipes.

The scale of a block is `2^e`, `e = ceil(log2(amax / 448))` computed exactly in FP32 (the same ceil rule as this
project's MXFP4, `quant.e8m0_exponent` with the E4M3 maximum 448), clamped to the E8M0 range. An element is
`x * 2^-e` (exact), clipped to ±448 and cast to `float8_e4m3fn` (round to nearest even, subnormals included).
Activations in this format are not recorded: rollout and trainer both round to nearest with this one function, so
their values are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trace_core.numerics.formats import E8M0Rule, ScaleKind
from trace_core.numerics.quant import E8M0_BIAS, FLOAT_DTYPES, e8m0_exponent

E4M3_MAX = 448.0


@dataclass(frozen=True)
class FP8Format:
    """An FP8 block format: E4M3 elements, one E8M0 scale per `block` elements along the last dimension."""

    name: str
    block: int
    scale: ScaleKind
    e8m0_rule: E8M0Rule
    has_global_scale: bool = False


MXFP8 = FP8Format(name="mxfp8", block=32, scale=ScaleKind.E8M0, e8m0_rule=E8M0Rule.CEIL)


def _check(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"mxfp8 input must be a float tensor of {FLOAT_DTYPES}, got {getattr(x, 'dtype', type(x))}")
    if x.dim() == 0 or x.shape[-1] % MXFP8.block:
        raise ValueError(
            f"mxfp8 input shape {tuple(x.shape)}: last dimension must be a non-zero multiple of the block {MXFP8.block}"
        )


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 element bytes uint8 `[..., n]` and biased E8M0 scale bytes uint8 `[..., n // 32]` of `x`."""
    _check(x)
    blocks = x.detach().float().reshape(*x.shape[:-1], x.shape[-1] // MXFP8.block, MXFP8.block)
    e = e8m0_exponent(blocks.abs().amax(dim=-1), MXFP8.e8m0_rule, E4M3_MAX)
    z = torch.clamp(blocks * torch.exp2(-e).unsqueeze(-1), -E4M3_MAX, E4M3_MAX)
    codes = z.to(torch.float8_e4m3fn).view(torch.uint8).reshape(x.shape)
    return codes, (e + E8M0_BIAS).to(torch.uint8)


def dequantize_mxfp8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values `e4m3(code) * 2^(scale - 127)` (FP32 product, then cast to `dtype`)."""
    values = codes.view(torch.float8_e4m3fn).float().reshape(*scales.shape, MXFP8.block)
    decode = torch.exp2(scales.float() - E8M0_BIAS).unsqueeze(-1)
    return (values * decode).reshape(codes.shape).to(dtype)


def mxfp8_rtn(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest MXFP8 quantize-dequantize of `x` in its dtype (no autograd)."""
    return dequantize_mxfp8(*quantize_mxfp8(x), x.dtype)
