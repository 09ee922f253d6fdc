"""Record packing, record specs and the paper's record-size numbers."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.numerics.e2m1 import pack_fp4, unpack_fp4
from trace_core.numerics.formats import KV_FP4, NVFP4
from trace_core.numerics.quant import quantize
from trace_core.records.spec import (
    ModelShape,
    Record,
    RecordSpec,
    bytes_per_token,
    pack_low_bits,
    pack_low_bits_of_fp4,
    site_bytes,
    unpack_low_bits,
)


@given(
    bits=st.integers(1, 4), lead=st.lists(st.integers(0, 3), max_size=2), m=st.integers(1, 40), seed=st.integers(0, 999)
)
@settings(max_examples=200, deadline=None)
def test_low_bits_of_packed_fp4_equal_unpacking_then_packing(bits, lead, m, seed):
    """The writer's word-level path (b = 1, 2 on widths of 4 bytes) and its fallbacks give, bit for bit, the low bits
    of the unpacked codes: every byte value, odd widths, empty and strided inputs."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (*lead, 2 * m), generator=gen, dtype=torch.uint8)[..., ::2]  # a strided view
    assert torch.equal(pack_low_bits_of_fp4(packed, bits), pack_low_bits(unpack_fp4(packed), bits))


def test_low_bits_of_packed_fp4_cover_every_byte():
    every = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    for bits in (1, 2, 3, 4):
        assert torch.equal(pack_low_bits_of_fp4(every, bits), pack_low_bits(unpack_fp4(every), bits))


