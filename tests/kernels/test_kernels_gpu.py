"""The Triton kernels on the GPU, bit for bit (`atol=0`) against the reference, through the public custom ops."""

import pytest
import torch

from tests import kernel_checks
from tests.kernel_tiles import SWEPT_TILES
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
from trace_core.numerics.e2m1 import pack_fp4
from trace_core.numerics.formats import get_format
from trace_core.numerics.guided import GuidanceStats, guided_round, rtn_fake_quant
from trace_core.numerics.quant import dequantize, quantize
from trace_core.numerics.recipe import DEFAULT_RECIPE, get_recipe
from trace_core.numerics.role_quant import fake_quant, kv_pool_bytes
from trace_core.records.spec import Record

pytestmark = pytest.mark.gpu
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(0, 64), (1, 64), (37, 544), (130, 7168)]  # T = 0 and 1; D not a multiple of the 512-column chunk


def _via_op(x, fmt, bits, gs, per_token, out, low, scales, token):
    quantize_record(x, fmt, bits, global_scale=gs, per_token=per_token, out=out, low_bits=low, scales=scales,
                    token_scale=token if low is not None else None)  # fmt: skip


def _guided_via_op(x, fmt, bits, record_bits, low, scales, gs, has, redirected, flipped):
    return api._guided_op(x, fmt, bits, record_bits, low, scales, gs, has, redirected, flipped)


