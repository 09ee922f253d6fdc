"""`KVGather`, the finish path's one-launch gather of K/V rows from SGLang's FP4 KV pool (`sglang_trace.kv_gather`),
against its twin (`gather_kv_raw`, `kv_rows_from_raw`): under the Triton interpreter on CPU and on the GPU.

This file loads no TRACE plugin (the gather reads the pool's buffers only), so its GPU cases run in any pytest
process; `tests/sglang_cpu.py` supplies an `sgl_kernel` import stand-in where the compiled package is absent.
"""

import pytest
import torch

from tests.sglang_cpu import install_sgl_kernel_stand_in

install_sgl_kernel_stand_in()

import sglang.srt.mem_cache.memory_pool as memory_pool  # noqa: E402


@pytest.fixture(scope="module")
def kv_gather_interpreted():
    """`tests.kv_gather_interpret` (KVGather's kernel vs its twin on a real FP4 pool), run once under the
    Triton interpreter."""
    pytest.importorskip("triton")
    from tests.interpret import interpret

    return interpret("tests.kv_gather_interpret")


@pytest.mark.parametrize(
    "case",
    [
        "heads4-kv-37rows",
        "heads1-k-16rows",
        "heads3-v-5rows",
        "heads2-kv-21rows-int32-into",
        "empty",
        *(f"rows-b{b}-heads4-kv-37rows" for b in (1, 2, 3, 4)),
        "rows-b1-heads3-v-5rows",
        "rows-b2-empty",
    ],
)
def test_the_one_launch_kv_gather_equals_its_twin_under_the_interpreter(kv_gather_interpreted, case):
    kv_gather_interpreted.check(case)


@pytest.mark.gpu
def test_the_one_launch_kv_gather_equals_its_twin_on_the_gpu():
    from sglang_trace.kv import gather_kv_raw
    from sglang_trace.kv_gather import KVGather

    pool = memory_pool.MHATokenToKVPoolFP4(size=4096, page_size=1, dtype=torch.float4_e2m1fn_x2, head_num=4,
                                           head_dim=128, layer_num=6, device="cuda", enable_memory_saver=False,
                                           enable_alt_stream=False)  # fmt: skip
    for buf in (*pool.k_buffer, *pool.v_buffer, *pool.k_scale_buffer, *pool.v_scale_buffer):
        buf.random_(0, 256)
    slots = torch.randint(0, 4097, (3000,), device="cuda")
    gather = KVGather(pool, (1, 2, 5), ("k", "v"))
    assert gather.kernel
    assert torch.equal(gather(slots), gather_kv_raw(pool, slots, (1, 2, 5), ("k", "v")))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_the_one_launch_kv_record_rows_equal_their_twin_on_the_gpu(bits):
    from sglang_trace.kv import gather_kv_raw, kv_rows_from_raw
    from sglang_trace.kv_gather import KVGather

    pool = memory_pool.MHATokenToKVPoolFP4(size=4096, page_size=1, dtype=torch.float4_e2m1fn_x2, head_num=4,
                                           head_dim=128, layer_num=6, device="cuda", enable_memory_saver=False,
                                           enable_alt_stream=False)  # fmt: skip
    for buf in (*pool.k_buffer, *pool.v_buffer, *pool.k_scale_buffer, *pool.v_scale_buffer):
        buf.random_(0, 256)
    slots = torch.randint(0, 4097, (3000,), device="cuda", dtype=torch.int32)
    gather = KVGather(pool, (1, 2, 5), ("k", "v"))
    want = kv_rows_from_raw(gather_kv_raw(pool, slots, (1, 2, 5), ("k", "v")), 6, 512, bits)
    assert gather.kernel and torch.equal(gather.rows(slots, bits), want)
