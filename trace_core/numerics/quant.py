"""Pure-torch FP4 quantization: the reference every kernel and engine adapter is checked against (docs/design.md,
"Numerics contract").

`quantize` returns the exact codes and raw scale bytes an engine would store; `dequantize` and `decode_scales`
turn them back into values. All arithmetic is FP32 in the operation order the contract fixes, so results are
bit-identical on CPU and GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from trace_core.numerics import e2m1
from trace_core.numerics.formats import E8M0Rule, FP4Format, ScaleKind, get_format

FLT_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0
NVFP4_AMAX_TO_SENC = E4M3_MAX * e2m1.E2M1_MAX  # S_enc = 2688 / amax
E8M0_BIAS = 127
ONE_SIXTH = 1.0 / 6.0  # applied as an FP32 tensor constant, like the kernels' (1.f / 6.f)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Quantized:
    """An FP4 tensor: one code per element plus raw scale bytes per block.

    Attributes:
        codes: uint8, same shape as the input, one 4-bit code per element.
        scales: uint8 `[..., n // block]`: E4M3 bits (nvfp4) or biased E8M0 exponents (mxfp4, kv_fp4).
        global_scale: FP32 `S_enc` for nvfp4, a 0-d tensor (per tensor / static) or `[..., 1]` (per token);
            None for E8M0 formats.
        fmt: the format that produced it.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor | None
    fmt: FP4Format

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def check_input(x: torch.Tensor, fmt: FP4Format, what: str = "input", *, finite: bool = True) -> None:
    """Raise ValueError unless `x` is a float tensor whose last dimension is a multiple of the block, and finite
    unless `finite=False` (the finiteness check reads the device: callers on a sync-free path skip it)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what} dtype {x.dtype} is not supported; use one of {FLOAT_DTYPES}")
    if x.dim() == 0 or x.shape[-1] % fmt.block:
        raise ValueError(
            f"{what} shape {tuple(x.shape)}: last dimension must be a non-zero multiple of the "
            f"{fmt.name} block size {fmt.block}"
        )
    if finite and x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} contains NaN or Inf; FP4 quantization needs finite values")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def check_scale_args(
    fmt: FP4Format,
    global_scale: float | torch.Tensor | None,
    per_token: bool,
    rows: tuple[int, ...],
    device: torch.device | str,
) -> torch.Tensor | None:
    """The one check of a quantizer's scale arguments (reference and kernels): an E8M0 format takes neither
    `global_scale` nor `per_token`; an E4M3 format takes a static `global_scale` (0-d, or one per row `[*rows, 1]`)
    or `per_token`, not both. Returns the static scale as FP32 on `device`, None when none is given."""
    if fmt.scale is ScaleKind.E8M0:
        if global_scale is not None or per_token:
            raise ValueError(f"{fmt.name} has E8M0 block scales only; global_scale / per_token do not apply")
        return None
    if global_scale is None:
        return None
    if per_token:
        raise ValueError("pass either global_scale (static scale) or per_token=True, not both")
    s_enc = torch.as_tensor(global_scale, dtype=torch.float32, device=device)
    if s_enc.dim() and tuple(s_enc.shape) != (*rows, 1):
        raise ValueError(f"global_scale shape {tuple(s_enc.shape)} must be scalar or {(*rows, 1)}")
    return s_enc


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """FP32 `S_enc = min(2688 / amax, FLT_MAX)`, 1 where amax is 0."""
    amax = amax.float()
    # tensor / tensor is an IEEE division; `scalar / tensor` would be reciprocal-then-multiply, an ulp off
    s_enc = torch.clamp(torch.full_like(amax, NVFP4_AMAX_TO_SENC) / amax, max=FLT_MAX)
    return torch.where(amax > 0, s_enc, torch.ones_like(s_enc))


def static_global_scale(device: torch.device | str) -> torch.Tensor:
    """The static `S_enc` of an NVFP4 KV pool (`trace_core.numerics.recipe.Scale.STATIC`): 1, a 0-d FP32 tensor made on
    `device` (no host copy, no sync: CUDA-graph safe). With it every decoded value `e2m1 * e4m3` is exact."""
    return torch.ones((), dtype=torch.float32, device=device)


def e8m0_exponent(amax: torch.Tensor, rule: E8M0Rule, elem_max: float = e2m1.E2M1_MAX) -> torch.Tensor:
    """Block exponent e (FP32, integral) of an E8M0 scale 2^e, clamped to the E8M0 range; `elem_max` is the element
    format's largest magnitude (6 for E2M1, 448 for the FP8 E4M3 elements of MXFP8; CEIL rule only)."""
    if rule is E8M0Rule.SGLANG_KV:
        # kvfp4_tensor.py: torch.ceil(torch.log2(torch.clamp(block_max / 6, min=1e-10))), FP32 log2 included.
        return torch.ceil(torch.log2(torch.clamp(amax / e2m1.E2M1_MAX, min=1e-10)))
    source = amax / elem_max if rule is E8M0Rule.CEIL else amax
    mantissa, exp = torch.frexp(source)  # source = mantissa * 2^exp, mantissa in [0.5, 1)
    exp = exp.to(torch.float32)
    if rule is E8M0Rule.CEIL:
        e = torch.where(mantissa == 0.5, exp - 1, exp)  # exact ceil(log2(source))
    else:
        e = exp - 1 - 2  # floor(log2 amax) - emax(E2M1)
    e = torch.where(source > 0, e, torch.full_like(e, -E8M0_BIAS))
    return torch.clamp(e, -E8M0_BIAS, E8M0_BIAS)


