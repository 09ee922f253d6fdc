"""Kernel entry points on CPU (the custom ops dispatch to the reference there) and the Triton kernels themselves
under the Triton interpreter (`TRITON_INTERPRET=1`, small shapes, in a subprocess because the flag is read when
triton compiles a kernel's launcher)."""

import pytest
import torch

from tests import kernel_checks, kernel_interpret
from tests.interpret import Interpreted, interpret
from trace_core.kernels import (
    api,
    guided_fake_quant,
    kernel_rtn_fake_quant,
    launch,
    quantize_nvfp4_weight,
    quantize_record,
    record_buffers,
)
from trace_core.kernels.launch import ScaleMode
from trace_core.numerics import guided as ref_guided
from trace_core.numerics.e2m1 import pack_fp4
from trace_core.numerics.formats import get_format
from trace_core.numerics.guided import GuidanceStats
from trace_core.numerics.quant import quantize
from trace_core.numerics.recipe import DEFAULT_RECIPE, get_recipe
from trace_core.numerics.role_quant import fake_quant
from trace_core.records.spec import Record


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp4_ocp", "kv_fp4"])
def test_cpu_dispatch_writes_the_reference_record(fmt):
    for mode in kernel_checks.SCALE_MODES[fmt]:
        for bits in (1, 4):
            kernel_checks.check_quantize_record(fmt, 7, 64, torch.bfloat16, bits, mode, "cpu", _op_quantize)


def _op_quantize(x, fmt, bits, gs, per_token, out, low, scales, token):
    quantize_record(x, fmt, bits, global_scale=gs, per_token=per_token, out=out, low_bits=low, scales=scales,
                    token_scale=token if low is not None else None)  # fmt: skip


def test_guided_fake_quant_matches_guided_round_with_fallback_rows():
    x = kernel_checks.make_input(9, 64, torch.bfloat16, "cpu")
    roll = quantize(kernel_checks.make_input(9, 64, torch.bfloat16, "cpu", seed=3), "nvfp4", per_token=True)
    rec = Record.from_quantized(roll, 2)
    has = torch.tensor([True, False, True] * 3)
    ours, theirs = GuidanceStats(), GuidanceStats()
    out = guided_fake_quant(x, rec, 1, has_record=has, stats=ours)
    assert torch.equal(out, ref_guided.guided_round(x, rec, 1, has_record=has, stats=theirs))
    assert (ours.guided, ours.rtn_fallback, int(ours.redirected)) == (
        theirs.guided,
        theirs.rtn_fallback,
        theirs.redirected,
    )
    assert ours.rtn_fallback == 3 * 64


@pytest.mark.parametrize("bits", [1, 4])
def test_static_kv_role_through_the_cpu_ops(bits):
    kernel_checks.check_static_kv(7, 64, torch.bfloat16, bits, "cpu", _op_quantize, api._guided_op)


def test_rows_without_a_record_take_the_roles_rtn():
    """An NVFP4 K/V record of the static unit scale, as the store returns it (S_enc 1 on every row): with the role,
    rows without a record are `fake_quant(role, row)` on both paths, not rescaled per token as the record's per-row
    scale would otherwise read; a role of another format is refused."""
    role = get_recipe("nvfp4-w4a4-nvfp4kv").k
    x = kernel_checks.make_input(9, 64, torch.bfloat16, "cpu")
    roll = quantize(kernel_checks.make_input(9, 64, torch.bfloat16, "cpu", seed=3), "nvfp4", global_scale=1.0)
    rec = Record(roll.fmt, 4, 64, Record.from_quantized(roll, 4).low_bits, roll.scales, torch.ones(9, 1))
    has = torch.tensor([True, False, True] * 3)
    ours, theirs = GuidanceStats(), GuidanceStats()
    out = guided_fake_quant(x, rec, 2, has_record=has, stats=ours, role=role)
    assert torch.equal(out, ref_guided.guided_round(x, rec, 2, has_record=has, stats=theirs, role=role))
    assert torch.equal(out[~has], fake_quant(role, x)[~has])
    assert not torch.equal(out[~has], guided_fake_quant(x, rec, 2, has_record=has, stats=GuidanceStats())[~has])
    assert (int(ours.rtn_fallback), int(ours.redirected)) == (theirs.rtn_fallback, theirs.redirected)
    with pytest.raises(ValueError, match="role of format kv_fp4 given for a nvfp4 record"):
        guided_fake_quant(x, rec, 2, has_record=has, role=get_recipe(DEFAULT_RECIPE).k)


