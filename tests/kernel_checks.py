"""Bit-exact checks of the FP4 kernels against the `trace_core` reference, shared by the GPU tests and the
Triton-interpreter test on CPU. `quantize_fn` / `guided_fn` take the same arguments as
`launch.triton_quantize_record` / `launch.triton_guided`, so either the custom ops or the raw launchers can be
checked."""

from __future__ import annotations

import torch

from trace_core.kernels import api
from trace_core.metrics import low_bit_flips
from trace_core.numerics.formats import NVFP4, FP4Format, get_format
from trace_core.numerics.guided import fallback_scale, guided_quantize, guided_round
from trace_core.numerics.quant import dequantize, quantize
from trace_core.numerics.recipe import Role, Scale
from trace_core.numerics.role_quant import fake_quant
from trace_core.records.spec import Record, pack_low_bits

SCALE_MODES = {"nvfp4": ("per_token", "scalar", "row"), "mxfp4": ("none",), "mxfp4_ocp": ("none",), "kv_fp4": ("none",)}


def make_input(t: int, d: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    """Rows spanning many decades, with a zero block, -0.0, exact boundaries and outliers, and (row 3) every E2M1
    tie, on both sides, and its neighbours one step of 8 significant bits away, in blocks whose power-of-two scale
    is 1 (amax 6), so that they reach the rounding as ties under every format but nvfp4."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=gen) * torch.logspace(-3, 3, max(t, 1))[:t, None]
    if t > 2 and d >= 32:
        x[0, :16] = 0.0
        x[1, 3] = -0.0
        x[2, :8] = torch.tensor([6.0, 0.25, 0.75, 2.5, 5.0, -1.25, -3.5, 60.0])
    if t > 3 and d >= 32:
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        x[3, :16] = torch.cat([torch.tensor([6.0]), ties, -ties, torch.tensor([2.0])])
        x[3, 16:32] = torch.cat([torch.tensor([-6.0]), ties * (1 - 2**-8), -ties * (1 + 2**-7), torch.tensor([0.5])])
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype).to(device)


def scale_kwargs(mode: str, x: torch.Tensor) -> dict:
    if mode == "per_token":
        return {"per_token": True}
    if mode == "scalar":  # static per-layer scale calibrated on a tenth of the amax: blocks saturate
        amax = x.float().abs().amax() if x.numel() else torch.ones((), device=x.device)
        return {"global_scale": torch.tensor(2688.0, device=x.device) / (0.1 * amax + 1e-30)}
    if mode == "row":
        return {"global_scale": torch.full((x.shape[0], 1), 97.0, device=x.device)}
    return {}


def _strided_record_buffers(t, d, fmt, bits, device, per_token):
    """Record buffers as views into wider rows, like a staging buffer that holds several sites per token."""
    low, scales, token = api.record_buffers(t, d, fmt, bits, device, per_token=per_token)
    wide = [torch.zeros(t, b.shape[1] + 3, dtype=b.dtype, device=device)[:, 1 : 1 + b.shape[1]] for b in (low, scales)]
    if token is not None:
        token = torch.zeros(t, 3, dtype=torch.float32, device=device)[:, 1:2]
    return wide[0], wide[1], token


def check_quantize_record(fmt: FP4Format | str, t: int, d: int, dtype, bits: int, mode: str, device: str, quantize_fn):
    """quantize-and-record (and the no-record variant) equal the reference bit for bit."""
    fmt = get_format(fmt)
    x = make_input(t, d, dtype, device)
    kwargs = scale_kwargs(mode, x)
    q = quantize(x, fmt, **kwargs)
    per_token = mode == "per_token"
    gs = kwargs.get("global_scale")
    # the record alone, into views at odd addresses (byte-wise stores)
    low, scales, token = _strided_record_buffers(t, d, fmt, bits, device, per_token)
    quantize_fn(x, fmt, bits, gs, per_token, None, low, scales, token)
    assert torch.equal(low, pack_low_bits(q.codes, bits)), f"{fmt.name} {dtype} {mode} b={bits}: record bits differ"
    assert torch.equal(scales, q.scales), f"{fmt.name} {dtype} {mode}: scale bytes differ"
    if per_token:
        assert torch.equal(token, q.global_scale), f"{fmt.name} {dtype}: token scales differ"
    plain = torch.full_like(x, float("nan"))
    quantize_fn(x, fmt, 0, gs, per_token, plain, None, None, None)
    assert torch.equal(plain, dequantize(q, dtype)), f"{fmt.name} {dtype} {mode}: no-record output differs"
    # output and record into aligned buffers: the 16-element kernels store a block's record bytes in 2- or 4-byte
    # words there (`launch.record_unit`)
    out = torch.full_like(x, float("nan"))
    low, scales, token = api.record_buffers(t, d, fmt, bits, device, per_token=per_token)
    quantize_fn(x, fmt, bits, gs, per_token, out, low, scales, token)
    assert torch.equal(out, plain), f"{fmt.name} {dtype} {mode} b={bits}: output differs"
    assert torch.equal(low, pack_low_bits(q.codes, bits)), f"{fmt.name} {dtype} {mode} b={bits}: aligned record differs"
    assert torch.equal(scales, q.scales), f"{fmt.name} {dtype} {mode}: aligned-buffer scale bytes differ"
    if per_token:
        assert torch.equal(token, q.global_scale), f"{fmt.name} {dtype}: aligned-buffer token scales differ"


def check_guided(
    fmt: FP4Format | str, t: int, d: int, dtype, record_bits: int, bits: int, mode: str, device, guided_fn
):
    """Guided fake-quant from a record equals `guided_quantize` + `dequantize`, redirected and flip counts included
    (a flip: a guided code whose low `record_bits` bits differ from the record's)."""
    fmt = get_format(fmt)
    rollout = make_input(t, d, dtype, device, seed=1)
    q = quantize(rollout, fmt, **scale_kwargs(mode, rollout))
    rec = Record.from_quantized(q, record_bits)
    gen = torch.Generator().manual_seed(2)
    noise = torch.randn(t, d, generator=gen).to(device) * rollout.float().abs().amax(-1, keepdim=True) * 0.02
    noise[3:4] = 0.0  # make_input's row of ties stays on the grid and at its ties
    train = (rollout.float() + noise).to(dtype)
    gs = rec.global_scale.float().contiguous() if rec.global_scale is not None else None
    has = torch.arange(t, device=device) % 3 != 1
    # the record as a view at an odd address too (a staging row holding several sites): byte-wise loads
    odd = torch.zeros(t, rec.low_bits.shape[1] + 1, dtype=torch.uint8, device=device)[:, 1:]
    odd.copy_(rec.low_bits)
    for mask, low in ((None, rec.low_bits), (has, rec.low_bits), (None, odd)):
        redirected = torch.full((), 5, dtype=torch.int64, device=device)  # the op adds into the counters
        flipped = torch.full((), 7, dtype=torch.int64, device=device)
        out = guided_fn(train, fmt.name, bits, record_bits, low, rec.scales, gs, mask, redirected, flipped)
        ref_q, ref_redirected = guided_quantize(train, rec, bits)
        ref_flipped = low_bit_flips(ref_q.codes, rec.code_bits(), record_bits)
        if mask is not None:
            ref_redirected &= mask.unsqueeze(-1)
            ref_flipped &= mask.unsqueeze(-1)
        assert torch.equal(out, dequantize(ref_q, dtype)), f"{fmt.name} {dtype} {mode} b={bits}/{record_bits}: differs"
        assert int(redirected) == 5 + int(ref_redirected.sum()), f"{fmt.name} b={bits}: redirected count differs"
        assert int(flipped) == 7 + int(ref_flipped.sum()), f"{fmt.name} b={bits}/{record_bits}: flip count differs"


def check_static_kv(t: int, d: int, dtype, bits: int, device: str, quantize_fn, guided_fn) -> None:
    """NVFP4 K/V under the static unit S_enc (`Scale.STATIC`) through the kernels as the rollout and trainer run
    them: the record (kernel at S_enc = 1) holds the reference's codes and scale bytes; the trainer's guided values
    from it (S_enc 1 per row, as the store holds it) are `guided_round`'s, and rows without a record take the
    role's RTN exactly (`fallback_scale`, as `api.guided_fake_quant` composes them): `fake_quant(role, row)`."""
    role = Role(NVFP4, Scale.STATIC, recorded=True)
    rollout = make_input(t, d, dtype, device, seed=1)
    q = quantize(rollout.cpu(), NVFP4, global_scale=1.0)
    low, scales, _ = api.record_buffers(t, d, NVFP4, bits, device)
    static = fallback_scale(q, role)["global_scale"].to(device)
    quantize_fn(rollout, NVFP4, bits, static, False, None, low, scales, None)
    assert torch.equal(low.cpu(), pack_low_bits(q.codes, bits)) and torch.equal(scales.cpu(), q.scales), f"b={bits}"
    rec = Record(NVFP4, bits, d, low, scales, torch.ones(t, 1, device=device))
    gen = torch.Generator().manual_seed(2)
    noise = torch.randn(t, d, generator=gen).to(device) * rollout.float().abs().amax(-1, keepdim=True) * 0.02
    train = (rollout.float() + noise).to(dtype)
    has = torch.arange(t, device=device) % 3 != 1
    redirected = torch.zeros((), dtype=torch.int64, device=device)
    flipped = torch.zeros((), dtype=torch.int64, device=device)
    guided = guided_fn(train, NVFP4.name, bits, bits, low, scales, rec.global_scale, has, redirected, flipped)
    fallback = fallback_scale(rec, role)
    rtn = torch.full_like(train, float("nan"))
    quantize_fn(train, NVFP4, 0, fallback.get("global_scale"), fallback.get("per_token", False), rtn, None, None, None)
    out = torch.where(has[:, None], guided, rtn).cpu()
    cpu = Record(NVFP4, bits, d, low.cpu(), scales.cpu(), rec.global_scale.cpu())
    want = guided_round(train.cpu(), cpu, bits, has_record=has.cpu(), role=role)
    assert torch.equal(out, want), f"b={bits}: guided values differ"
    rows = ~has.cpu()
    assert torch.equal(out[rows], fake_quant(role, train.cpu())[rows]), f"b={bits}: rows without a record differ"
    assert not torch.equal(want[rows], fake_quant(Role(NVFP4, Scale.PER_TOKEN), train.cpu())[rows])  # not per token
