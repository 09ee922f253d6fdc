"""The quantize tiles swept per row width: `LAUNCH["quant"]` overrides that bench/record_tiles.py times against
each other and that tests check bit for bit (`test_quantize_record_on_every_swept_tile`), so a tile the sweep picks
is one the tests cover. Plain data: collecting the tests must not import triton."""

from __future__ import annotations

SWEPT_TILES: dict[int, list[dict[str, int]]] = {
    2048: [
        {},
        {"row_loop": 2},
        {"chunk": 2048, "warps": 8},
        {"prefetch": 2048},
        {"prefetch": 2048, "prefetch_loop": 2},
        {"record_regs": 0},
    ],
    4096: [{}, {"chunk": 2048, "warps": 4}, {"prefetch": 0}, {"prefetch_loop": 8}, {"record_regs": 0}],
    7168: [
        {},
        {"row_loop": 2},
        {"chunk": 2048, "warps": 4},
        {"chunk": 1024, "warps": 2},
        {"rows": 4, "chunk": 1024},
        {"row_chunk": 8192},
        {"whole_chunks": 0},
        {"token_groups": 0, "prefetch": 8192},
        {"token_groups": 0, "prefetch_loop": 2},
        {"token_groups": 0},
        {"group_record_chunk": 0},
        {"group_ahead": 1},
        {"group_ahead": 2},
        {"group_ahead": 0},
    ],
    5120: [{}, {"token_groups": 0}, {"whole_chunks": 0}],
    6144: [{}, {"token_groups": 0}, {"whole_chunks": 0}],
}
"""Row width -> `LAUNCH["quant"]` overrides to time there; the first, {}, is the default tile (`launch.launch_shape`):
2048: 1 row x 2048 columns, 4 warps; 4096: 1 x 4096, 8 warps, per-token nvfp4 with 4 row tiles per program, each
loaded before the previous is quantized (`launch.prefetched`, where the programs fill the SMs); 7168 (and 5120, 6144): 1
x 4096, 8 warps, the row in two chunks; with a record kv_fp4 takes the rows as rows of whole chunks
(`launch.whole_chunk_rows`), and per-token nvfp4 takes groups of 4 rows (2 at 6144) as whole chunks where the programs
fill the SMs (`launch.token_groups`), streamed 1 chunk ahead with a record and 3 without (`group_ahead`,
`group_ahead_plain`). The third at 2048 is the tile launched there before (8 warps: each block split between two
threads); the others split rows into more or fewer chunks, take two row tiles per program one after the other
(`row_loop`), or (`row_chunk` 8192) per-token 7168-column rows in one pass on 16 warps (loaded ahead, as at 4096).
The seventh at 7168 and the third at 5120 and 6144 keep kv_fp4's rows as they are (at 5120 and 6144 the default takes
them as rows of whole chunks without a record too). The rest concern per-token nvfp4 only: rows loaded ahead at 2048
too, or not at 4096 and 7168 (`prefetch`), by 2 or 8 row tiles per program (`prefetch_loop`), the per-token record
kernel on rows of one chunk not loaded ahead without its 40-register cap (`record_regs` 0), the row-wise kernels
instead of token groups (`token_groups` 0: rows in two chunks, the second a quarter masked at 7168, loaded ahead as
at 4096, the row's amax from the loads ahead and a quantize pass that reads x again), and token groups streamed 0, 2
or 3 chunks ahead with a record, 1 or 2 without."""
