"""How the FP4 Triton kernels launch: the tiles (`LAUNCH`, `TRACE_FP4_LAUNCH`, `launch_overrides`), the heuristics
that pick a kernel and its constexprs for a call, and the two launchers the custom ops of `api` run on CUDA.

Each heuristic states its rule and names the section of docs/performance.md ("How the kernels launch, and why")
that gives the measurement behind it.
"""

from __future__ import annotations

import contextlib
import enum
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


def triton_available() -> bool:
    """Whether the Triton kernels can run here (CUDA device and triton importable)."""
    return triton is not None and torch.cuda.is_available()


class ScaleMode(enum.IntEnum):
    """Where a quantize or guided kernel takes the global scale `S_enc` from (its `SCALE_MODE` constexpr)."""

    NONE = 0  # E8M0 formats: no global scale
    SCALAR = 1  # one static or per-tensor S_enc
    ROW = 2  # one static S_enc per row
    PER_TOKEN = 3  # S_enc computed from each row's amax


def scale_mode(fmt: FP4Format, global_scale: torch.Tensor | None, per_token: bool) -> ScaleMode:
    """The `ScaleMode` of a call: NONE for E8M0 formats, PER_TOKEN where asked, else SCALAR for a 0-d global scale
    and ROW for a `[T, 1]` one."""
    if fmt.scale is ScaleKind.E8M0:
        return ScaleMode.NONE
    if per_token:
        return ScaleMode.PER_TOKEN
    if global_scale is None:
        raise ValueError(f"{fmt.name} kernels need a static global_scale (0-d or [T, 1]) or per_token=True")
    return ScaleMode.SCALAR if global_scale.dim() == 0 else ScaleMode.ROW


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
"""Launch settings per kernel, tuned on the H200 (`bench/kernels.py --tune`, `bench/record_tiles.py`). The tile:
`rows` x `chunk` columns on `warps` warps (`launch_shape`), per-token rows of up to `row_chunk` columns in one chunk,
`row_loop` row tiles one after the other per program. The quantize kernel's switches (0: off): `prefetch` and
`prefetch_loop` (`prefetched`), `record_regs` (`record_regs`), `whole_chunks` (`whole_chunk_rows`), `token_groups`,
`group_ahead` and `group_record_chunk` (`token_groups`). `TRACE_FP4_LAUNCH` (JSON, e.g.
`{"quant": {"chunk": 4096, "warps": 8}}`) overrides entries for other GPUs (docs/performance.md, "How the kernels
launch, and why")."""

SWITCHES = ("whole_chunks", "prefetch", "record_regs", "token_groups", "group_ahead", "group_record_chunk")
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


def apply_launch_override(text: str) -> None:
    """Update `LAUNCH` from a `TRACE_FP4_LAUNCH` JSON text; ValueError naming it if it is not a valid override."""
    try:
        override = json.loads(text)
        for kernel, values in override.items():
            _check_override(kernel, values)
            LAUNCH[kernel].update(values)
    except (ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"TRACE_FP4_LAUNCH={text!r} is not a valid launch override ({e})") from None


