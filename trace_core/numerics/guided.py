"""Guided rounding (TRACE Algorithm 1, made exact) and RTN fake-quant, both with a straight-through backward.

For each element x with rollout decode scale s and rollout code bits c (docs/numerics.md, "Guided rounding"):
  1. z = clip(x * enc, -6, 6), enc the format's encode factor (1/s);
  2. bracket q- <= z <= q+, adjacent points of the signed E2M1 grid;
  3. b = 4: q* = argmin_{q in {q-, q+}} |q - q_roll|, q_roll the decoded rollout code;
  4. b < 4: q_hat = sign(x) * m with m the magnitude whose low b code bits equal c: the bracket end that matches
     if there is one (for b >= 1 the two ends differ in bit 0, so a rollout codeword adjacent to the bracket is
     recovered exactly), else the matching magnitude nearest |z|; q* = the bracket end nearer q_hat, and RTN
     when both outer candidates are equally near;
  5. forward s * q*, backward identity.
Rows without a record use the RTN of the rollout's role (`fallback_scale`); every such element is counted in a
`GuidanceStats`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from trace_core.numerics import e2m1
from trace_core.numerics.formats import FP4Format, get_format
from trace_core.numerics.quant import Quantized, check_input, dequantize, quantize, scale_factors, static_global_scale
from trace_core.numerics.recipe import Role, Scale
from trace_core.records.spec import Record, check_bits, low_bits_mask

_NONE = -1


def _outer_candidate_tables(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each (c, k): the nearest index below k and above k whose low `bits` equal c (-1 where none)."""
    mask = low_bits_mask(bits)
    below = torch.full((mask + 1, 8), _NONE, dtype=torch.int64)
    above = torch.full((mask + 1, 8), _NONE, dtype=torch.int64)
    for c in range(mask + 1):
        for k in range(8):
            lower = [j for j in range(k) if j & mask == c]
            upper = [j for j in range(k + 1, 8) if j & mask == c]
            below[c, k] = lower[-1] if lower else _NONE
            above[c, k] = upper[0] if upper else _NONE
    return below, above


_TABLES = {b: _outer_candidate_tables(b) for b in (1, 2, 3)}