def test_straight_through_gradients():
    x = kernel_checks.make_input(4, 32, torch.float32, "cpu").requires_grad_(True)
    rec = Record.from_quantized(quantize(x.detach(), "kv_fp4"), 1)
    g = torch.randn_like(x)
    (guided_fake_quant(x, rec, 1, stats=GuidanceStats()) * g).sum().backward()
    assert torch.equal(x.grad, g)
    x.grad = None
    (kernel_rtn_fake_quant(x, "nvfp4", per_token=True) * g).sum().backward()
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp4_ocp", "kv_fp4"])
def test_kernel_rtn_fake_quant_gives_the_reference_values(fmt):
    # the op's wrapper against the one reference definition, every scale argument (nvfp4 without one: per tensor)
    x = kernel_checks.make_input(7, 64, torch.bfloat16, "cpu")
    for kwargs in ({}, {"per_token": True}, {"global_scale": 97.0}) if fmt == "nvfp4" else ({},):
        assert torch.equal(kernel_rtn_fake_quant(x, fmt, **kwargs), ref_guided.rtn_fake_quant(x, fmt, **kwargs))


def test_nvfp4_weight_export_matches_the_reference():
    w = kernel_checks.make_input(24, 96, torch.bfloat16, "cpu")
    packed, scales, gs = quantize_nvfp4_weight(w)
    q = quantize(w, "nvfp4")
    assert torch.equal(packed, pack_fp4(q.codes)) and torch.equal(scales, q.scales)
    assert torch.equal(gs, q.global_scale)


def test_bad_input_is_named():
    x = torch.randn(4, 32)
    low, scales, token = record_buffers(4, 32, "nvfp4", 1, "cpu", per_token=True)
    with pytest.raises(ValueError, match="2-D"):
        quantize_record(x.view(2, 2, 32), "nvfp4", 1, per_token=True, low_bits=low, scales=scales, token_scale=token)
    with pytest.raises(ValueError, match="multiple of the nvfp4 block 16"):
        quantize_record(x[:, :24], "nvfp4", 1, per_token=True, out=torch.empty(4, 24))
    with pytest.raises(ValueError, match="low_bits buffer must be torch.uint8 \\(4, 4\\)"):
        quantize_record(x, "nvfp4", 1, per_token=True, low_bits=low[:, :3], scales=scales, token_scale=token)
    with pytest.raises(ValueError, match="needs a token_scale buffer"):
        quantize_record(x, "nvfp4", 1, per_token=True, low_bits=low, scales=scales)
    with pytest.raises(ValueError, match="static global_scale"):
        quantize_record(x, "nvfp4", 1, out=torch.empty_like(x))
    with pytest.raises(ValueError, match="nothing to write"):
        quantize_record(x, "nvfp4", 1, per_token=True)
    with pytest.raises(ValueError, match="unit last stride"):
        quantize_record(x.t().contiguous().t(), "nvfp4", 1, per_token=True, out=torch.empty_like(x))
    rec = Record.from_quantized(quantize(x, "nvfp4", per_token=True), 1)
    with pytest.raises(ValueError, match="cannot guide with 2"):
        guided_fake_quant(x, rec, 2)
    with pytest.raises(ValueError, match="does not match input shape"):
        guided_fake_quant(x[:2], rec, 1)


@pytest.fixture(scope="module")
def interpreted() -> Interpreted:
    """Every case of `tests.kernel_interpret`, run once in one interpreter subprocess."""
    pytest.importorskip("triton")
    return interpret("tests.kernel_interpret")


@pytest.mark.slow
@pytest.mark.parametrize("case", list(kernel_interpret.cases()))
def test_triton_kernel_under_the_interpreter(interpreted, case):
    interpreted.check(case)


def test_launch_shape_respects_blocks():
    for fmt in ("nvfp4", "mxfp4"):
        rb, chunk, _ = launch.launch_shape(get_format(fmt), 16 if fmt == "nvfp4" else 32)
        assert chunk % get_format(fmt).block == 0 and chunk % 8 == 0 and rb >= 1


