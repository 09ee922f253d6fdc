"""FP4 formats of the numerics contract (docs/design.md, "Numerics contract"), as named immutable objects.

A format fixes the block size, how a block's scale is chosen and stored, and how an element is rounded to the
E2M1 grid. Every quantizer in TRACE (reference, Triton kernels, both engine adapters) takes one of these objects
instead of a bag of flags, so a record always says exactly how it was produced.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ScaleKind(enum.Enum):
    """How a block scale is stored."""

    E4M3 = "e4m3"  # FP8 E4M3 decode scale times an FP32 global scale (NVFP4)
    E8M0 = "e8m0"  # power of two, stored as a biased exponent byte (MX / SGLang KV)


class Rounding(enum.Enum):
    """How an element's scaled magnitude is rounded to the E2M1 grid."""

    NEAREST_EVEN = "nearest_even"  # PTX cvt.rn.satfinite: ties go to the even code (mantissa bit 0)
    TIES_UP = "ties_up"  # SGLang KV: sum(|x| >= bounds), ties go away from zero


class E8M0Rule(enum.Enum):
    """Exponent rule of an E8M0 block scale."""

    CEIL = "ceil"  # 2^ceil(log2(amax/6)): the block max never saturates (triton_kernels, FlashInfer, TE)
    FLOOR = "floor"  # OCP MX v1.0: 2^(floor(log2(amax)) - 2); the block max may saturate to 6
    SGLANG_KV = "sglang_kv"  # ceil(torch.log2(max(amax/6, 1e-10))) in FP32, exactly as kvfp4_tensor.py


@dataclass(frozen=True)
class FP4Format:
    """One FP4 quantization recipe: E2M1 elements, one scale per `block` elements along the last dimension.

    Attributes:
        name: registry key (`get_format`).
        block: elements per scale block.
        scale: storage of the block scale.
        rounding: element rounding rule.
        e8m0_rule: exponent rule for E8M0 scales (None for E4M3).
        has_global_scale: whether an FP32 global / per-token scale `S_enc` sits above the block scales.
        negative_zero: whether a negative input that rounds to zero keeps the sign bit (code 8). True mirrors the
            hardware converter (which also keeps the sign of -0.0); False is SGLang's KV rule `scaled < 0`.
        kernel_id: the format's id in the Triton kernels (`trace_core.kernels.triton_fp4` reads it from here),
            distinct per registered format.
    """

    name: str
    block: int
    scale: ScaleKind
    rounding: Rounding
    e8m0_rule: E8M0Rule | None
    has_global_scale: bool
    negative_zero: bool
    kernel_id: int

    def __post_init__(self) -> None:
        if (self.scale is ScaleKind.E8M0) != (self.e8m0_rule is not None):
            raise ValueError(f"format {self.name!r}: an e8m0_rule goes with E8M0 scales, and only with them")


NVFP4 = FP4Format(
    name="nvfp4",
    block=16,
    scale=ScaleKind.E4M3,
    rounding=Rounding.NEAREST_EVEN,
    e8m0_rule=None,
    has_global_scale=True,
    negative_zero=True,
    kernel_id=0,
)
"""NVFP4, FlashInfer / TransformerEngine exact-math convention.

`S_enc = 2688 / amax` (FP32; 1 when amax is 0), `sf = e4m3_rne_sat(block_amax * (S_enc * (1/6)))`, decode scale
`s = float(sf) * (1/S_enc)`, element encode factor `enc = min(1/s, FLT_MAX)`, elements RNE with saturation to ±6.
Used for routed-expert weights and MoE-input activations."""

MXFP4 = FP4Format(
    name="mxfp4",
    block=32,
    scale=ScaleKind.E8M0,
    rounding=Rounding.NEAREST_EVEN,
    e8m0_rule=E8M0Rule.CEIL,
    has_global_scale=False,
    negative_zero=True,
    kernel_id=1,
)
"""MXFP4 with the inference kernels' ceil scale `2^ceil(log2(amax/6))`, exact in FP32 (no log2 rounding)."""

MXFP4_OCP = FP4Format(
    name="mxfp4_ocp",
    block=32,
    scale=ScaleKind.E8M0,
    rounding=Rounding.NEAREST_EVEN,
    e8m0_rule=E8M0Rule.FLOOR,
    has_global_scale=False,
    negative_zero=True,
    kernel_id=2,
)
"""MXFP4 with the OCP MX v1.0 floor scale `2^(floor(log2 amax) - 2)`; block maxima above 6 saturate."""

KV_FP4 = FP4Format(
    name="kv_fp4",
    block=16,
    scale=ScaleKind.E8M0,
    rounding=Rounding.TIES_UP,
    e8m0_rule=E8M0Rule.SGLANG_KV,
    has_global_scale=False,
    negative_zero=False,
    kernel_id=3,
)
"""SGLang's FP4 KV cache (`--kv-cache-dtype fp4_e2m1`, `KVFP4QuantizeUtil`): 16 elements of one head vector per
E8M0 scale `ceil(log2(max(amax/6, 1e-10)))` stored `+127`, elements rounded ties-up, sign bit set for any
negative value (also when it rounds to 0) but not for -0.0."""

_FORMATS = {f.name: f for f in (NVFP4, MXFP4, MXFP4_OCP, KV_FP4)}


def get_format(name: str | FP4Format) -> FP4Format:
    """Return the format registered under `name` (a format object is returned unchanged)."""
    if isinstance(name, FP4Format):
        return name
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown FP4 format {name!r}; known formats: {sorted(_FORMATS)}") from None


def format_names() -> tuple[str, ...]:
    """Names of all registered formats."""
    return tuple(_FORMATS)