@given(bits=st.integers(1, 4), rows=st.integers(0, 3), n=st.integers(1, 70), seed=st.integers(0, 1000))
@settings(max_examples=100, deadline=None)
def test_low_bits_round_trip_is_dense(bits, rows, n, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, n), generator=gen, dtype=torch.uint8)
    packed = pack_low_bits(codes, bits)
    assert packed.shape == (rows, (n * bits + 7) // 8)
    assert torch.equal(unpack_low_bits(packed, bits, n), codes & ((1 << bits) - 1))


def test_bit_order_is_lsb_first_and_b4_is_the_nibble_packing():
    codes = torch.tensor([[1, 0, 1, 1, 0, 0, 0, 1]], dtype=torch.uint8)
    assert pack_low_bits(codes, 1).tolist() == [[0b10001101]]
    codes = torch.randint(0, 16, (3, 32), dtype=torch.uint8)
    assert torch.equal(pack_low_bits(codes, 4), pack_fp4(codes))


def test_unpack_rejects_a_record_of_the_wrong_length():
    with pytest.raises(ValueError, match="does not hold 64 elements at 1 bits"):
        unpack_low_bits(torch.zeros(2, 7, dtype=torch.uint8), 1, 64)
    with pytest.raises(ValueError, match="bits must be an integer in 1..4"):
        pack_low_bits(torch.zeros(2, 8, dtype=torch.uint8), 5)


@pytest.mark.parametrize("fmt", [NVFP4, KV_FP4], ids=lambda f: f.name)
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_record_from_quantized_keeps_low_bits_and_scales(fmt, bits):
    x = torch.randn(5, 64)
    q = quantize(x, fmt, **({"per_token": True} if fmt.has_global_scale else {}))
    rec = Record.from_quantized(q, bits)
    assert rec.shape == x.shape and rec.low_bits.shape == (5, 8 * bits)
    assert torch.equal(rec.code_bits(), q.codes & ((1 << bits) - 1))
    assert rec.scales is q.scales and rec.global_scale is q.global_scale


def test_record_validates_its_parts():
    q = quantize(torch.randn(4, 32), NVFP4, per_token=True)
    rec = Record.from_quantized(q, 1)
    with pytest.raises(ValueError, match="low_bits shape"):
        Record(NVFP4, 1, 32, rec.low_bits[:, :2], rec.scales, rec.global_scale)
    with pytest.raises(ValueError, match="scales must be uint8"):
        Record(NVFP4, 1, 32, rec.low_bits, rec.scales.float(), rec.global_scale)
    with pytest.raises(ValueError, match="global_scale presence"):
        Record(NVFP4, 1, 32, rec.low_bits, rec.scales, None)
    with pytest.raises(ValueError, match="not a multiple of the kv_fp4 block"):
        Record(KV_FP4, 1, 24, rec.low_bits, rec.scales, None)


def test_default_spec_is_b1_at_every_layer_and_the_papers_is_the_latter_half():
    moe, attn = tuple(range(40)), (3, 7, 11, 15, 19, 23, 27, 31, 35, 39)
    spec = RecordSpec.default(moe_layers=moe, attn_layers=attn)
    assert (spec.bits, spec.moe_layers, spec.attn_layers) == (1, moe, attn)
    assert spec.sites()[:2] == [(0, "moe_in"), (1, "moe_in")] and spec.sites()[-1] == (39, "v")
    paper = RecordSpec.latter_half(moe_layers=moe, attn_layers=attn)
    assert paper.bits == 1
    assert paper.moe_layers == tuple(range(20, 40))
    assert paper.attn_layers == (23, 27, 31, 35, 39)
    assert paper.sites()[:2] == [(20, "moe_in"), (21, "moe_in")] and paper.sites()[-1] == (39, "v")
    with pytest.raises(ValueError, match="distinct non-negative"):
        RecordSpec(moe_layers=(1, 1))
    with pytest.raises(ValueError, match="unknown precision recipe 'fp5'"):
        RecordSpec(recipe="fp5")
    with pytest.raises(TypeError, match="kv_format"):  # the layout follows from the recipe, never given
        RecordSpec(kv_format="kv_fp4")


QWEN35_35B = ModelShape(hidden=2048, num_kv_heads=2, head_dim=256)
MOE_LAYERS = tuple(range(40))
ATTN_LAYERS = tuple(range(3, 40, 4))  # 10 full-attention layers


TOKEN_SCALE = 4  # bytes: the FP32 token scale of a per-token nvfp4 MoE-input record (the paper's scales are static)


def test_paper_full_information_sizes():
    # Paper §3.2: 4.5 bits per value -> ~45 KB activations + 5.6 KB KV per token (static scales).
    full = bytes_per_token(QWEN35_35B, RecordSpec(4, MOE_LAYERS, ATTN_LAYERS))
    assert full.moe_in - 40 * TOKEN_SCALE == 40 * 2048 * 4.5 / 8 == 45 * 1024
    assert full.kv == 10 * 2 * 2 * 256 * 4.5 / 8 == 5.625 * 1024
    # The per-token FP32 scale adds 4 bytes per MoE site.
    assert full.moe_in == 45 * 1024 + 40 * 4
    assert full.per_site[(0, "moe_in")] == site_bytes(2048, 4, 16, token_scale=True) == 2048 * 4.5 / 8 + 4


def test_paper_mantissa_only_size():
    # Paper §4.2: b = 1 on the latter 20 MoE layers = 2048 * 20 * 1.5 bits = 7.5 KB per token.
    spec = RecordSpec(1, tuple(range(20, 40)), ())
    assert spec.per_token_scale
    assert bytes_per_token(QWEN35_35B, spec).total - 20 * TOKEN_SCALE == 7.5 * 1024


def test_record_bytes_are_the_capture_rows_fields_nvfp4_kv_with_its_static_scale():
    """`bytes_per_token` is what a captured token row holds of its sites: an NVFP4 K/V record carries its static
    S_enc = 1 as a 4-byte global scale per row (`nvfp4-w4a4-nvfp4kv`), kv_fp4 none."""
    from trace_core.records.capture import record_row_layout

    shape = ModelShape(hidden=64, num_kv_heads=2, head_dim=16)
    kv = {}
    for recipe in ("nvfp4-w4a4-kv4", "nvfp4-w4a4-nvfp4kv"):
        spec = RecordSpec.default((0, 1), (0, 1), bits=1, recipe=recipe)
        _, row = record_row_layout(spec, shape)
        stored = sum(size for (owner, _), (_, size) in row.fields.items() if owner != "meta")
        assert stored == bytes_per_token(shape, spec).total, recipe
        kv[recipe] = bytes_per_token(shape, spec).kv
    assert kv["nvfp4-w4a4-nvfp4kv"] == kv["nvfp4-w4a4-kv4"] + 4 * 4  # K and V of two layers
