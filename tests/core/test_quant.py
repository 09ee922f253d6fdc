"""Value-level tests of the FP4 reference quantizer: every boundary and tie, scales, zeros, signs, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.kernels import kernel_rtn_fake_quant, quantize_record
from trace_core.numerics import e2m1
from trace_core.numerics.formats import KV_FP4, MXFP4, MXFP4_OCP, NVFP4, Rounding, get_format
from trace_core.numerics.quant import decode_scales, dequantize, quantize

ALL = [NVFP4, MXFP4, MXFP4_OCP, KV_FP4]
GRID = torch.tensor(e2m1.MAGNITUDES)


def nearest_index(v: float, rounding: Rounding) -> int:
    """Independent oracle: argmin distance over the grid (saturating), ties by the format's rule."""
    a = min(abs(v), 6.0)
    d = (GRID - a).abs()
    best = [k for k in range(8) if d[k] == d.min()]
    if len(best) == 1:
        return best[0]
    return max(best) if rounding is Rounding.TIES_UP else next(k for k in best if k % 2 == 0)


def unit_scale_rows(values: list[float], fmt) -> tuple[torch.Tensor, dict]:
    """One row per value, each block holding 6.0 first so the decode scale is exactly 1."""
    rows = torch.zeros(len(values), fmt.block)
    rows[:, 0] = 6.0
    rows[:, 1] = torch.tensor(values)
    kwargs = {"global_scale": 1.0} if fmt.has_global_scale else {}
    return rows, kwargs