def test_quantize_tile_gives_each_thread_whole_blocks_at_the_target_widths():
    # launch.launch_shape: warps scale with the chunk (4096 columns on 8 warps), one 16-element block per thread
    kv, nv = get_format("kv_fp4"), get_format("nvfp4")
    for d, tile in {2048: (1, 2048, 4), 4096: (1, 4096, 8), 7168: (1, 4096, 8)}.items():
        assert launch.launch_shape(kv, d) == tile and launch.launch_shape(nv, d, per_token=True) == tile, d
        assert launch.record_first(*tile), d
    assert launch.launch_shape(kv, 64) == (1, 64, 1)  # at least one warp
    with launch.launch_overrides({"row_chunk": 8192}):  # a per-token row of 8192 columns in one chunk: 16 warps
        assert launch.launch_shape(nv, 7168, per_token=True) == (1, 8192, 16)
        assert launch.launch_shape(kv, 7168) == (1, 4096, 8)
    assert launch.launch_shape(kv, 2048, "guided") == (2, 1024, 4)  # the guided tile is not scaled


def test_rows_are_taken_as_whole_chunks_only_for_block_scales_and_contiguous_tensors():
    # SCALE_NONE: every scale is its block's own (kv_fp4, mxfp4, mxfp4_ocp); nvfp4's scales depend on the row or tensor
    x = torch.zeros(4, 7168)
    low, scales, token = record_buffers(4, 7168, "kv_fp4", 1, "cpu")
    bufs = [x, None, low, scales]
    assert launch.whole_chunk_rows(4, 7168, 4096, ScaleMode.NONE, bufs) == 7  # 4 rows of 7168 = 7 of 4096
    for mode in (ScaleMode.SCALAR, ScaleMode.ROW, ScaleMode.PER_TOKEN):
        assert launch.whole_chunk_rows(4, 7168, 4096, mode, bufs + [token]) == 0, mode
    assert launch.whole_chunk_rows(3, 7168, 4096, ScaleMode.NONE, bufs) == 0  # 3 x 7168: not whole chunks
    assert launch.whole_chunk_rows(4, 8192, 4096, ScaleMode.NONE, bufs) == 0  # no masked threads to save
    # without a record only where the last chunk is at most half used: 5120 and 6144, not 7168
    assert launch.whole_chunk_rows(4, 7168, 4096, ScaleMode.NONE, bufs, record=False) == 0
    assert launch.whole_chunk_rows(4, 5120, 4096, ScaleMode.NONE, [torch.zeros(4, 5120)], record=False) == 5
    assert launch.whole_chunk_rows(2, 6144, 4096, ScaleMode.NONE, [torch.zeros(2, 6144)], record=False) == 3
    wide = torch.zeros(4, low.shape[1] + 2, dtype=torch.uint8)[:, 1:-1]
    assert launch.whole_chunk_rows(4, 7168, 4096, ScaleMode.NONE, [x, None, wide, scales]) == 0  # strided record


def test_record_unit_takes_the_widest_word_the_buffer_allows():
    low, _, _ = record_buffers(4, 256, "kv_fp4", 1, "cpu")
    assert launch.record_unit(low, 1) == 2  # b = 1: a block's 2 record bytes as one 2-byte word
    low2, _, _ = record_buffers(4, 256, "kv_fp4", 2, "cpu")
    assert launch.record_unit(low2, 2) == 4  # b = 2: one 4-byte word
    low4, _, _ = record_buffers(4, 256, "kv_fp4", 4, "cpu")
    assert launch.record_unit(low4, 4) == 4  # b = 4: two 4-byte words
    low3, _, _ = record_buffers(4, 256, "kv_fp4", 3, "cpu")
    assert launch.record_unit(low3, 3) == 1  # b = 3: byte by byte
    odd = torch.zeros(4, low.shape[1] + 1, dtype=torch.uint8)[:, 1:]
    assert launch.record_unit(odd, 1) == 1  # a staging-row view at an odd address


def test_launch_override_refuses_unknown_keys_by_name():
    # blocks_per_thread was an opt-in kernel, removed after it timed ~2x slower on the H200, and wide_record the
    # opt-in 16-byte record stores, removed as no faster: the keys are refused
    with pytest.raises(ValueError, match=r"unknown keys \['blocks_per_thread'\]"):
        launch.apply_launch_override('{"quant": {"blocks_per_thread": 8}}')
    with pytest.raises(ValueError, match=r"unknown keys \['wide_record'\]"):
        launch.apply_launch_override('{"quant": {"wide_record": 1}}')
    with pytest.raises(ValueError, match="non-positive"):
        launch.apply_launch_override('{"guided": {"row_loop": 0}}')
    assert "blocks_per_thread" not in launch.LAUNCH["quant"]
    saved = {kernel: dict(tile) for kernel, tile in launch.LAUNCH.items()}
    with (
        pytest.raises(ValueError, match=r"unknown keys \['blocks_per_thread'\]"),
        launch.launch_overrides({"blocks_per_thread": 8}),
    ):
        pass
    with pytest.raises(ValueError, match="non-positive"), launch.launch_overrides(guided={"row_loop": 0}):
        pass
    with pytest.raises(ValueError, match=r"\{'group_ahead': 4\} above the largest allowed \{'group_ahead': 3\}"):
        launch.apply_launch_override('{"quant": {"group_ahead": 4}}')
    with launch.launch_overrides({"chunk": 2048}, {"warps": 8}):
        assert launch.LAUNCH["quant"]["chunk"] == 2048 and launch.LAUNCH["guided"]["warps"] == 8
    assert launch.LAUNCH == saved  # restored


