"""Run by tests/sglang/test_sglang_kv.py with TRITON_INTERPRET=1: `KVGather`'s kernels on a real `MHATokenToKVPoolFP4`
(CPU tensors) against their pure-torch twins, byte for byte: the raw gather against `gather_kv_raw`, the record rows
(`KVGather.rows`) against `kv_rows_from_raw` of it."""

import torch

from tests.interpret import run_cases
from tests.sglang_cpu import install_sgl_kernel_stand_in


def check(heads: int, layers: tuple[int, ...], kinds: tuple[str, ...], rows: int, into: bool = False) -> None:
    """`into`: int32 slots (SGLang's `req_to_token` dtype), written into a view of a larger buffer, as the finish
    path's transfer does."""
    install_sgl_kernel_stand_in()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolFP4

    from sglang_trace.kv import gather_kv_raw
    from sglang_trace.kv_gather import KVGather

    pool = MHATokenToKVPoolFP4(size=100, page_size=1, dtype=torch.float4_e2m1fn_x2, head_num=heads, head_dim=32,
                               layer_num=4, device="cpu", enable_memory_saver=False,
                               enable_alt_stream=False)  # fmt: skip
    gen = torch.Generator().manual_seed(heads * 100 + rows)
    for buf in (*pool.k_buffer, *pool.v_buffer, *pool.k_scale_buffer, *pool.v_scale_buffer):
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    slots = torch.randint(0, 101, (rows,), generator=gen)
    gather = KVGather(pool, layers, kinds, kernel=True)
    if into:
        buffer = torch.full((rows * gather.width + 7,), 0xAB, dtype=torch.uint8)
        got = gather(slots.int(), out=buffer[:-7].view(rows, gather.width))
        assert got.data_ptr() == buffer.data_ptr() and bool((buffer[-7:] == 0xAB).all())
    else:
        got = gather(slots)
    want = gather_kv_raw(pool, slots, layers, kinds)
    assert got.dtype == want.dtype and torch.equal(got, want), (got.shape, want.shape)


def check_rows(heads: int, layers: tuple[int, ...], kinds: tuple[str, ...], rows: int, bits: int) -> None:
    """`KVGather.rows` (one launch: each code's low `bits`, then the scales) into a view of a larger buffer, as the
    finish path's piece does, against `kv_rows_from_raw(gather_kv_raw(...))`."""
    install_sgl_kernel_stand_in()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolFP4

    from sglang_trace.kv import gather_kv_raw, kv_rows_from_raw
    from sglang_trace.kv_gather import KVGather

    pool = MHATokenToKVPoolFP4(size=100, page_size=1, dtype=torch.float4_e2m1fn_x2, head_num=heads, head_dim=32,
                               layer_num=4, device="cpu", enable_memory_saver=False,
                               enable_alt_stream=False)  # fmt: skip
    gen = torch.Generator().manual_seed(heads * 1000 + rows * 10 + bits)
    for buf in (*pool.k_buffer, *pool.v_buffer, *pool.k_scale_buffer, *pool.v_scale_buffer):
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
    slots = torch.randint(0, 101, (rows,), generator=gen).int()
    want = kv_rows_from_raw(gather_kv_raw(pool, slots, layers, kinds), len(layers) * len(kinds), heads * 32, bits)
    buffer = torch.full((want.numel() + 5,), 0xAB, dtype=torch.uint8)
    got = KVGather(pool, layers, kinds, kernel=True).rows(slots, bits, out=buffer[:-5].view(want.shape))
    assert torch.equal(got, want) and bool((buffer[-5:] == 0xAB).all()), (bits, got.shape, want.shape)


def cases() -> dict:
    return {
        "heads4-kv-37rows": lambda: check(4, (1, 3), ("k", "v"), 37),
        "heads1-k-16rows": lambda: check(1, (0,), ("k",), 16),
        "heads3-v-5rows": lambda: check(3, (2, 0, 3), ("v",), 5),  # widths 48 and 6: not powers of two
        "heads2-kv-21rows-int32-into": lambda: check(2, (0, 3), ("k", "v"), 21, into=True),
        "empty": lambda: check(2, (1,), ("k", "v"), 0),
        **{f"rows-b{b}-heads4-kv-37rows": lambda b=b: check_rows(4, (1, 3), ("k", "v"), 37, b) for b in (1, 2, 3, 4)},
        "rows-b1-heads3-v-5rows": lambda: check_rows(3, (2, 0, 3), ("v",), 5, 1),
        "rows-b2-empty": lambda: check_rows(2, (1,), ("k", "v"), 0, 2),
    }


if __name__ == "__main__":
    run_cases(cases())
