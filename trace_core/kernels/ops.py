"""FP4 kernels as torch custom ops: CUDA runs the Triton kernels, every other device runs the reference.

Ops (namespace `trace_core`), all on 2-D `[T, D]` inputs with a unit last stride:
- `quantize_record`: fake-quantized output and/or the record (packed low-b code bits, scale bytes, FP32 token
  scale) written into caller-provided buffers, so addresses stay fixed under CUDA-graph capture;
- `fake_quant`: RTN quantize-dequantize, straight-through backward;
- `guided_fake_quant`: guided rounding from a record, adding the redirected-element count into a counter it
  mutates (`guided_fake_quant` below attaches the straight-through backward).
They are registered with `torch.library`, so they trace under `torch.compile` and capture in CUDA graphs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
from collections.abc import Iterator

import torch

try:
    import triton
except ImportError:  # CPU-only installs: the reference serves every device
    triton = None

from trace_core.numerics.formats import FP4Format, ScaleKind, get_format
from trace_core.numerics.guided import GLOBAL_STATS, GuidanceStats, fallback_scale, guided_quantize, straight_through
from trace_core.numerics.quant import FLOAT_DTYPES, check_scale_args, dequantize, nvfp4_global_scale, quantize
from trace_core.numerics.recipe import Role
from trace_core.records.spec import Record, check_bits, pack_low_bits, packed_len

SCALE_NONE, SCALE_SCALAR, SCALE_ROW, SCALE_PER_TOKEN = 0, 1, 2, 3


def triton_available() -> bool:
    """Whether the Triton kernels can run here (CUDA device and triton importable)."""
    return triton is not None and torch.cuda.is_available()


def _scale_mode(fmt: FP4Format, global_scale: torch.Tensor | None, per_token: bool) -> int:
    if fmt.scale is ScaleKind.E8M0:
        return SCALE_NONE
    if per_token:
        return SCALE_PER_TOKEN
    if global_scale is None:
        raise ValueError(f"{fmt.name} kernels need a static global_scale (0-d or [T, 1]) or per_token=True")
    return SCALE_SCALAR if global_scale.dim() == 0 else SCALE_ROW


LAUNCH: dict[str, dict[str, int]] = {
    "quant": {
        "rows": 1,
        "chunk": 4096,
        "warps": 8,
        "row_chunk": 4096,
        "row_loop": 1,
        "prefetch": 4096,
        "prefetch_loop": 4,
        "record_regs": 40,
        "whole_chunks": 1,
        "token_groups": 1,
        "group_ahead": 3,
        "group_record_chunk": 2048,
    },
    "guided": {"rows": 2, "chunk": 1024, "warps": 4, "row_loop": 4},
}
"""Program tile per kernel: rows x chunk columns and warps (tuned on H200 with `bench/kernels.py --tune`; the quantize
tile's fit to each row width by `bench/record_tiles.py`: see `_launch_shape`). The 16-element quantize kernel and
the guided kernel take `row_loop` tiles of rows one after the other per program (guided: 4, one redirected-count add
per program instead of one per tile: `bench/kernels.py --guided-row-loops 1 4`); with `whole_chunks` = 1 and a
record the quantize kernel takes rows that leave
threads masked as rows of whole chunks where it can (`whole_chunk_rows`); per-token nvfp4 rows of at least
`prefetch` columns (0: none) in one or two chunks are loaded ahead, `prefetch_loop` row tiles per program
(`prefetched`); the per-token nvfp4 record kernel on rows of one chunk not loaded ahead holds at most `record_regs`
registers per thread (0: as ptxas chooses; 40, as many as the kernel without the record: on the H200 at D = 2048
0.6 - 0.8 % faster at T = 65536 and 2 - 3 % at T = 4096, docs/performance.md). With `token_groups` = 1, per-token
nvfp4 rows wider than a chunk but not a whole number of chunks (7168, 5120, 6144) are taken a few rows per program
as whole chunks (`token_groups`), streamed `group_ahead` chunks ahead, in chunks of `group_record_chunk` columns
with a record (docs/performance.md, "token groups"). `TRACE_FP4_LAUNCH` (JSON, e.g.
`{"quant": {"chunk": 4096, "warps": 8}}`) overrides entries for other GPUs."""


SWITCHES = (
    "whole_chunks",
    "prefetch",
    "record_regs",
    "token_groups",
    "group_ahead",
    "group_record_chunk",
)
"""`LAUNCH` entries that may be 0 (off); the others are positive sizes."""
LIMITS = {"group_ahead": 3}
"""Largest values of the `LAUNCH` entries that have one: the token-group kernel has 4 register slots."""


def _check_override(kernel: str, values: dict[str, int]) -> None:
    """ValueError unless values are known `LAUNCH[kernel]` entries with positive ints (0 for the SWITCHES), within
    `LIMITS`."""
    unknown = set(values) - set(LAUNCH[kernel])
    if unknown or not all(isinstance(v, int) and (v > 0 or k in SWITCHES) for k, v in values.items()):
        raise ValueError(f"{kernel}: unknown keys {sorted(unknown)} or non-positive values")
    if over := {k: v for k, v in values.items() if v > LIMITS.get(k, v)}:
        raise ValueError(f"{kernel}: {over} above the largest allowed { ({k: LIMITS[k] for k in over}) }")


def _launch_overrides(text: str) -> None:
    try:
        override = json.loads(text)
        for kernel, values in override.items():
            _check_override(kernel, values)
            LAUNCH[kernel].update(values)
    except (ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"TRACE_FP4_LAUNCH={text!r} is not a valid launch override ({e})") from None


if os.environ.get("TRACE_FP4_LAUNCH"):
    _launch_overrides(os.environ["TRACE_FP4_LAUNCH"])


@contextlib.contextmanager
def launch_overrides(quant: dict[str, int] | None = None, guided: dict[str, int] | None = None) -> Iterator[None]:
    """`LAUNCH` with these entries for the duration, restored in place after (benches and tests of other tiles);
    ValueError for unknown entries or non-positive values, as `TRACE_FP4_LAUNCH`."""
    _check_override("quant", quant or {})
    _check_override("guided", guided or {})
    saved = {kernel: dict(tile) for kernel, tile in LAUNCH.items()}
    try:
        LAUNCH["quant"].update(quant or {})
        LAUNCH["guided"].update(guided or {})
        yield
    finally:
        for kernel, tile in saved.items():
            LAUNCH[kernel].clear()
            LAUNCH[kernel].update(tile)


def _launch_shape(fmt: FP4Format, d: int, kernel: str = "quant", per_token: bool = False) -> tuple[int, int, int]:
    """(rows per program, chunk columns, warps) of `kernel` ("quant" or "guided") on rows of width d.

    The chunk is the tile's, or the row's width rounded up to a power of two where that is narrower. Per-token
    nvfp4 takes a row of up to `row_chunk` columns (rounded up likewise) in one chunk: x read once. The quantize
    kernel's warps scale with its chunk against the tile's, so that each thread keeps the tile's share of a row
    (4096 columns on 8 warps: 16 elements per thread, one 16-element block or half a 32-element one, where
    `record_first` holds): 4 warps on rows of 2048 columns, 16 on per-token rows of 8192, at least 1."""
    tile = LAUNCH[kernel]
    chunk = max(fmt.block, min(tile["chunk"], triton_next_pow2(d)))
    whole = max(fmt.block, triton_next_pow2(d))
    if per_token and chunk < whole <= tile["row_chunk"]:
        chunk = whole
    if kernel != "quant":
        return tile["rows"], chunk, tile["warps"]
    return tile["rows"], chunk, min(16, max(1, tile["warps"] * chunk // tile["chunk"]))


def record_unit(buf: torch.Tensor, bits: int) -> int:
    """Widest access, in bytes, in which the kernels that hold 16 elements per thread (a 16-element block, or half
    of a 32-element one) move those elements' 2 * bits record bytes: 4 or 2 where the buffer's address and row
    stride allow it, else 1."""
    for unit in (4, 2):
        if (unit == 2 * bits or bits % unit == 0) and buf.data_ptr() % unit == 0 and buf.stride(0) % unit == 0:
            return unit
    return 1


def record_first(rows: int, chunk: int, warps: int) -> bool:
    """Whether the quantize kernels that hold 16 elements per thread (`_quantize_record16_kernel`,
    `_quantize_record32_halves_kernel`) store the record before the output (`RECORD_FIRST`): where their tile of
    rows x chunk columns gives each of its 32 x warps threads whole 16-element blocks (or block halves)."""
    return rows * chunk // 16 >= 32 * warps


def block_per_thread(fmt: FP4Format, record: bool, first: bool) -> bool:
    """Whether the quantize kernel for 16-element blocks is the block-per-thread one (`_quantize_record16_kernel`)
    rather than the group-per-thread one (`_quantize_record_kernel`), given `record_first` (`first`): always,
    except for nvfp4 with a record on a tile that does not give each thread
    whole blocks (rows of at most 256 columns with the default tile, or a `TRACE_FP4_LAUNCH` override), where the
    group-per-thread kernel measured faster on the H200 (docs/performance.md)."""
    return fmt.block == 16 and (first or not (record and fmt.has_global_scale))


def whole_chunk_rows(
    t: int, d: int, chunk: int, mode: int, tensors: list[torch.Tensor | None], record: bool = True
) -> int:
    """Rows of `chunk` columns as which the quantize kernel takes a [t, d] input and its buffers (`tensors`), or 0
    to take them as they are. Where a row is not a whole number of chunks, its last chunk leaves threads masked
    (at d = 7168 a quarter of the second 4096-column chunk: 2 x the instructions of d = 4096 for 1.75 x the data).
    Where every scale is a block's own, a block's output and record do not depend on its row, so contiguous
    tensors whose t * d elements fill whole chunks can be taken as rows of one chunk, none masked: the same blocks
    at the same offsets. Done for the E8M0 formats (kv_fp4, mxfp4, mxfp4_ocp; timed on kv_fp4 and mxfp4) where
    the kernel writes a record, and without one where the row's last chunk is at most half used (H200, kv_fp4,
    T = 65536, without the record: 346.2 against 445.7 us on its rows at d = 5120, 413.2 against 444.7 at 6144; at
    7168, the last chunk three quarters used, whole chunks were 0.8 % slower). nvfp4 with one S_enc would be taken
    the same way, but was not timed so and keeps its rows."""
    off = not LAUNCH["quant"]["whole_chunks"] or mode != SCALE_NONE
    if off or d % chunk == 0 or (t * d) % chunk or (not record and 2 * (d % chunk) > chunk):
        return 0
    return t * d // chunk if all(b is None or b.is_contiguous() for b in tensors) else 0


def token_groups(
    t: int, d: int, tile: tuple[int, int, int], mode: int, tensors: list[torch.Tensor | None], device, record: bool
) -> tuple[int, int, int] | None:
    """(G, chunk, warps): the tile as which the quantize kernel takes t per-token nvfp4 rows of width d, G rows per
    program as G * d / chunk whole chunks (`_quantize_record16_token_groups_kernel`), or None for the row-wise
    kernels; tile is the (rows, chunk, warps) of `_launch_shape`. Where a row wider than one chunk is not a whole
    number of chunks, its last chunk leaves threads masked; G rows (the fewest whose columns fill whole chunks, at
    most 4) do not. With a record the chunk is `LAUNCH["quant"]["group_record_chunk"]` (2048, on half the warps:
    at d = 7168, 2 rows as 7 chunks) where that gives token groups, else the tile's (4096 at d = 7168: 4 rows as 7
    chunks). Needs `LAUNCH["quant"]["token_groups"]` on, contiguous tensors, and at least the GPU's SMs in programs
    (as `prefetched`). H200, d = 7168: docs/performance.md, "token groups"."""
    rows, chunk, warps = tile
    on = LAUNCH["quant"]["token_groups"] and mode == SCALE_PER_TOKEN and d > chunk
    if not on or not all(b is None or b.is_contiguous() for b in tensors):
        return None
    narrow = min(chunk, LAUNCH["quant"]["group_record_chunk"] or chunk) if record else chunk
    for c in dict.fromkeys((narrow, chunk)):  # the record's chunk first, then the tile's
        w = max(1, warps * c // chunk)
        g = c // math.gcd(d, c)
        if 1 < g <= 4 and record_first(rows, c, w):
            return (g, c, w) if triton.cdiv(t, g) >= _sm_count(device) else None
    return None


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the Triton interpreter runs one program at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def prefetched(t: int, d: int, rows: int, n_chunks: int, mode: int, device: torch.device) -> bool:
    """Whether the quantize kernel takes t per-token rows of width d, `rows` per tile, as `LAUNCH["quant"]
    ["prefetch_loop"]` tiles per program, loading each tile's x before it quantizes the previous one
    (`_quantize_record16_kernel`'s PREFETCH): where a row is one or two chunks, at least `LAUNCH["quant"]
    ["prefetch"]` columns, and the programs still number at least the GPU's SMs (at T = 64, 16 programs would each
    take 4 rows in turn). H200, nvfp4 per token, T = 65536: at D = 4096 the record kernel 8.8 % faster, its cost
    +5.0 -> +2.5 %; at D = 7168 (two chunks) both kernels 2 - 3 % faster; at D = 2048 not faster
    (docs/performance.md, "per-token rows loaded ahead"). Rows that `token_groups` takes are not asked."""
    if not loaded_ahead_rows(d, n_chunks, mode):
        return False
    return triton.cdiv(t, rows * LAUNCH["quant"]["prefetch_loop"]) >= _sm_count(device)


def loaded_ahead_rows(d: int, n_chunks: int, mode: int) -> bool:
    """Whether rows of width d in n_chunks chunks are of the shape `prefetched` loads ahead: per token, one or two
    chunks, at least `LAUNCH["quant"]["prefetch"]` columns (0: none)."""
    prefetch = LAUNCH["quant"]["prefetch"]
    return mode == SCALE_PER_TOKEN and n_chunks <= 2 and bool(prefetch) and d >= prefetch


def record_regs(record: bool, mode: int, n_chunks: int, prefetch: bool) -> int:
    """The register cap (`maxnreg`) of the 16-element quantize kernel, 0 for none: `LAUNCH["quant"]["record_regs"]`
    for the per-token record kernel on rows of one chunk not loaded ahead."""
    capped = record and mode == SCALE_PER_TOKEN and n_chunks == 1 and not prefetch
    return LAUNCH["quant"]["record_regs"] if capped else 0


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dummy(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(1, dtype=dtype, device=x.device)


def triton_quantize_record(x, fmt, bits, global_scale, per_token, out, low_bits, scales, token_scale) -> None:
    """Launch the quantize-and-record kernel (arguments already validated; see `quantize_record`)."""
    from trace_core.kernels import triton_fp4 as k
    from trace_core.kernels import triton_token_groups as tg

    t, d = x.shape
    if t == 0:
        return
    mode = _scale_mode(fmt, global_scale, per_token)
    rb, chunk, warps = _launch_shape(fmt, d, per_token=mode == SCALE_PER_TOKEN)
    record = low_bits is not None
    rows = whole_chunk_rows(t, d, chunk, mode, [x, out, low_bits, scales], record)
    if rows:
        x, out, low_bits, scales = (b if b is None else b.view(rows, -1) for b in (x, out, low_bits, scales))
        t, d = x.shape
        rb, chunk, warps = _launch_shape(fmt, d)
    n_chunks = triton.cdiv(d, chunk)
    if groups := token_groups(t, d, (rb, chunk, warps), mode, [x, out, low_bits, scales], x.device, record):
        g, c, w = groups
        tg._quantize_record16_token_groups_kernel[(triton.cdiv(t, g),)](
            x,
            out if out is not None else _dummy(x, x.dtype),
            low_bits if record else _dummy(x, torch.uint8),
            scales if record else _dummy(x, torch.uint8),
            token_scale if token_scale is not None else _dummy(x, torch.float32),
            t,
            low_bits.stride(0) if record else 0,
            scales.stride(0) if record else 0,
            token_scale.stride(0) if token_scale is not None else 0,
            BITS=bits if record else 0,
            WRITE_OUT=out is not None,
            D=d,
            G=g,
            C=c,
            REC_UNIT=record_unit(low_bits, bits) if record else 1,
            AHEAD=LAUNCH["quant"]["group_ahead"],
            num_warps=w,
        )
        return
    if fmt.block == 32:  # mxfp4, mxfp4_ocp: half a block per thread
        k._quantize_record32_halves_kernel[(triton.cdiv(t, rb), n_chunks)](
            x,
            out if out is not None else _dummy(x, x.dtype),
            low_bits if record else _dummy(x, torch.uint8),
            scales if record else _dummy(x, torch.uint8),
            t,
            d,
            x.stride(0),
            out.stride(0) if out is not None else 0,
            low_bits.stride(0) if record else 0,
            scales.stride(0) if record else 0,
            FMT=fmt.kernel_id,
            BITS=bits if record else 0,
            WRITE_OUT=out is not None,
            RB=rb,
            C=chunk,
            REC_UNIT=record_unit(low_bits, bits) if record else 1,
            RECORD_FIRST=record_first(rb, chunk, warps),
            num_warps=warps,
        )
        return
    per_prog = n_chunks if mode == SCALE_PER_TOKEN else 1
    loop = 1
    unit = record_unit(low_bits, bits) if record and fmt.block == 16 else 1
    first = record_first(rb, chunk, warps)
    if block_per_thread(fmt, record, first):
        prefetch = prefetched(t, d, rb, n_chunks, mode, x.device)
        loop = LAUNCH["quant"]["prefetch_loop" if prefetch else "row_loop"]
        kernel = k._quantize_record16_kernel
        extra = {"REC_UNIT": unit, "RECORD_FIRST": first, "ROW_LOOP": loop, "PREFETCH": prefetch}
        if regs := record_regs(record, mode, n_chunks, prefetch):
            extra["maxnreg"] = regs
    else:
        kernel, extra = k._quantize_record_kernel, {"BLOCK": fmt.block}
    grid = (triton.cdiv(t, rb * loop), n_chunks // per_prog)
    kernel[grid](
        x,
        out if out is not None else _dummy(x, x.dtype),
        low_bits if record else _dummy(x, torch.uint8),
        scales if record else _dummy(x, torch.uint8),
        global_scale if global_scale is not None else _dummy(x, torch.float32),
        token_scale if token_scale is not None else _dummy(x, torch.float32),
        t,
        d,
        x.stride(0),
        out.stride(0) if out is not None else 0,
        low_bits.stride(0) if record else 0,
        scales.stride(0) if record else 0,
        token_scale.stride(0) if token_scale is not None else 0,
        per_prog,
        FMT=fmt.kernel_id,
        SCALE_MODE=mode,
        BITS=bits if record else 0,
        WRITE_OUT=out is not None,
        RB=rb,
        C=chunk,
        ONE_PASS=n_chunks == 1,
        num_warps=warps,
        **extra,
    )


def _quantize_record_reference(x, fmt, bits, global_scale, per_token, out, low_bits, scales, token_scale) -> None:
    q = quantize(x, fmt, global_scale=global_scale, per_token=per_token)
    if out is not None:
        out.copy_(dequantize(q, x.dtype))
    if low_bits is not None:
        low_bits.copy_(pack_low_bits(q.codes, bits))
        scales.copy_(q.scales)
        if token_scale is not None and q.global_scale is not None:  # per-token nvfp4 (quantize_record checks)
            token_scale.copy_(q.global_scale.reshape(token_scale.shape))


@torch.library.custom_op("trace_core::quantize_record", mutates_args=("out", "low_bits", "scales", "token_scale"))
def _quantize_record_op(
    x: torch.Tensor,
    fmt: str,
    bits: int,
    global_scale: torch.Tensor | None,
    per_token: bool,
    out: torch.Tensor | None,
    low_bits: torch.Tensor | None,
    scales: torch.Tensor | None,
    token_scale: torch.Tensor | None,
) -> None:
    _quantize_record_reference(x, get_format(fmt), bits, global_scale, per_token, out, low_bits, scales, token_scale)


@_quantize_record_op.register_kernel("cuda")
def _(x, fmt, bits, global_scale, per_token, out, low_bits, scales, token_scale) -> None:
    triton_quantize_record(x, get_format(fmt), bits, global_scale, per_token, out, low_bits, scales, token_scale)


@_quantize_record_op.register_fake
def _(x, fmt, bits, global_scale, per_token, out, low_bits, scales, token_scale) -> None:
    return None


def _check_2d(x: torch.Tensor, fmt: FP4Format, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{what} must be a 2-D [T, D] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what} dtype {x.dtype} is not supported; use one of {FLOAT_DTYPES}")
    if x.shape[1] == 0 or x.shape[1] % fmt.block:
        raise ValueError(
            f"{what} shape {tuple(x.shape)}: D must be a non-zero multiple of the {fmt.name} block {fmt.block}"
        )
    if x.stride(1) != 1:
        raise ValueError(f"{what} must have a unit last stride, got strides {x.stride()}")


def _check_buffer(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, x: torch.Tensor, name: str) -> None:
    if buf.dtype != dtype or tuple(buf.shape) != shape or buf.device != x.device:
        raise ValueError(
            f"{name} buffer must be {dtype} {shape} on {x.device}, got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
        )
    if buf.dim() == 2 and buf.stride(1) != 1:
        raise ValueError(f"{name} buffer must have a unit last stride, got strides {buf.stride()}")


def _global_scale_tensor(x: torch.Tensor, fmt: FP4Format, global_scale, per_token: bool) -> torch.Tensor | None:
    gs = check_scale_args(fmt, global_scale, per_token, (x.shape[0],), x.device)
    if fmt.has_global_scale and gs is None and not per_token:
        raise ValueError(f"{fmt.name} kernels need a static global_scale (0-d or [T, 1]) or per_token=True")
    return None if gs is None else gs.contiguous()


def record_buffers(t: int, d: int, fmt: FP4Format | str, bits: int, device, per_token: bool = False):
    """Allocate (low_bits, scales, token_scale) record buffers for `t` rows of width `d`."""
    fmt = get_format(fmt)
    low = torch.empty(t, packed_len(d, check_bits(bits)), dtype=torch.uint8, device=device)
    scales = torch.empty(t, d // fmt.block, dtype=torch.uint8, device=device)
    token = torch.empty(t, 1, dtype=torch.float32, device=device) if per_token else None
    return low, scales, token


def quantize_record(
    x: torch.Tensor,
    fmt: FP4Format | str,
    bits: int,
    *,
    global_scale: float | torch.Tensor | None = None,
    per_token: bool = False,
    out: torch.Tensor | None = None,
    low_bits: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    token_scale: torch.Tensor | None = None,
) -> None:
    """Fake-quantize `x` into `out` and/or write its record into `low_bits`, `scales` (and `token_scale` for
    per-token nvfp4). Pass `low_bits=None` for the no-record variant (uncaptured layers)."""
    fmt = get_format(fmt)
    _check_2d(x, fmt, "quantize_record input")
    gs = _global_scale_tensor(x, fmt, global_scale, per_token)
    t, d = x.shape
    if out is not None:
        _check_buffer(out, (t, d), x.dtype, x, "out")
    if low_bits is not None:
        check_bits(bits)
        if scales is None:
            raise ValueError("a record needs a scales buffer next to low_bits")
        _check_buffer(low_bits, (t, packed_len(d, bits)), torch.uint8, x, "low_bits")
        _check_buffer(scales, (t, d // fmt.block), torch.uint8, x, "scales")
        if per_token and fmt.has_global_scale:
            if token_scale is None:
                raise ValueError("a per-token nvfp4 record needs a token_scale buffer [T, 1]")
            _check_buffer(token_scale, (t, 1), torch.float32, x, "token_scale")
    elif out is None:
        raise ValueError("quantize_record has nothing to write: pass out and/or low_bits + scales")
    _quantize_record_op(x, fmt.name, bits, gs, per_token, out, low_bits, scales, token_scale)


@torch.library.custom_op("trace_core::fake_quant", mutates_args=())
def _fake_quant_op(x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None, per_token: bool) -> torch.Tensor:
    return dequantize(quantize(x, fmt, global_scale=global_scale, per_token=per_token), x.dtype)


@_fake_quant_op.register_kernel("cuda")
def _(x, fmt, global_scale, per_token):
    out = torch.empty_like(x)
    triton_quantize_record(x, get_format(fmt), 0, global_scale, per_token, out, None, None, None)
    return out


@_fake_quant_op.register_fake
def _(x, fmt, global_scale, per_token):
    return torch.empty_like(x)


def _identity_backward(ctx, grad, *rest):
    return grad, None, None, None


_fake_quant_op.register_autograd(_identity_backward)


def rtn_fake_quant(
    x: torch.Tensor, fmt: FP4Format | str, *, global_scale: float | torch.Tensor | None = None, per_token: bool = False
) -> torch.Tensor:
    """RTN quantize-dequantize of a `[T, D]` tensor with a straight-through backward (kernel twin of
    `trace_core.numerics.guided.rtn_fake_quant`)."""
    fmt = get_format(fmt)
    _check_2d(x, fmt, "rtn_fake_quant input")
    if fmt.has_global_scale and global_scale is None and not per_token:
        global_scale = quantize_global_scale(x)
    return _fake_quant_op(x.contiguous(), fmt.name, _global_scale_tensor(x, fmt, global_scale, per_token), per_token)


def quantize_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor nvfp4 `S_enc = 2688 / amax` (1 when amax is 0), as the reference computes it."""
    return nvfp4_global_scale(x.detach().abs().amax())


@torch.library.custom_op("trace_core::guided_fake_quant", mutates_args=("redirected",))
def _guided_op(
    x: torch.Tensor,
    fmt: str,
    bits: int,
    record_bits: int,
    low_bits: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    has_record: torch.Tensor | None,
    redirected: torch.Tensor,
) -> torch.Tensor:
    f = get_format(fmt)
    rec = Record(fmt=f, bits=record_bits, n=x.shape[1], low_bits=low_bits, scales=scales, global_scale=global_scale)
    guided, moved = guided_quantize(x, rec, bits)
    if has_record is not None:
        moved &= has_record.unsqueeze(-1)
    redirected += moved.sum().to(redirected.device)
    return dequantize(guided, x.dtype)


def triton_guided(x, fmt, bits, record_bits, low_bits, scales, global_scale, has_record, redirected) -> torch.Tensor:
    """Launch the guided fake-quant kernel: returns the output and adds the redirected-element count into
    `redirected` (int64, one element on x's device), each program adding its own count: no reduction launched."""
    from trace_core.kernels import triton_fp4 as k

    f = get_format(fmt)
    out = torch.empty_like(x)
    t, d = x.shape
    if t == 0:
        return out
    rb, chunk, warps = _launch_shape(f, d, "guided")
    loop = LAUNCH["guided"]["row_loop"]
    k._guided_kernel[(triton.cdiv(t, rb * loop), triton.cdiv(d, chunk))](
        x,
        out,
        low_bits,
        scales,
        global_scale if global_scale is not None else _dummy(x, torch.float32),
        has_record if has_record is not None else _dummy(x, torch.bool),
        redirected,
        t,
        d,
        x.stride(0),
        out.stride(0),
        low_bits.stride(0),
        scales.stride(0),
        FMT=f.kernel_id,
        SCALE_MODE=_scale_mode(f, global_scale, False),
        BITS=bits,
        RECORD_BITS=record_bits,
        HAS_MASK=has_record is not None,
        RB=rb,
        C=chunk,
        REC_UNIT=record_unit(low_bits, record_bits),
        BLOCK=f.block,
        ROW_LOOP=loop,
        num_warps=warps,
    )
    return out


@_guided_op.register_kernel("cuda")
def _(x, fmt, bits, record_bits, low_bits, scales, global_scale, has_record, redirected):
    return triton_guided(x, fmt, bits, record_bits, low_bits, scales, global_scale, has_record, redirected)


@_guided_op.register_fake
def _(x, fmt, bits, record_bits, low_bits, scales, global_scale, has_record, redirected):
    return torch.empty_like(x)


def redirect_counter(stats: GuidanceStats, device: torch.device) -> torch.Tensor:
    """`stats.redirected` as the int64 0-d tensor on `device` that the guided op adds into (made once from its
    current value)."""
    r = stats.redirected
    if isinstance(r, torch.Tensor) and r.device == device and r.dtype == torch.int64 and r.dim() == 0:
        return r
    counter = torch.zeros((), dtype=torch.int64, device=device) + r
    stats.redirected = counter
    return counter


def guided_fake_quant(
    x: torch.Tensor,
    record: Record,
    bits: int,
    *,
    has_record: torch.Tensor | None = None,
    stats: GuidanceStats | None = None,
    role: Role | None = None,
) -> torch.Tensor:
    """Kernel twin of `trace_core.numerics.guided.guided_round` for `[T, D]` inputs: same values, same fallback for rows
    without a record (the RTN of the rollout's `role`, `fallback_scale`), same counts in `stats` (default
    `GLOBAL_STATS`)."""
    check_bits(bits)
    if not isinstance(record, Record):
        raise ValueError(f"guided_fake_quant needs a Record, got {type(record).__name__}")
    _check_2d(x, record.fmt, "guided_fake_quant input")
    if tuple(record.shape) != tuple(x.shape):
        raise ValueError(f"record shape {tuple(record.shape)} does not match input shape {tuple(x.shape)}")
    if bits > record.bits:
        raise ValueError(f"record keeps {record.bits} code bits, cannot guide with {bits}")
    if has_record is not None and (has_record.dtype != torch.bool or tuple(has_record.shape) != (x.shape[0],)):
        raise ValueError(
            f"has_record must be bool of shape {(x.shape[0],)}, got {has_record.dtype} {tuple(has_record.shape)}"
        )
    stats = GLOBAL_STATS if stats is None else stats
    gs = record.global_scale
    gs = gs.to(torch.float32).contiguous() if gs is not None else None
    value = _guided_op(
        x.detach().contiguous(),
        record.fmt.name,
        bits,
        record.bits,
        record.low_bits,
        record.scales,
        gs,
        has_record.contiguous() if has_record is not None else None,
        redirect_counter(stats, x.device),
    )
    out = straight_through(x, value)  # the op mutates the counter, so its gradient is attached here
    fallback: int | torch.Tensor = 0
    if has_record is not None:
        # Every row gets the RTN candidate and rows without a record take it: no data-dependent shapes, so
        # nothing waits on the device (CUDA graphs, torch.compile, CPU run-ahead).
        rtn = rtn_fake_quant(x, record.fmt, **fallback_scale(record, role))
        out = torch.where(has_record.unsqueeze(-1), out, rtn)
        fallback = (~has_record).sum() * x.shape[1]
    stats.guided += x.numel() - fallback
    stats.rtn_fallback += fallback  # counts are device tensors: no host sync until they are read
    return out


def quantize_nvfp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 export of a weight `[N, K]` (blocks of 16 along K, one per-tensor global scale): packed codes
    uint8 `[N, K/2]` (element 2i in the low nibble), E4M3 scale bytes `[N, K/16]`, FP32 `S_enc` (0-d)."""
    _check_2d(w, get_format("nvfp4"), "nvfp4 weight")
    gs = quantize_global_scale(w)
    low, scales, _ = record_buffers(w.shape[0], w.shape[1], "nvfp4", 4, w.device)
    quantize_record(w.contiguous(), "nvfp4", 4, global_scale=gs, low_bits=low, scales=scales)
    return low, scales, gs