@pytest.mark.slow
def test_output_stores_follow_the_record_back_to_back_in_the_sm90_sass():
    # RECORD_FIRST (launch.record_first): a thread's two 16-byte output stores fill the halves of the same sectors, and
    # the L1 merges them only when they issue back to back (docs/performance.md, "the record before the output").
    # Compiled for sm_90 on the CPU with the ptxas triton ships.
    # On every width of the targets, with the tile `launch` picks there (launch.launch_shape gives each thread whole
    # blocks: 2048 columns on 4 warps, 4096 on 8; 7168 in two chunks of 4096 on 8).
    from tests import sm90
    from trace_core.kernels import triton_fp4

    for d in (2048, 4096, 7168):
        for fmt, mode in (("kv_fp4", ScaleMode.NONE), ("nvfp4", ScaleMode.PER_TOKEN)):
            f = get_format(fmt)
            rb, chunk, warps = launch.launch_shape(f, d, per_token=mode == ScaleMode.PER_TOKEN)
            first = launch.record_first(rb, chunk, warps)
            assert first and launch.block_per_thread(f, True, first), (d, fmt)  # _quantize_record16_kernel
            one_pass = -(-d // chunk) == 1
            args = {"RB": rb, "C": chunk, "ONE_PASS": one_pass, "num_warps": warps, "FMT": f.kernel_id,
                    "SCALE_MODE": mode, "BITS": 1, "WRITE_OUT": True, "REC_UNIT": 2, "RECORD_FIRST": first,
                    "ROW_LOOP": launch.LAUNCH["quant"]["row_loop"], "PREFETCH": False}  # fmt: skip
            if regs := launch.record_regs(True, mode, 1 if one_pass else 2, False):
                args["maxnreg"] = regs  # as `launch` caps the per-token record kernel
            compiled = sm90.compile_kernel(triton_fp4._quantize_record16_kernel, args)
            stores = [s.split("@") for s in sm90.ptxas_info(compiled.asm["ptx"])["stg_at"].split()]
            (w1, p1), (w2, p2) = stores[-2:]
            assert (w1, w2) == ("128", "128") and int(p2) == int(p1) + 1, f"{d} {fmt}: output stores at {stores}"
            assert {w for w, _ in stores[:-2]} >= {"U8", "U16"}, f"{d} {fmt}: the record's stores first: {stores}"


@pytest.mark.slow
def test_mxfp4_output_stores_follow_the_record_in_the_sm90_sass():
    # the half-block-per-thread kernel of mxfp4 and mxfp4_ocp on the tiles `launch` picks at the target widths (7168:
    # rows of whole 4096-column chunks): the record's stores (scale byte, 2-byte code word for b = 1) come first, then
    # the thread's two 16-byte output stores with nothing but the exit of the masked lanes between them
    from tests import sm90
    from trace_core.kernels import triton_fp4

    mx = get_format("mxfp4")
    for d in (2048, 4096):
        rb, chunk, warps = launch.launch_shape(mx, d)
        args = {"RB": rb, "C": chunk, "num_warps": warps, "FMT": mx.kernel_id, "BITS": 1, "WRITE_OUT": True,
                "REC_UNIT": 2, "RECORD_FIRST": launch.record_first(rb, chunk, warps)}  # fmt: skip
        assert args["RECORD_FIRST"], d
        compiled = sm90.compile_kernel(triton_fp4._quantize_record32_halves_kernel, args)
        stores = [s.split("@") for s in sm90.ptxas_info(compiled.asm["ptx"])["stg_at"].split()]
        assert [w for w, _ in stores] == ["U8", "U16", "128", "128"], f"{d}: {stores}"
        assert int(stores[3][1]) - int(stores[2][1]) <= 2, f"{d}: output stores apart: {stores}"