if os.environ.get("TRACE_FP4_LAUNCH"):
    apply_launch_override(os.environ["TRACE_FP4_LAUNCH"])


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


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def launch_shape(fmt: FP4Format, d: int, kernel: str = "quant", per_token: bool = False) -> tuple[int, int, int]:
    """(rows per program, chunk columns, warps) of `kernel` ("quant" or "guided") on rows of width d.

    Rule: the chunk is the tile's, or the row's width rounded up to a power of two where that is narrower; per-token
    rows of up to `row_chunk` columns (rounded up likewise) are one chunk, so x is read once. The quantize kernel's
    warps scale with its chunk against the tile's, so each thread keeps the tile's share of a row (4096 columns on
    8 warps: one 16-element block, or half a 32-element one), at least 1 and at most 16 warps; the guided tile is
    not scaled. Docs: docs/performance.md, "Tiles"."""
    tile = LAUNCH[kernel]
    chunk = max(fmt.block, min(tile["chunk"], next_pow2(d)))
    whole = max(fmt.block, next_pow2(d))
    if per_token and chunk < whole <= tile["row_chunk"]:
        chunk = whole
    if kernel != "quant":
        return tile["rows"], chunk, tile["warps"]
    return tile["rows"], chunk, min(16, max(1, tile["warps"] * chunk // tile["chunk"]))


def record_unit(buf: torch.Tensor, bits: int) -> int:
    """The record's access width in bytes (`REC_UNIT`) for the kernels that hold 16 elements per thread.

    Rule: a thread's 2 * bits record bytes move as 4- or 2-byte words where the buffer's address and row stride
    allow it (4 for b = 2 or 4, 2 for b = 1, 2 or 4), else byte by byte (a staging-row view at an odd address).
    Docs: docs/performance.md, "The record before the output"."""
    for unit in (4, 2):
        if (unit == 2 * bits or bits % unit == 0) and buf.data_ptr() % unit == 0 and buf.stride(0) % unit == 0:
            return unit
    return 1


def record_first(rows: int, chunk: int, warps: int) -> bool:
    """Whether the quantize kernels that hold 16 elements per thread store the record before the output
    (`RECORD_FIRST`).

    Rule: where the tile of rows x chunk columns gives each of its 32 x warps threads whole 16-element blocks (or
    block halves), so that a thread's two output stores then issue back to back. Docs: docs/performance.md, "The
    record before the output"."""
    return rows * chunk // 16 >= 32 * warps


def block_per_thread(fmt: FP4Format, record: bool, first: bool) -> bool:
    """Whether a 16-element-block format takes the block-per-thread quantize kernel (`_quantize_record16_kernel`)
    rather than the group-per-thread one (`_quantize_record_kernel`), given `record_first` (`first`).

    Rule: always, except for nvfp4 with a record on a tile that does not give each thread whole blocks (rows of at
    most 256 columns with the default tile, or a `TRACE_FP4_LAUNCH` override). Docs: docs/performance.md,
    "Tiles"."""
    return fmt.block == 16 and (first or not (record and fmt.has_global_scale))


def whole_chunk_rows(
    t: int, d: int, chunk: int, mode: ScaleMode, tensors: list[torch.Tensor | None], record: bool = True
) -> int:
    """Rows of `chunk` columns as which the quantize kernel takes a [t, d] input and its buffers (`tensors`), or 0
    to take them as they are.

    Rule: where every scale is a block's own (`ScaleMode.NONE`: kv_fp4, mxfp4, mxfp4_ocp), a block's output and
    record do not depend on its row, so contiguous tensors whose t * d elements fill whole chunks are taken as rows
    of one chunk (the same blocks at the same offsets, no thread masked), with a record wherever a row is not a
    whole number of chunks, without one only where the row's last chunk is at most half used. nvfp4 keeps its rows.
    Needs `LAUNCH["quant"]["whole_chunks"]` on. Docs: docs/performance.md, "Rows of whole chunks"."""
    off = not LAUNCH["quant"]["whole_chunks"] or mode != ScaleMode.NONE
    if off or d % chunk == 0 or (t * d) % chunk or (not record and 2 * (d % chunk) > chunk):
        return 0
    return t * d // chunk if all(b is None or b.is_contiguous() for b in tensors) else 0


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the Triton interpreter runs one program at a time)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def token_groups(
    t: int,
    d: int,
    tile: tuple[int, int, int],
    mode: ScaleMode,
    tensors: list[torch.Tensor | None],
    device: torch.device,
    record: bool,
) -> tuple[int, int, int] | None:
    """(G, chunk, warps): the tile as which the quantize kernel takes t per-token nvfp4 rows of width d, G rows per
    program as G * d / chunk whole chunks (`_quantize_record16_token_groups_kernel`), or None for the row-wise
    kernels; tile is the (rows, chunk, warps) of `launch_shape`.

    Rule: per-token rows wider than one chunk and not a whole number of chunks are taken as the fewest rows whose
    columns fill whole chunks (G, at most 4), so no thread is masked. With a record the chunk is
    `LAUNCH["quant"]["group_record_chunk"]` (on proportionally fewer warps) where that gives token groups, else the
    tile's. Needs `LAUNCH["quant"]["token_groups"]` on, contiguous tensors, a tile that gives each thread whole
    blocks (`record_first`), and at least the GPU's SMs in programs. Docs: docs/performance.md, "Token groups"."""
    rows, chunk, warps = tile
    on = LAUNCH["quant"]["token_groups"] and mode == ScaleMode.PER_TOKEN and d > chunk
    if not on or not all(b is None or b.is_contiguous() for b in tensors):
        return None
    narrow = min(chunk, LAUNCH["quant"]["group_record_chunk"] or chunk) if record else chunk
    for c in dict.fromkeys((narrow, chunk)):  # the record's chunk first, then the tile's
        w = max(1, warps * c // chunk)
        g = c // math.gcd(d, c)
        if 1 < g <= 4 and record_first(rows, c, w):
            return (g, c, w) if -(-t // g) >= _sm_count(device) else None
    return None


def loaded_ahead_rows(d: int, n_chunks: int, mode: ScaleMode) -> bool:
    """Whether rows of width d in n_chunks chunks are of the shape `prefetched` loads ahead.

    Rule: per-token rows of one or two chunks and at least `LAUNCH["quant"]["prefetch"]` columns (0: none). Docs:
    docs/performance.md, "Per-token rows loaded ahead"."""
    prefetch = LAUNCH["quant"]["prefetch"]
    return mode == ScaleMode.PER_TOKEN and n_chunks <= 2 and bool(prefetch) and d >= prefetch


def prefetched(t: int, d: int, rows: int, n_chunks: int, mode: ScaleMode, device: torch.device) -> bool:
    """Whether the quantize kernel takes t rows of width d, `rows` per tile, as `LAUNCH["quant"]["prefetch_loop"]`
    tiles per program, loading each tile's x before it quantizes the previous one (`PREFETCH`).

    Rule: rows of the shape `loaded_ahead_rows` names, where the programs still number at least the GPU's SMs (not
    at T = 64: 16 programs would each take 4 rows in turn). Rows that `token_groups` takes are not asked. Docs:
    docs/performance.md, "Per-token rows loaded ahead"."""
    if not loaded_ahead_rows(d, n_chunks, mode):
        return False
    return -(-t // (rows * LAUNCH["quant"]["prefetch_loop"])) >= _sm_count(device)


def record_regs(record: bool, mode: ScaleMode, n_chunks: int, prefetch: bool) -> int:
    """The register cap (`maxnreg`) of the 16-element quantize kernel, 0 for none.

    Rule: `LAUNCH["quant"]["record_regs"]` for the per-token record kernel on rows of one chunk not loaded ahead
    (as many registers as the kernel without the record), else none. Docs: docs/performance.md, "Per-token rows
    loaded ahead"."""
    capped = record and mode == ScaleMode.PER_TOKEN and n_chunks == 1 and not prefetch
    return LAUNCH["quant"]["record_regs"] if capped else 0


def _dummy(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(1, dtype=dtype, device=x.device)


def triton_quantize_record(x, fmt, bits, global_scale, per_token, out, low_bits, scales, token_scale) -> None:
    """Launch the quantize-and-record kernel the heuristics above pick (arguments already validated: see
    `api.quantize_record`)."""
    from trace_core.kernels import triton_fp4 as k
    from trace_core.kernels import triton_token_groups as tg

    t, d = x.shape
    if t == 0:
        return
    mode = scale_mode(fmt, global_scale, per_token)
    rb, chunk, warps = launch_shape(fmt, d, per_token=mode == ScaleMode.PER_TOKEN)
    record = low_bits is not None
    rows = whole_chunk_rows(t, d, chunk, mode, [x, out, low_bits, scales], record)
    if rows:
        x, out, low_bits, scales = (b if b is None else b.view(rows, -1) for b in (x, out, low_bits, scales))
        t, d = x.shape
        rb, chunk, warps = launch_shape(fmt, d)
    n_chunks = triton.cdiv(d, chunk)
    unit = record_unit(low_bits, bits) if record else 1
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
            REC_UNIT=unit,
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
            REC_UNIT=unit,
            RECORD_FIRST=record_first(rb, chunk, warps),
            num_warps=warps,
        )
        return
    per_prog = n_chunks if mode == ScaleMode.PER_TOKEN else 1
    loop = 1
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


def triton_guided(
    x, fmt, bits, record_bits, low_bits, scales, global_scale, has_record, redirected, flipped
) -> torch.Tensor:
    """Launch the guided fake-quant kernel: returns the output and adds the redirected-element count into
    `redirected` and the flipped-element count (codes whose low `record_bits` bits differ from the record's) into
    `flipped` (each int64, one element on x's device), each program adding its own counts: no reduction launched."""
    from trace_core.kernels import triton_fp4 as k

    f = get_format(fmt)
    out = torch.empty_like(x)
    t, d = x.shape
    if t == 0:
        return out
    rb, chunk, warps = launch_shape(f, d, "guided")
    loop = LAUNCH["guided"]["row_loop"]
    k._guided_kernel[(triton.cdiv(t, rb * loop), triton.cdiv(d, chunk))](
        x,
        out,
        low_bits,
        scales,
        global_scale if global_scale is not None else _dummy(x, torch.float32),
        has_record if has_record is not None else _dummy(x, torch.bool),
        redirected,
        flipped,
        t,
        d,
        x.stride(0),
        out.stride(0),
        low_bits.stride(0),
        scales.stride(0),
        FMT=f.kernel_id,
        SCALE_MODE=scale_mode(f, global_scale, False),
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