def boundary_values() -> list[float]:
    out = []
    for b in e2m1.BOUNDS:
        t = torch.tensor(b, dtype=torch.float32)
        up = torch.nextafter(t, torch.tensor(math.inf)).item()
        down = torch.nextafter(t, torch.tensor(-math.inf)).item()
        out += [b, up, down, -b, -up, -down]
    return out + list(e2m1.MAGNITUDES[1:])


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_every_rounding_boundary_and_tie(fmt):
    values = boundary_values()
    x, kwargs = unit_scale_rows(values, fmt)
    q = quantize(x, fmt, **kwargs)
    assert torch.equal(decode_scales(q), torch.ones_like(decode_scales(q)))
    for i, v in enumerate(values):
        code = int(q.codes[i, 1])
        assert code & 7 == nearest_index(v, fmt.rounding), (fmt.name, v, code)
        assert (code >> 3) == (v < 0)


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        (NVFP4, [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]),
        (MXFP4, [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]),
        (KV_FP4, [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_ties_go_to_even_or_up(fmt, expected):
    x, kwargs = unit_scale_rows(list(e2m1.BOUNDS), fmt)
    out = dequantize(quantize(x, fmt, **kwargs))[:, 1]
    assert out.tolist() == expected


def test_nvfp4_element_saturates_when_the_e4m3_scale_rounds_down():
    # block amax 6.375 -> sf = 1.0625, an E4M3 tie that rounds to 1.0 -> z = 6.375 saturates to 6.
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.375, -6.2
    q = quantize(x, NVFP4, global_scale=1.0)
    assert decode_scales(q).item() == 1.0
    assert q.codes[0, :2].tolist() == [7, 15]


def test_nvfp4_e4m3_scale_saturates_at_448():
    x = torch.full((1, 16), 10.0)
    q = quantize(x, NVFP4, global_scale=2688.0)
    assert q.scales.view(torch.float8_e4m3fn).float().item() == 448.0
    assert torch.equal(q.codes, torch.full_like(q.codes, 7))
    assert torch.equal(dequantize(q), torch.full((1, 16), 6 * 448 / 2688.0))


def test_mxfp4_ocp_floor_rule_saturates_the_block_max():
    x = torch.zeros(1, 32)
    x[0, 0] = 7.9
    q = quantize(x, MXFP4_OCP)
    assert int(q.scales) == 127  # floor(log2 7.9) - 2 = 0
    assert int(q.codes[0, 0]) == 7
    assert int(quantize(x, MXFP4).scales) == 128  # ceil(log2(7.9 / 6)) = 1: no saturation


@given(st.floats(min_value=1e-30, max_value=1e30, allow_subnormal=False))
@settings(max_examples=300, deadline=None)
def test_e8m0_scale_rules(amax):
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    a = x[0, 0].item()
    e_ceil = int(quantize(x, MXFP4).scales) - 127
    v = torch.tensor(a, dtype=torch.float32) / 6  # the FP32 quotient the rule takes the log of
    assert 2.0**e_ceil >= v.item() > 2.0 ** (e_ceil - 1)
    e_floor = int(quantize(x, MXFP4_OCP).scales) - 127
    assert 2.0 ** (e_floor + 2) <= a < 2.0 ** (e_floor + 3)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_zero_blocks_decode_to_zero(fmt):
    x = torch.zeros(3, 2 * fmt.block)
    x[1, fmt.block :] = torch.linspace(-3, 3, fmt.block)  # second block of row 1 is non-zero
    q = quantize(x, fmt)
    assert torch.equal(q.codes[0], torch.zeros_like(q.codes[0]))
    assert torch.equal(dequantize(q)[0], torch.zeros(2 * fmt.block))
    assert torch.equal(dequantize(q)[1, : fmt.block], torch.zeros(fmt.block))
    expected_zero_scale = {"nvfp4": 0, "mxfp4": 0, "mxfp4_ocp": 0, "kv_fp4": 127 - 33}[fmt.name]
    assert int(q.scales[0, 0]) == expected_zero_scale


def test_all_zero_tensor_gets_unit_global_scale():
    q = quantize(torch.zeros(2, 16), NVFP4)
    assert q.global_scale.item() == 1.0
    q = quantize(torch.zeros(2, 16), NVFP4, per_token=True)
    assert torch.equal(q.global_scale, torch.ones(2, 1))


def test_e4m3_scale_underflow_decodes_to_zero():
    x = torch.zeros(2, 16)
    x[0, 0] = 6.0
    x[1, :2] = torch.tensor([1e-4, -5e-5])  # sf = 1.7e-5 < 2^-9, the smallest E4M3 subnormal
    q = quantize(x, NVFP4, global_scale=1.0)
    assert int(q.scales[1, 0]) == 0
    assert q.codes[1, :2].tolist() == [7, 15]  # encode factor FLT_MAX saturates, as the kernels do
    assert torch.equal(dequantize(q)[1], torch.zeros(16))


def test_e4m3_subnormal_scale_is_exact():
    x = torch.zeros(1, 16)
    x[0, :3] = torch.tensor([6 * 2.0**-8, 3 * 2.0**-8, -(2.0**-9)])
    q = quantize(x, NVFP4, global_scale=1.0)
    assert decode_scales(q).item() == 2.0**-8
    assert dequantize(q)[0, :3].tolist() == [6 * 2.0**-8, 3 * 2.0**-8, -(2.0**-9)]


@pytest.mark.parametrize("fmt", [NVFP4, MXFP4, MXFP4_OCP], ids=lambda f: f.name)
def test_negative_inputs_keep_the_sign_bit_like_the_hardware(fmt):
    x, kwargs = unit_scale_rows([-0.0, -0.1, 0.0, 0.1], fmt)
    codes = quantize(x, fmt, **kwargs).codes[:, 1].tolist()
    assert codes == [8, 8, 0, 0]


def test_kv_fp4_sign_follows_sglang():
    x, _ = unit_scale_rows([-0.0, -0.1, 0.0, 0.1], KV_FP4)
    assert quantize(x, KV_FP4).codes[:, 1].tolist() == [0, 8, 0, 0]


def test_per_tensor_per_token_and_static_global_scales():
    torch.manual_seed(0)
    x = torch.randn(4, 64) * torch.tensor([[1.0], [10.0], [0.01], [0.0]])
    per_tensor = quantize(x, NVFP4)
    assert per_tensor.global_scale.dim() == 0
    assert per_tensor.global_scale.item() == torch.tensor(2688.0) / x.abs().max()
    per_token = quantize(x, NVFP4, per_token=True)
    amax = x.abs().amax(-1, keepdim=True)
    s_enc = torch.full_like(amax, 2688.0) / amax  # IEEE division
    assert torch.equal(per_token.global_scale, torch.where(amax > 0, s_enc, torch.ones_like(amax)))
    for r in range(4):  # per-token rows are independent of each other
        alone = quantize(x[r : r + 1], NVFP4, per_token=True)
        assert torch.equal(alone.codes[0], per_token.codes[r]) and torch.equal(alone.scales[0], per_token.scales[r])
    static = quantize(x, NVFP4, global_scale=per_tensor.global_scale)
    assert torch.equal(static.codes, per_tensor.codes) and torch.equal(static.scales, per_tensor.scales)
    static_rows = quantize(x, NVFP4, global_scale=per_token.global_scale)
    assert torch.equal(static_rows.codes, per_token.codes)
    assert not torch.equal(per_token.codes, per_tensor.codes)


def test_global_scale_is_an_ieee_division():
    # amax = 7 * 2^-11: 2688 / amax = 786432 exactly; reciprocal-then-multiply would give 786432.0625.
    x = torch.zeros(1, 16)
    x[0, 0] = 7 * 2.0**-11
    assert quantize(x, NVFP4).global_scale.item() == 786432.0
    assert quantize(x, NVFP4, per_token=True).global_scale.item() == 786432.0


def test_global_scale_errors():
    x = torch.ones(2, 16)
    with pytest.raises(ValueError, match="not both"):
        quantize(x, NVFP4, global_scale=1.0, per_token=True)
    with pytest.raises(ValueError, match="global_scale shape"):
        quantize(x, NVFP4, global_scale=torch.ones(3, 1))
    with pytest.raises(ValueError, match="finite and positive"):
        quantize(x, NVFP4, global_scale=0.0)
    with pytest.raises(ValueError, match="E8M0 block scales only"):
        quantize(x, KV_FP4, per_token=True)


@pytest.mark.parametrize(
    "fmt, kwargs, message",
    [
        (NVFP4, {"global_scale": 1.0, "per_token": True}, "not both"),
        (NVFP4, {"global_scale": torch.ones(3, 1)}, r"global_scale shape \(3, 1\) must be scalar or \(2, 1\)"),
        (MXFP4, {"global_scale": 1.0}, "mxfp4 has E8M0 block scales only"),
        (KV_FP4, {"per_token": True}, "kv_fp4 has E8M0 block scales only"),
    ],
)
def test_reference_and_kernel_entry_points_refuse_the_same_scale_arguments(fmt, kwargs, message):
    """One scale-argument validator (`check_scale_args`) serves the reference quantizer and the kernel ops."""
    x = torch.ones(2, 32)
    with pytest.raises(ValueError, match=message):
        quantize(x, fmt, **kwargs)
    with pytest.raises(ValueError, match=message):
        kernel_rtn_fake_quant(x, fmt, **kwargs)
    with pytest.raises(ValueError, match=message):
        quantize_record(x, fmt, 4, out=torch.empty_like(x), **kwargs)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (torch.ones(2, 15), "multiple of the nvfp4 block size 16"),
        (torch.ones(2, 16, dtype=torch.int32), "dtype torch.int32 is not supported"),
        (torch.tensor([[float("nan")] + [0.0] * 15]), "NaN or Inf"),
        (torch.tensor([[float("inf")] + [0.0] * 15]), "NaN or Inf"),
        (torch.tensor(1.0), "multiple of the nvfp4 block size"),
    ],
)
def test_bad_input_is_named(x, match):
    with pytest.raises(ValueError, match=match):
        quantize(x, "nvfp4")


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@given(seed=st.integers(0, 2**31 - 1), log_scale=st.floats(-3, 3))
@settings(max_examples=20, deadline=None)
def test_codes_are_nearest_grid_points(fmt, dtype, seed, log_scale):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 2 * fmt.block, generator=gen) * 10**log_scale).to(dtype)
    kwargs = {"per_token": True} if fmt.has_global_scale else {}
    q = quantize(x, fmt, **kwargs)
    s = decode_scales(q).repeat_interleave(fmt.block, dim=-1)
    z = x.float() * torch.clamp(1.0 / s, max=torch.finfo(torch.float32).max)  # the contract's encode factor
    for v, code in zip(z.flatten().tolist(), q.codes.flatten().tolist(), strict=True):
        assert code & 7 == nearest_index(v, fmt.rounding)
    assert torch.equal(dequantize(q, dtype), dequantize(q).to(dtype))


