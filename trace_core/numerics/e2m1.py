"""The E2M1 element grid: rounding, codes, brackets and nibble packing.

A 4-bit code is `sign << 3 | k` with k the magnitude index into `MAGNITUDES`; bit 0 of k is the mantissa bit.
Packed storage puts element 2i in the low nibble of byte i (SGLang, FlashInfer and torchao agree).
"""

from __future__ import annotations

import functools

import torch

from trace_core.numerics.formats import Rounding

MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""E2M1 magnitudes by index k (code bits 2..0)."""

BOUNDS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Midpoints between neighbouring magnitudes: BOUNDS[j] separates index j from j + 1."""

E2M1_MAX = 6.0
SIGN_BIT = 0x8
MAG_MASK = 0x7


@functools.cache
def _table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """One read-only FP32 copy of `values` per device: made once, so later calls copy nothing from the host (CUDA
    graph capture forbids that)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def round_magnitude(a: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """Index (int64) of the E2M1 magnitude `a >= 0` rounds to, saturating at 6 (index 7).

    NEAREST_EVEN sends a tie to the even index (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), as `cvt.rn.satfinite`;
    TIES_UP sends it to the larger magnitude, as SGLang's KV quantizer `sum(|x| >= bounds)`.
    The index is the number of bounds below `a`: strictly below for a bound whose lower neighbour is even under
    NEAREST_EVEN (so the tie stays there), at or below otherwise.
    """
    bounds = _table(BOUNDS, a.device)
    if rounding is Rounding.TIES_UP:
        return torch.bucketize(a, bounds, right=True)
    even_lower, odd_lower = bounds[0::2].contiguous(), bounds[1::2].contiguous()
    return torch.bucketize(a, even_lower, right=False) + torch.bucketize(a, odd_lower, right=True)


def floor_index(a: torch.Tensor) -> torch.Tensor:
    """Index of the largest E2M1 magnitude `<= a` (a >= 0), as int64."""
    return torch.bucketize(a, _table(MAGNITUDES[1:], a.device), right=True)


def magnitudes(k: torch.Tensor) -> torch.Tensor:
    """FP32 magnitude of each index."""
    return _table(MAGNITUDES, k.device)[k.long()]


def code_values(codes: torch.Tensor) -> torch.Tensor:
    """FP32 signed value of each 4-bit code (codes 0 and 8 both decode to zero)."""
    codes = codes.long()
    mag = magnitudes(codes & MAG_MASK)
    return torch.where((codes & SIGN_BIT) != 0, -mag, mag)


def signed_index(codes: torch.Tensor) -> torch.Tensor:
    """Position of each code on the signed grid (-7 .. 7; +0 and -0 share position 0), for codebook distances."""
    codes = codes.long()
    k = codes & MAG_MASK
    return torch.where((codes & SIGN_BIT) != 0, -k, k)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes `[..., n]` (n even) into bytes `[..., n // 2]`, element 2i in the low nibble."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"pack_fp4 expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 0xF:
        raise ValueError("pack_fp4 got a code above 15; codes must be 4-bit")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_fp4`: bytes `[..., m]` -> codes `[..., 2m]`."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4 expects uint8 bytes, got {packed.dtype}")
    out = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def to_float4_x2(codes: torch.Tensor) -> torch.Tensor:
    """Codes `[..., n]` as torch's storage dtype `float4_e2m1fn_x2` `[..., n // 2]` (same bytes as `pack_fp4`)."""
    return pack_fp4(codes).view(torch.float4_e2m1fn_x2)


def from_float4_x2(t: torch.Tensor) -> torch.Tensor:
    """Codes `[..., 2m]` from a `float4_e2m1fn_x2` tensor `[..., m]`."""
    if t.dtype != torch.float4_e2m1fn_x2:
        raise ValueError(f"from_float4_x2 expects torch.float4_e2m1fn_x2, got {t.dtype}")
    return unpack_fp4(t.view(torch.uint8))
