"""Run by tests/kernels/test_kernels.py with TRITON_INTERPRET=1 (`tests.interpret`): the Triton kernels on CPU tensors
against the reference, one case per (check, format, scale mode, dtype, bits, tile).

The interpreter converts FP32 to BF16 by truncation, whereas GPUs round to nearest even, so BF16 *outputs* are
checked on the GPU only; BF16 inputs and their records are checked here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch

from tests import kernel_checks
from tests.interpret import run_cases
from trace_core.kernels import launch
from trace_core.kernels.launch import ScaleMode
from trace_core.numerics.formats import get_format

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def small_tiles() -> contextlib.AbstractContextManager[None]:
    """Several chunks per row (the last one partly masked), per-token nvfp4 rows wider than one tile (a first
    pass for the row amax), as on the GPU for rows wider than LAUNCH["quant"]["row_chunk"], and two row tiles per
    quantize and guided program (the second partly past the last row)."""
    return launch.launch_overrides(
        {"rows": 2, "chunk": 32, "row_chunk": 32, "row_loop": 2}, {"rows": 2, "chunk": 32, "row_loop": 2}
    )


def _in_small_tiles(fn: Callable[[], None]) -> None:
    with small_tiles():
        fn()


def cases() -> dict[str, Callable[[], None]]:
    """Case id -> check; the ids are what the parametrized test reports."""
    quant = partial(kernel_checks.check_quantize_record, quantize_fn=launch.triton_quantize_record)
    guided = partial(kernel_checks.check_guided, guided_fn=launch.triton_guided)
    out: dict[str, Callable[[], None]] = {}
    for fmt, modes in kernel_checks.SCALE_MODES.items():
        d = 80 if fmt in ("nvfp4", "kv_fp4") else 96  # not a multiple of the kernel chunk
        for mode in modes:
            for name, dtype in DTYPES.items():
                for bits in (1, 2, 3, 4):
                    out[f"quant-{fmt}-{mode}-{name}-b{bits}"] = partial(quant, fmt, 6, d, dtype, bits, mode, "cpu")
                    out[f"guided-{fmt}-{mode}-{name}-b{bits}"] = partial(
                        guided, fmt, 6, d, dtype, bits, bits, mode, "cpu"
                    )
            out[f"guided-{fmt}-{mode}-full-record-b1"] = partial(guided, fmt, 5, d, torch.float32, 4, 1, mode, "cpu")
            out[f"quant-{fmt}-{mode}-one-row"] = partial(quant, fmt, 1, d, torch.float32, 1, mode, "cpu")
    for fmt, modes in kernel_checks.SCALE_MODES.items():
        for mode in modes:
            for bits in (1, 4):
                q = partial(quant, fmt, 5, 160, torch.float32, bits, mode, "cpu")
                g = partial(guided, fmt, 5, 160, torch.float32, 4, bits, mode, "cpu")
                out[f"quant-{fmt}-{mode}-b{bits}-small-tiles"] = partial(_in_small_tiles, q)
                out[f"guided-{fmt}-{mode}-b{bits}-small-tiles"] = partial(_in_small_tiles, g)
    for bits in (1, 3):  # kv_fp4 with a record: 8 rows of 80 columns as 5 rows of one chunk (launch.whole_chunk_rows)
        out[f"quant-kv_fp4-none-b{bits}-whole-chunks"] = partial(quant, "kv_fp4", 8, 80, torch.float32, bits, "none",
                                                                 "cpu")  # fmt: skip
        # mxfp4: 8 rows of 96 columns as 6 rows of one 128-column chunk
        out[f"quant-mxfp4-none-b{bits}-whole-chunks"] = partial(quant, "mxfp4", 8, 96, torch.float32, bits, "none",
                                                                "cpu")  # fmt: skip
    for fmt in ("kv_fp4", "mxfp4"):  # 8 rows of 160 columns, chunks of 128: the last a quarter used, so as 10 rows
        # of one chunk without a record too
        q = partial(quant, fmt, 8, 160, torch.float32, 1, "none", "cpu")
        out[f"quant-{fmt}-none-b1-whole-chunks-no-record"] = partial(_whole_chunks_no_record, q)
    for fmt in ("nvfp4", "kv_fp4", "mxfp4", "mxfp4_ocp"):  # the record stored before the output (RECORD_FIRST)
        for mode in kernel_checks.SCALE_MODES[fmt]:
            for bits in (1, 4):
                q = partial(quant, fmt, 5, 512, torch.float32, bits, mode, "cpu")
                out[f"quant-{fmt}-{mode}-b{bits}-record-first"] = partial(_record_first, q)
    for bits in (1, 4):  # per-token rows of one chunk of 512 columns, and of two chunks of 256 (448 columns: the
        # second partly masked), 3 row tiles per program, each loaded before the previous is quantized
        # (launch.prefetched; the last program's last tile past the last row)
        for d, chunk in ((512, 4096), (448, 256)):
            q = partial(quant, "nvfp4", 7, d, torch.float32, bits, "per_token", "cpu")
            out[f"quant-nvfp4-per_token-b{bits}-prefetch-d{d}"] = partial(_prefetched, q, d, chunk)
    for bits in (1, 4):  # per-token rows in token groups (launch.token_groups), 7 rows (the last group partial): 1792
        # columns (two chunks of 1024, the second a quarter masked) as 2 rows per program in 7 chunks of 512 with a
        # record and 4 rows in 7 chunks of 1024 without, 3 chunks loaded ahead; 896 columns (chunks of 512) as 4 rows
        # in 7 chunks, none ahead; 1536 (chunks of 1024: 512 would give whole rows) as 2 rows in 3 chunks, 1 ahead
        for d, chunk, record_chunk, ahead in ((1792, 1024, 512, 3), (896, 512, 0, 0), (1536, 1024, 512, 1)):
            q = partial(quant, "nvfp4", 7, d, torch.float32, bits, "per_token", "cpu")
            out[f"quant-nvfp4-per_token-b{bits}-token-groups-d{d}-ahead{ahead}"] = partial(
                _token_groups, q, d, {"chunk": chunk, "group_record_chunk": record_chunk, "group_ahead": ahead}
            )
    for bits in (1, 4):  # NVFP4 K/V under the static unit S_enc: records, guided values, rows without a record
        out[f"static-kv-nvfp4-b{bits}"] = partial(kernel_checks.check_static_kv, 7, 80, torch.float32, bits, "cpu",
                                                  launch.triton_quantize_record, launch.triton_guided)  # fmt: skip
    return out


def _token_groups(fn: Callable[[], None], d: int, tile: dict[str, int]) -> None:
    # a block per thread: warps scale with the chunk
    with launch.launch_overrides({"row_chunk": tile["chunk"], "warps": tile["chunk"] // 512, **tile}):
        shape = launch.launch_shape(get_format("nvfp4"), d, per_token=True)
        for record in (True, False):
            assert launch.token_groups(7, d, shape, ScaleMode.PER_TOKEN, [], torch.device("cpu"), record)
        fn()


def _whole_chunks_no_record(fn: Callable[[], None]) -> None:
    with launch.launch_overrides({"chunk": 128, "warps": 1}):
        assert launch.whole_chunk_rows(8, 160, 128, ScaleMode.NONE, [], record=False) == 10
        fn()


def _prefetched(fn: Callable[[], None], d: int, chunk: int) -> None:
    with launch.launch_overrides({"chunk": chunk, "row_chunk": chunk, "prefetch": 256, "prefetch_loop": 3}):
        assert launch.prefetched(7, d, 1, -(-d // chunk), ScaleMode.PER_TOKEN, torch.device("cpu"))
        fn()


def _record_first(fn: Callable[[], None]) -> None:
    """Two rows of 512 columns per tile on one warp: a block per thread, so `RECORD_FIRST` holds (the tiles of the
    other cases give a block to two threads or more); the last tile partly past the last row."""
    with launch.launch_overrides({"rows": 2, "chunk": 512, "warps": 1}):
        assert launch.record_first(*launch.launch_shape(get_format("kv_fp4"), 512))
        fn()


if __name__ == "__main__":
    run_cases(cases())
