"""Guided rounding: the paper's examples, Eq. 3, recovery of adjacent rollout codewords, ties, signs, STE."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.numerics import e2m1
from trace_core.numerics.formats import KV_FP4, MXFP4, MXFP4_OCP, NVFP4
from trace_core.numerics.guided import GuidanceStats, guided_quantize, guided_round, rtn_fake_quant
from trace_core.numerics.quant import Quantized, decode_scales, dequantize, quantize
from trace_core.records.spec import Record

ALL = [NVFP4, MXFP4, MXFP4_OCP, KV_FP4]
GRID = sorted({s * m for m in e2m1.MAGNITUDES for s in (1.0, -1.0)})


def unit_rollout(values: list[float], fmt=NVFP4, codes: list[int] | None = None) -> tuple[torch.Tensor, Quantized]:
    """Inputs `values` in one block (with 6.0 in slot 0 so the rollout decode scale is 1) and a rollout record
    holding `codes` for them (default: the RTN codes)."""
    x = torch.zeros(1, fmt.block)
    x[0, 0] = 6.0
    x[0, 1 : 1 + len(values)] = torch.tensor(values)
    roll = quantize(x, fmt, **({"global_scale": 1.0} if fmt.has_global_scale else {}))
    if codes is not None:
        c = roll.codes.clone()
        c[0, 1 : 1 + len(codes)] = torch.tensor(codes, dtype=torch.uint8)
        roll = Quantized(codes=c, scales=roll.scales, global_scale=roll.global_scale, fmt=fmt)
    assert decode_scales(roll).item() == 1.0
    return x, roll


def test_fig3_both_values_round_to_2():
    x, roll = unit_rollout([2.40, 2.49])
    assert dequantize(roll)[0, 1:3].tolist() == [2.0, 2.0]
    train, _ = unit_rollout([2.40])
    for bits in (1, 4):
        assert guided_round(train, Record.from_quantized(roll, bits), bits)[0, 1].item() == 2.0


def test_fig4_shared_scale_amplification_removed():
    # Shared decode scale 24 (block amax 144): 60.24 / 24 = 2.51 -> 3 but 59.76 / 24 = 2.49 -> 2.
    train = torch.zeros(1, 16)
    train[0, :2] = torch.tensor([144.0, 60.24])
    rollout = train.clone()
    rollout[0, 1] = 59.76
    roll_q = quantize(rollout, NVFP4, global_scale=1.0)
    assert decode_scales(roll_q).item() == 24.0
    rtn = rtn_fake_quant(train, NVFP4, global_scale=1.0)
    assert (rtn[0, 1] - dequantize(roll_q)[0, 1]).item() == 24.0
    for bits in (1, 2, 3, 4):
        assert guided_round(train, roll_q, bits)[0, 1].item() == dequantize(roll_q)[0, 1].item() == 48.0


def pairs(fmt, seed: int, noise: float, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    rollout = torch.randn(8, 4 * fmt.block, generator=gen) * 3
    train = (rollout + noise * torch.randn(rollout.shape, generator=gen)).to(dtype)
    kwargs = {"per_token": True} if fmt.has_global_scale else {}
    return train, quantize(rollout.to(dtype), fmt, **kwargs)


def scaled(train: torch.Tensor, roll: Quantized) -> torch.Tensor:
    s = decode_scales(roll).repeat_interleave(roll.fmt.block, dim=-1)
    return torch.clamp(train.float() * torch.clamp(1.0 / s, max=torch.finfo(torch.float32).max), -6, 6)


def bracket(z: float) -> tuple[float, float]:
    """Independent bracket: largest grid point <= z, smallest >= z."""
    return max(g for g in GRID if g <= z), min(g for g in GRID if g >= z)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@given(seed=st.integers(0, 2**31 - 1), noise=st.sampled_from([0.01, 0.1, 1.0]))
@settings(max_examples=25, deadline=None)
def test_eq3_full_information_never_worse_than_rtn(fmt, seed, noise):
    train, roll = pairs(fmt, seed, noise)
    guided, _ = guided_quantize(train, roll, 4)
    z = scaled(train, roll).flatten().tolist()
    q_star = e2m1.code_values(guided.codes).flatten().tolist()
    q_roll = e2m1.code_values(roll.codes).flatten().tolist()
    for zi, qs, qr in zip(z, q_star, q_roll, strict=True):
        lo, hi = bracket(zi)
        assert qs in (lo, hi)
        q_rtn = min((lo, hi), key=lambda q: abs(q - zi))
        assert abs(qs - qr) <= abs(q_rtn - qr)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@given(seed=st.integers(0, 2**31 - 1), noise=st.sampled_from([0.05, 0.3, 1.0]))
@settings(max_examples=15, deadline=None)
def test_rollout_codeword_adjacent_to_the_bracket_is_recovered(fmt, bits, seed, noise):
    train, roll = pairs(fmt, seed, noise)
    out = guided_round(train, Record.from_quantized(roll, bits), bits)
    z = scaled(train, roll).flatten().tolist()
    q_roll = dequantize(roll, train.dtype).flatten().tolist()
    values = e2m1.code_values(roll.codes).flatten().tolist()
    hits = 0
    for zi, qv, v, o in zip(z, values, q_roll, out.flatten().tolist(), strict=True):
        if qv in bracket(zi):
            hits += 1
            assert o == v
    assert hits > 0


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_guiding_with_its_own_record_is_rtn(fmt, bits):
    train, _ = pairs(fmt, 7, 0.0)
    kwargs = {"per_token": True} if fmt.has_global_scale else {}
    own = quantize(train, fmt, **kwargs)
    assert torch.equal(guided_round(train, own, bits), rtn_fake_quant(train, fmt, **kwargs))


@pytest.mark.parametrize(
    ("z", "bits", "rollout_code", "expected"),
    [
        (4.25, 1, 7, 6.0),  # c=1 matches the bracket end 6, although 3 is nearer to 4.25
        (4.5, 1, 7, 6.0),  # 3 and 6 equally near: the bracket end wins
        (2.2, 1, 5, 3.0),  # c=1 matches the bracket end 3, although 1.5 is nearer
        (2.2, 1, 3, 3.0),  # rollout 1.5 is outside the bracket: the matching bracket end 3 is taken
        (3.75, 2, 3, 4.0),  # b=2, c=3: 1.5 and 6 both outside and equally near -> RTN (4)
        (3.25, 2, 3, 3.0),  # same candidates, 1.5 nearer -> lower end 3 (RTN would also give 3)
        (3.8, 2, 7, 4.0),  # 6 nearer than 1.5 -> upper end
        (3.7, 2, 7, 3.0),  # 1.5 nearer than 6 -> lower end, against RTN (4)
        (3.7, 3, 3, 3.0),  # b=3 pins the magnitude 1.5 -> lower end, against RTN (4)
    ],
)
def test_reconstruction_and_ties(z, bits, rollout_code, expected):
    x, roll = unit_rollout([z], codes=[rollout_code])
    assert guided_round(x, Record.from_quantized(roll, bits), bits)[0, 1].item() == expected


@pytest.mark.parametrize(
    ("z", "bits", "rollout_code", "expected"),
    [
        (-0.2, 1, 9, -0.5),  # rollout -0.5: same sign, recovered
        (-0.2, 1, 8, 0.0),  # rollout -0 (a negative value that rounded to zero)
        (0.2, 4, 9, 0.0),  # full information: rollout -0.5 lies below the bracket [0, 0.5]
        (0.2, 1, 9, 0.5),  # b=1 keeps no sign: the reconstruction takes x's sign -> +0.5
        (-0.3, 4, 1, 0.0),  # rollout +0.5 above the bracket [-0.5, 0] -> 0
    ],
)
def test_signs_near_zero(z, bits, rollout_code, expected):
    x, roll = unit_rollout([z], codes=[rollout_code])
    assert guided_round(x, Record.from_quantized(roll, bits), bits)[0, 1].item() == expected


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_gradients_are_the_identity(fmt):
    train, roll = pairs(fmt, 3, 0.3, torch.float32)
    for fn in (lambda x: guided_round(x, roll, 1), lambda x: rtn_fake_quant(x, fmt)):
        x = train.clone().requires_grad_(True)
        g = torch.randn_like(x)
        fn(x).backward(g)
        assert torch.equal(x.grad, g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_output_keeps_dtype_and_shape(dtype):
    train, roll = pairs(NVFP4, 1, 0.1, dtype)
    train3d = train.view(2, 4, -1)
    roll3d = quantize(dequantize(roll, dtype).view(2, 4, -1), NVFP4, per_token=True)
    out = guided_round(train3d, Record.from_quantized(roll3d, 1), 1)
    assert out.dtype == dtype and out.shape == train3d.shape


def test_rows_without_record_use_counted_rtn():
    train, roll = pairs(NVFP4, 5, 0.5)
    has = torch.tensor([True, False] * 4)
    stats = GuidanceStats()
    out = guided_round(train, roll, 1, has_record=has, stats=stats)
    assert torch.equal(out[~has], rtn_fake_quant(train, NVFP4, per_token=True)[~has])
    assert torch.equal(out[has], guided_round(train, roll, 1, stats=GuidanceStats())[has])
    assert stats.rtn_fallback == 4 * train.shape[-1] and stats.guided == 4 * train.shape[-1]
    assert stats.redirected > 0


def test_bad_input_is_named():
    train, roll = pairs(NVFP4, 0, 0.1)
    record = Record.from_quantized(roll, 1)
    with pytest.raises(ValueError, match="bits must be an integer in 1..4"):
        guided_round(train, roll, 5)
    with pytest.raises(ValueError, match="bits must be an integer in 1..4"):
        guided_round(train, roll, 0)
    with pytest.raises(ValueError, match="does not match input shape"):
        guided_round(train[:4], roll, 1)
    with pytest.raises(ValueError, match="record keeps 1 code bits, cannot guide with 2"):
        guided_round(train, record, 2)
    with pytest.raises(ValueError, match="dtype torch.int64"):
        guided_round(train.long(), roll, 1)
    with pytest.raises(ValueError, match="NaN or Inf"):
        guided_round(train * float("nan"), roll, 1)
    with pytest.raises(ValueError, match="has_record must be bool"):
        guided_round(train, roll, 1, has_record=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="Quantized or a Record"):
        guided_round(train, roll.codes, 1)


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
def test_zero_rows(fmt):
    x = torch.zeros(0, 2 * fmt.block, dtype=torch.bfloat16)
    roll = quantize(x, fmt, **({"per_token": True} if fmt.has_global_scale else {}))
    out = guided_round(x, Record.from_quantized(roll, 1), 1, stats=GuidanceStats())
    assert out.shape == x.shape and out.dtype == x.dtype