@pytest.mark.parametrize("fmt", list(kernel_checks.SCALE_MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_record_is_bit_exact(fmt, dtype, shape):
    for mode in kernel_checks.SCALE_MODES[fmt]:
        for bits in (1, 2, 3, 4) if dtype == torch.bfloat16 else (1, 4):  # every bit width on the engines' dtype
            kernel_checks.check_quantize_record(fmt, *shape, dtype, bits, mode, "cuda", _via_op)


def _swept_tiles() -> list:
    """Parameters (D, LAUNCH["quant"] overrides) of every tile bench/record_tiles.py times (`SWEPT_TILES`)."""
    return [pytest.param(d, tile, id=f"{d}-" + ("-".join(f"{k}{n}" for k, n in tile.items()) or "default"))
            for d, tiles in SWEPT_TILES.items() for tile in tiles]  # fmt: skip


@pytest.mark.parametrize("fmt", ["nvfp4", "kv_fp4"])
@pytest.mark.parametrize(("d", "tile"), _swept_tiles())
def test_quantize_record_on_every_swept_tile(fmt, d, tile):
    # each quantize tile that bench/record_tiles.py times at this width (SWEPT_TILES: LAUNCH["quant"] overrides), on a
    # row count that leaves the last row tile partly past the end
    with launch.launch_overrides(tile):
        for mode in ("per_token", "row") if fmt == "nvfp4" else ("none",):
            for bits in (1, 4):
                kernel_checks.check_quantize_record(fmt, 37, d, torch.bfloat16, bits, mode, "cuda", _via_op)


@pytest.mark.parametrize("fmt", ["kv_fp4", "mxfp4", "mxfp4_ocp"])
def test_rows_taken_as_whole_chunks_are_bit_exact(fmt):
    # row counts whose t * d elements fill whole chunks: a record of the E8M0 formats into aligned buffers takes its
    # rows as rows of one chunk (launch.whole_chunk_rows: 64 x 7168 as 112 rows of 4096 columns, 32 x 544 as 17 of
    # 1024, 8 x 5120 as 10 of 4096); the calls into strided buffers take them as they are, and so do the calls
    # without a record except at 5120 (the last chunk a quarter used)
    for t, d in ((64, 7168), (32, 544), (8, 5120)):
        for bits in (1, 2, 3, 4):
            kernel_checks.check_quantize_record(fmt, t, d, torch.bfloat16, bits, "none", "cuda", _via_op)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_token_rows_wider_than_one_tile(dtype):
    # D > LAUNCH["quant"]["row_chunk"]: a first pass over the row for its amax, then the chunks (the last partly masked)
    d = launch.LAUNCH["quant"]["row_chunk"] + 16
    for bits in (1, 4):
        kernel_checks.check_quantize_record("nvfp4", 5, d, dtype, bits, "per_token", "cuda", _via_op)


@pytest.mark.parametrize("regs", [0, 40])
@pytest.mark.parametrize("d", [512, 2048, 4096])
def test_per_token_record_kernel_register_cap(d, regs, monkeypatch):
    # LAUNCH["quant"]["record_regs"]: the per-token record kernel on rows of one chunk not loaded ahead (T = 5) with
    # at most 40 registers (the default; a few bytes spilled to local memory), and uncapped
    monkeypatch.setitem(launch.LAUNCH["quant"], "record_regs", regs)
    assert not launch.prefetched(5, d, 1, 1, ScaleMode.PER_TOKEN, torch.device("cuda"))
    for dtype in DTYPES:
        for bits in (1, 2, 4):
            kernel_checks.check_quantize_record("nvfp4", 5, d, dtype, bits, "per_token", "cuda", _via_op)


@pytest.mark.parametrize("d, row_chunk", [(2048, 4096), (4096, 4096), (7168, 4096), (7168, 8192)])
@pytest.mark.parametrize("loop", [4, 2])
def test_per_token_rows_loaded_ahead(d, row_chunk, loop, monkeypatch):
    # per-token rows loaded ahead (launch.prefetched): in one chunk (7168 columns in one 8192-column chunk on 16 warps
    # where row_chunk allows) or in two (the amax from the loads ahead, then the quantize pass), on one row tile
    # more than the SMs' worth of programs, so that the last program's tiles are partly past the end, and on 3 rows
    # (too few programs: not loaded ahead)
    for key, value in {"row_chunk": row_chunk, "prefetch": 2048, "prefetch_loop": loop, "token_groups": 0}.items():
        monkeypatch.setitem(launch.LAUNCH["quant"], key, value)
    t = loop * torch.cuda.get_device_properties(0).multi_processor_count + 1
    n_chunks = 1 if d <= row_chunk else 2
    assert launch.prefetched(t, d, 1, n_chunks, ScaleMode.PER_TOKEN, torch.device("cuda"))
    assert not launch.prefetched(3, d, 1, n_chunks, ScaleMode.PER_TOKEN, torch.device("cuda"))
    for rows in (3, t):
        for dtype in DTYPES:
            for bits in (1, 4):
                kernel_checks.check_quantize_record("nvfp4", rows, d, dtype, bits, "per_token", "cuda", _via_op)


@pytest.mark.parametrize("ahead", [0, 1, 3])
@pytest.mark.parametrize("d, groups", [(7168, ((2, 2048), (4, 4096))), (5120, ((2, 2048), (4, 4096))),
                                       (6144, ((2, 4096), (2, 4096)))])  # fmt: skip
def test_per_token_rows_in_token_groups(d, groups, ahead, monkeypatch):
    # per-token rows of two chunks that are not whole chunks, taken G rows per program as whole chunks
    # (launch.token_groups; groups: (G, chunk) with a record, without), streamed `ahead` chunks ahead: on the SMs'
    # worth of programs and one row more (the last group one row), and on 3 rows (too few programs: the row-wise
    # kernel). At 6144 the record's 2048-column chunks would give whole rows: it takes the tile's 4096.
    monkeypatch.setitem(launch.LAUNCH["quant"], "group_ahead", ahead)
    t = 2 * torch.cuda.get_device_properties(0).multi_processor_count * 2 + 1
    x = torch.empty(t, d, device="cuda")
    tile = launch.launch_shape(get_format("nvfp4"), d, per_token=True)
    for record, (g, chunk) in zip((True, False), groups, strict=True):
        assert launch.token_groups(t, d, tile, ScaleMode.PER_TOKEN, [x], x.device, record) == (g, chunk, chunk // 512)
        assert not launch.token_groups(3, d, tile, ScaleMode.PER_TOKEN, [x], x.device, record)
    for rows in (3, t):
        for dtype in DTYPES:
            for bits in (1, 2, 4):
                kernel_checks.check_quantize_record("nvfp4", rows, d, dtype, bits, "per_token", "cuda", _via_op)


@pytest.mark.parametrize("fmt", list(kernel_checks.SCALE_MODES))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_guided_is_bit_exact(fmt, dtype, shape):
    # every (record bits, guidance bits) pair on bf16; the extremes on the other dtypes (each pair compiles anew)
    pairs = [(r, b) for r in (1, 2, 3, 4) for b in range(1, r + 1)] if dtype == torch.bfloat16 else [(1, 1), (4, 4)]
    for mode in kernel_checks.SCALE_MODES[fmt]:
        for record_bits, bits in pairs:
            kernel_checks.check_guided(fmt, *shape, dtype, record_bits, bits, mode, "cuda", _guided_via_op)


@pytest.mark.parametrize("fmt", ["nvfp4", "kv_fp4"])
@pytest.mark.parametrize("row_loop", [1, 3])
def test_guided_with_other_row_tiles_per_program(fmt, row_loop, monkeypatch):
    # LAUNCH["guided"]["row_loop"] (default 4): one tile of rows per program, and 3 (the last program's partly past
    # the last row)
    monkeypatch.setitem(launch.LAUNCH["guided"], "row_loop", row_loop)
    for mode in kernel_checks.SCALE_MODES[fmt]:
        for record_bits, bits in ((1, 1), (4, 2)):
            kernel_checks.check_guided(fmt, 37, 2048, torch.bfloat16, record_bits, bits, mode, "cuda", _guided_via_op)


def test_guided_wrapper_matches_guided_round_with_fallback_rows():
    x = kernel_checks.make_input(33, 2048, torch.bfloat16, "cuda")
    roll = quantize(kernel_checks.make_input(33, 2048, torch.bfloat16, "cuda", seed=3), "nvfp4", per_token=True)
    rec = Record.from_quantized(roll, 1)
    has = torch.arange(33, device="cuda") % 4 != 0
    ours, theirs = GuidanceStats(), GuidanceStats()
    assert torch.equal(
        guided_fake_quant(x, rec, 1, has_record=has, stats=ours), guided_round(x, rec, 1, has_record=has, stats=theirs)
    )
    assert (ours.guided, ours.rtn_fallback, int(ours.redirected)) == (
        theirs.guided,
        theirs.rtn_fallback,
        theirs.redirected,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_static_kv_records_guided_values_and_fallback_rows_are_bit_exact(dtype):
    # NVFP4 K/V at the static unit S_enc (nvfp4-w4a4-nvfp4kv): the Triton launchers and the public guided op with
    # the role, rows without a record being the role's RTN
    role = get_recipe("nvfp4-w4a4-nvfp4kv").k
    for bits in (1, 2, 4) if dtype == torch.bfloat16 else (1, 4):
        kernel_checks.check_static_kv(37, 544, dtype, bits, "cuda", launch.triton_quantize_record, launch.triton_guided)
        kernel_checks.check_static_kv(37, 544, dtype, bits, "cuda", _via_op, _guided_via_op)
    x = kernel_checks.make_input(33, 1024, dtype, "cuda")
    roll = quantize(kernel_checks.make_input(33, 1024, dtype, "cuda", seed=3), "nvfp4", global_scale=1.0)
    rec = Record(roll.fmt, 1, 1024, Record.from_quantized(roll, 1).low_bits, roll.scales, torch.ones(33, 1).cuda())
    has = torch.arange(33, device="cuda") % 4 != 0
    out = guided_fake_quant(x, rec, 1, has_record=has, stats=GuidanceStats(), role=role)
    assert torch.equal(out, guided_round(x, rec, 1, has_record=has, stats=GuidanceStats(), role=role))
    assert torch.equal(out[~has], fake_quant(role, x)[~has])


@pytest.mark.parametrize("name", [DEFAULT_RECIPE, "nvfp4-w4a4-nvfp4kv"])
def test_kv_pool_bytes_inside_a_captured_cuda_graph(name):
    # the pool bytes of a kv_fp4 and an NVFP4 (S_enc = 1) role, captured once and replayed on new rows
    role = get_recipe(name).k
    t, d = 64, 512
    x = kernel_checks.make_input(t, d, torch.bfloat16, "cuda")
    kv_pool_bytes(role, x)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        codes, scales = kv_pool_bytes(role, x)
    for seed in range(3):
        x.copy_(kernel_checks.make_input(t, d, torch.bfloat16, "cuda", seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        q = quantize(x, role.fmt, **({"global_scale": 1.0} if role.fmt.has_global_scale else {}))
        assert torch.equal(codes, pack_fp4(q.codes)) and torch.equal(scales, q.scales), (name, seed)


@pytest.mark.parametrize("fmt", ["nvfp4", "kv_fp4", "mxfp4"])
def test_kernel_rtn_fake_quant_and_gradient(fmt):
    x = kernel_checks.make_input(64, 1024, torch.bfloat16, "cuda").requires_grad_(True)
    kwargs = {"per_token": True} if fmt == "nvfp4" else {}
    y = kernel_rtn_fake_quant(x, fmt, **kwargs)
    assert torch.equal(y, rtn_fake_quant(x.detach(), fmt, **kwargs))  # the reference, bit for bit
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)


def test_nvfp4_weight_export():
    w = kernel_checks.make_input(256, 2048, torch.bfloat16, "cuda")
    packed, scales, gs = quantize_nvfp4_weight(w)
    q = quantize(w, "nvfp4")
    assert torch.equal(packed, pack_fp4(q.codes)) and torch.equal(scales, q.scales) and torch.equal(gs, q.global_scale)


def test_quantize_record_inside_a_captured_cuda_graph():
    t, d = 64, 2048
    x = torch.zeros(t, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    low, scales, token = record_buffers(t, d, "nvfp4", 1, "cuda", per_token=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles the kernel) outside the capture
        quantize_record(x, "nvfp4", 1, per_token=True, out=out, low_bits=low, scales=scales, token_scale=token)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_record(x, "nvfp4", 1, per_token=True, out=out, low_bits=low, scales=scales, token_scale=token)
    for seed in range(3):
        x.copy_(kernel_checks.make_input(t, d, torch.bfloat16, "cuda", seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        q = quantize(x, "nvfp4", per_token=True)
        assert torch.equal(out, dequantize(q, torch.bfloat16)) and torch.equal(scales, q.scales)
        assert torch.equal(token, q.global_scale)


def test_guided_counts_inside_a_captured_cuda_graph():
    x = kernel_checks.make_input(64, 2048, torch.bfloat16, "cuda")
    rollout = kernel_checks.make_input(64, 2048, torch.bfloat16, "cuda", seed=4)
    rec = Record.from_quantized(quantize(rollout, "kv_fp4"), 1)
    stats = GuidanceStats()
    guided_fake_quant(x, rec, 1, stats=stats)  # compiles, and makes the device counter, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = guided_fake_quant(x, rec, 1, stats=stats)
    graph.replay()
    graph.replay()
    ref = GuidanceStats()
    assert torch.equal(out, guided_round(x, rec, 1, stats=ref))
    assert ref.redirected > 0 and int(stats.redirected) == 3 * ref.redirected


def test_ops_under_torch_compile():
    x = kernel_checks.make_input(16, 512, torch.bfloat16, "cuda")
    rec = Record.from_quantized(quantize(x, "kv_fp4"), 1)

    @torch.compile(fullgraph=True)
    def step(x, low, scales):
        y = torch.ops.trace_core.fake_quant(x, "kv_fp4", None, False)
        redirected = torch.zeros((), dtype=torch.int64, device=x.device)
        flipped = torch.zeros((), dtype=torch.int64, device=x.device)
        z = torch.ops.trace_core.guided_fake_quant(x, "kv_fp4", 1, 1, low, scales, None, None, redirected, flipped)
        return y + z, redirected, flipped

    expected = dequantize(quantize(x, "kv_fp4"), torch.bfloat16) * 2
    out, redirected, flipped = step(x, rec.low_bits, rec.scales)
    assert torch.equal(out, expected) and int(redirected) == 0 and int(flipped) == 0  # its own record: no change