def scale_factors(
    fmt: FP4Format, scales: torch.Tensor, global_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block FP32 `(decode, encode)` factors from raw scale bytes.

    nvfp4: `decode = float(sf) * (1/S_enc)`, `encode = min(1/decode, FLT_MAX)` (TE / FlashInfer exact math).
    E8M0: `decode = 2^e`, `encode = 2^-e` (both exact).
    """
    if fmt.scale is ScaleKind.E4M3:
        if global_scale is None:
            raise ValueError(f"{fmt.name} needs a global scale, got None")
        decode = scales.view(torch.float8_e4m3fn).float() * torch.reciprocal(global_scale)
        return decode, torch.clamp(torch.reciprocal(decode), max=FLT_MAX)
    e = scales.float() - E8M0_BIAS
    return torch.exp2(e), torch.exp2(-e)


def _encode_codes(z: torch.Tensor, fmt: FP4Format) -> torch.Tensor:
    """4-bit codes of already-scaled FP32 values z."""
    negative = torch.signbit(z) if fmt.negative_zero else z < 0
    k = e2m1.round_magnitude(z.abs(), fmt.rounding)
    return (negative.to(torch.uint8) << 3) | k.to(torch.uint8)


@functools.cache
def _one_sixth(device: torch.device) -> torch.Tensor:
    """The FP32 constant 1/6 on `device`, made once (later calls copy nothing from the host)."""
    return torch.tensor(ONE_SIXTH, dtype=torch.float32, device=device)


def quantize(
    x: torch.Tensor,
    fmt: FP4Format | str,
    *,
    global_scale: float | torch.Tensor | None = None,
    per_token: bool = False,
    check_finite: bool = True,
) -> Quantized:
    """Quantize `x` (fp32/bf16/fp16, last dim a multiple of the block) to FP4 codes and raw scale bytes.

    For nvfp4, `global_scale` is a static `S_enc` (scalar, or `[..., 1]` per row); without it `S_enc` is computed
    per tensor, or per token row when `per_token` is set. E8M0 formats take neither. `check_finite=False` skips
    the NaN/Inf check (a host sync).
    """
    fmt = get_format(fmt)
    check_input(x, fmt, finite=check_finite)
    xf = x.float()
    blocks = _blocks(xf, fmt.block)
    block_amax = blocks.abs().amax(dim=-1)
    s_enc = check_scale_args(fmt, global_scale, per_token, tuple(xf.shape[:-1]), xf.device)
    if fmt.scale is ScaleKind.E4M3:
        if s_enc is None:  # per token row, or per tensor; 1 where the amax is 0
            s_enc = nvfp4_global_scale(xf.abs().amax(dim=-1, keepdim=True) if per_token else xf.abs().amax())
        elif s_enc.numel() and not bool((torch.isfinite(s_enc) & (s_enc > 0)).all()):
            raise ValueError("global_scale must be finite and positive")
        one_sixth = _one_sixth(xf.device)
        sf = block_amax * (s_enc * one_sixth)
        scales = torch.clamp(sf, max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        assert fmt.e8m0_rule is not None  # FP4Format guarantees it for E8M0 scales
        scales = (e8m0_exponent(block_amax, fmt.e8m0_rule) + E8M0_BIAS).to(torch.uint8)
    _, encode = scale_factors(fmt, scales, s_enc)
    codes = _encode_codes(blocks * encode.unsqueeze(-1), fmt).reshape(x.shape)
    return Quantized(codes=codes, scales=scales, global_scale=s_enc, fmt=fmt)


def decode_scales(q: Quantized) -> torch.Tensor:
    """FP32 decode scale of every block, global / token scale included: `[..., n // block]`."""
    return scale_factors(q.fmt, q.scales, q.global_scale)[0]


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values `code_value * decode_scale` (FP32 product, then cast to `dtype`)."""
    values = _blocks(e2m1.code_values(q.codes), q.fmt.block) * decode_scales(q).unsqueeze(-1)
    return values.reshape(q.codes.shape).to(dtype)