@functools.cache
def _device_tables(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`_TABLES[bits]` on `device`, copied once (later calls copy nothing from the host)."""
    below, above = _TABLES[bits]
    return below.to(device), above.to(device)


@dataclass
class GuidanceStats:
    """Element counts of guided-rounding calls; `rtn_fallback` counts elements rounded by RTN for want of a
    record, `redirected` counts guided elements whose choice differs from RTN. The kernel path accumulates
    counts as 0-d device tensors so that counting never syncs the host; `int()` reads them."""

    guided: int | torch.Tensor = 0
    rtn_fallback: int | torch.Tensor = 0
    redirected: int | torch.Tensor = 0

    def reset(self) -> None:
        self.guided = self.rtn_fallback = self.redirected = 0


GLOBAL_STATS = GuidanceStats()
"""Where `guided_round` counts when the caller passes no `stats` of its own."""


class _StraightThrough(torch.autograd.Function):
    """Forward returns the quantized value unchanged; backward passes the gradient to x (identity)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` in the forward pass, gradient of identity to `x` in the backward pass."""
    return _StraightThrough.apply(x, value)


def rtn_fake_quant(
    x: torch.Tensor,
    fmt: FP4Format | str,
    *,
    global_scale: float | torch.Tensor | None = None,
    per_token: bool = False,
) -> torch.Tensor:
    """Round-to-nearest FP4 quantize-dequantize of `x` in its dtype, straight-through backward."""
    q = quantize(x.detach(), fmt, global_scale=global_scale, per_token=per_token)
    return straight_through(x, dequantize(q, x.dtype))


def _rollout_bits(rollout: Quantized | Record, bits: int) -> torch.Tensor:
    """The rollout's low `bits` code bits per element."""
    if isinstance(rollout, Quantized):
        return rollout.codes & low_bits_mask(bits)
    if bits > rollout.bits:
        raise ValueError(f"record keeps {rollout.bits} code bits, cannot guide with {bits}")
    return rollout.code_bits() & low_bits_mask(bits)


def guided_codes(z: torch.Tensor, c: torch.Tensor, bits: int, fmt: FP4Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Guided and RTN codes (uint8) of scaled values z (FP32, already clipped) given rollout code bits c."""
    negative = torch.signbit(z) if fmt.negative_zero else z < 0
    a = z.abs()
    lo = e2m1.floor_index(a)
    on_grid = e2m1.magnitudes(lo) == a
    hi = torch.where(on_grid, lo, torch.clamp(lo + 1, max=7))
    rtn = e2m1.round_magnitude(a, fmt.rounding)
    c = c.long()
    if bits == 4:
        q_roll = e2m1.code_values(c)
        sign = torch.where(negative, -1.0, 1.0)
        d_lo = (sign * e2m1.magnitudes(lo) - q_roll).abs()
        d_hi = (sign * e2m1.magnitudes(hi) - q_roll).abs()
        k = torch.where(d_hi < d_lo, hi, lo)
    else:
        mask = low_bits_mask(bits)
        below_t, above_t = _device_tables(bits, z.device)
        below, above = below_t[c, lo], above_t[c, hi]
        # Compare distances exactly: a - m_below < m_above - a  <=>  2a < m_below + m_above.
        twice = 2 * a
        m_below = torch.where(below >= 0, e2m1.magnitudes(below.clamp(min=0)), torch.full_like(a, -float("inf")))
        m_above = torch.where(above >= 0, e2m1.magnitudes(above.clamp(min=0)), torch.full_like(a, float("inf")))
        mid = m_below + m_above
        outer = torch.where(twice < mid, lo, torch.where(twice > mid, hi, rtn))
        outer = torch.where(below < 0, hi, torch.where(above < 0, lo, outer))
        k = torch.where((lo & mask) == c, lo, torch.where((hi & mask) == c, hi, outer))
    sign_bits = negative.to(torch.uint8) << 3
    return sign_bits | k.to(torch.uint8), sign_bits | rtn.to(torch.uint8)


def fallback_scale(rollout: Quantized | Record, role: Role | None = None) -> dict:
    """`quantize` scale arguments for rows without a record: the RTN of the rollout's `role` (per-token dynamic, the
    static S_enc = 1, or the rollout's per-tensor scale; E8M0 formats take none). Without a role the granularity is
    read off the record: per-token dynamic where it holds one scale per row, its 0-d scale applied statically. A
    static scale stored per row (an NVFP4 KV record from the store) reads as per token there: pass the role.
    ValueError for a role of another format than the record's."""
    if role is not None and role.fmt != rollout.fmt:
        raise ValueError(f"role of format {role.fmt.name} given for a {rollout.fmt.name} record")
    gs = rollout.global_scale
    if gs is None:
        return {}
    scale = None if role is None else role.scale
    if scale is Scale.STATIC:
        return {"global_scale": static_global_scale(gs.device)}
    if scale is Scale.PER_TOKEN or scale is None and gs.dim():
        return {"per_token": True}
    return {"global_scale": gs}  # per tensor: the rollout's S_enc (0-d, or repeated per row)


def _fallback_rtn(x: torch.Tensor, rollout: Quantized | Record, role: Role | None) -> torch.Tensor:
    """RTN for rows without a record, under `fallback_scale`."""
    return dequantize(quantize(x, rollout.fmt, **fallback_scale(rollout, role)), x.dtype)


def _check_rollout(x: torch.Tensor, rollout: Quantized | Record, bits: int, finite: bool = True) -> FP4Format:
    check_bits(bits)
    if not isinstance(rollout, (Quantized, Record)):
        raise ValueError(f"rollout must be a Quantized or a Record, got {type(rollout).__name__}")
    fmt = get_format(rollout.fmt)
    check_input(x, fmt, "guided_round input", finite=finite)
    if tuple(rollout.shape) != tuple(x.shape):
        raise ValueError(f"rollout record shape {tuple(rollout.shape)} does not match input shape {tuple(x.shape)}")
    return fmt


def guided_quantize(
    x: torch.Tensor, rollout: Quantized | Record, bits: int, *, check_finite: bool = True
) -> tuple[Quantized, torch.Tensor]:
    """Guided FP4 codes of `x` under the rollout's scales, and a mask of elements whose choice differs from RTN.

    The returned `Quantized` carries the rollout's scale bytes and global scale, so `dequantize` of it is the
    guided forward value. `check_finite=False` skips the NaN/Inf check (a host sync).
    """
    fmt = _check_rollout(x, rollout, bits, check_finite)
    c = _rollout_bits(rollout, bits)
    _, encode = scale_factors(fmt, rollout.scales, rollout.global_scale)
    blocks = x.detach().float().reshape(*x.shape[:-1], x.shape[-1] // fmt.block, fmt.block)
    z = torch.clamp(blocks * encode.unsqueeze(-1), -e2m1.E2M1_MAX, e2m1.E2M1_MAX)
    codes, rtn_codes = guided_codes(z, c.reshape(z.shape), bits, fmt)
    guided = Quantized(codes=codes.reshape(x.shape), scales=rollout.scales, global_scale=rollout.global_scale, fmt=fmt)
    return guided, (codes != rtn_codes).reshape(x.shape)


def guided_round(
    x: torch.Tensor,
    rollout: Quantized | Record,
    bits: int,
    *,
    has_record: torch.Tensor | None = None,
    stats: GuidanceStats | None = None,
    role: Role | None = None,
) -> torch.Tensor:
    """Round `x` to the FP4 grid under the rollout's scales, toward the rollout's codes (straight-through).

    `rollout` is the rollout-side `Quantized` or a `Record` of the same shape as `x`; `bits` (1..4) of each code
    guide the choice. `has_record` (bool, `x.shape[:-1]`) marks rows that have a record; other rows get the RTN of
    the rollout's `role` (`fallback_scale`) and are counted in `stats` (or `GLOBAL_STATS`). Returns a tensor of x's
    dtype and shape.
    """
    _check_rollout(x, rollout, bits)
    if has_record is not None and (has_record.dtype != torch.bool or tuple(has_record.shape) != tuple(x.shape[:-1])):
        raise ValueError(
            f"has_record must be bool of shape {tuple(x.shape[:-1])}, got {has_record.dtype} {tuple(has_record.shape)}"
        )
    stats = GLOBAL_STATS if stats is None else stats
    xd = x.detach()
    guided, redirected = guided_quantize(xd, rollout, bits)
    value = dequantize(guided, x.dtype)
    fallback = 0
    if has_record is not None and not bool(has_record.all()):
        value = torch.where(has_record.unsqueeze(-1), value, _fallback_rtn(xd, rollout, role))
        redirected &= has_record.unsqueeze(-1)
        fallback = int((~has_record).sum()) * x.shape[-1]
    stats.guided += x.numel() - fallback
    stats.rtn_fallback += fallback
    stats.redirected += int(redirected.sum())
    return straight_through(x, value)