def test_pack_layout_and_float4_round_trip():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert e2m1.pack_fp4(codes).tolist() == [[0x21, 0x0F]]
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (5, 32), dtype=torch.uint8)
    assert torch.equal(e2m1.unpack_fp4(e2m1.pack_fp4(codes)), codes)
    f4 = e2m1.to_float4_x2(codes)
    assert f4.dtype == torch.float4_e2m1fn_x2 and f4.shape == (5, 16)
    assert torch.equal(e2m1.from_float4_x2(f4), codes)
    with pytest.raises(ValueError, match="even last dimension"):
        e2m1.pack_fp4(codes[:, :3])
    with pytest.raises(ValueError, match="4-bit"):
        e2m1.pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_reference_is_identical_on_gpu(fmt):
    torch.manual_seed(0)
    x = torch.randn(64, 4 * fmt.block, dtype=torch.bfloat16) * 3
    kwargs = {"per_token": True} if fmt.has_global_scale else {}
    cpu, gpu = quantize(x, fmt, **kwargs), quantize(x.cuda(), get_format(fmt.name), **kwargs)
    assert torch.equal(cpu.codes, gpu.codes.cpu()) and torch.equal(cpu.scales, gpu.scales.cpu())
    assert torch.equal(dequantize(cpu), dequantize(gpu).cpu())
