"""Run by tests/kernels/test_fp4_attention.py with TRITON_INTERPRET=1: the FP4-KV decode kernels on CPU tensors.

1. Every `fp4_attention_checks.CASES` case against SGLang's triton decode kernel (also interpreted) on the
   dequantized cache, bit for bit, and against the pure-torch twin; FP32 queries and values (the interpreter
   truncates FP32 to BF16 where GPUs round, so the BF16 twin comparison runs on the GPU only).
2. Every `EXTEND_CASES` case the same way against SGLang's triton extend kernel, bit for bit (FP32).
3. NVFP4 KV pools (E4M3 scale bytes, static unit global scale): the in-kernel E4M3 decode of every byte value
   against `torch.float8_e4m3fn`, the tile, and a few decode and extend cases as in 1. and 2.
4. End to end through the SGLang glue: a real `MHATokenToKVPoolFP4` written by its own `set_kv_buffer`, decode
   through `sglang_trace.fp4_attention.forward_decode` and extend through `forward_extend` (what patch 0020
   calls) against SGLang's path on that pool (`get_key_buffer` / `get_value_buffer`, then `decode_attention_fwd`
   / `extend_attention_fwd`), BF16 queries, bit for bit.
"""

import math
import os
from collections.abc import Callable
from functools import partial

import torch

from tests import fp4_attention_checks as checks
from tests.interpret import run_cases
from tests.sglang_cpu import install_sgl_kernel_stand_in
from trace_core.numerics.formats import NVFP4


def check_sglang_pool() -> None:
    install_sgl_kernel_stand_in()
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolFP4

    from sglang_trace import fp4_attention

    heads, group, d, layer, lens = 2, 4, 64, 1, [37, 90]
    pool = MHATokenToKVPoolFP4(size=256, page_size=1, dtype=torch.float4_e2m1fn_x2, head_num=heads, head_dim=d,
                               layer_num=2, device="cpu", enable_memory_saver=False, start_layer=0,
                               enable_alt_stream=False)  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    slots = torch.randperm(255, generator=gen)[: sum(lens)] + 1
    kv = [(torch.randn(len(slots), heads, d, generator=gen) * 3).to(torch.bfloat16) for _ in range(2)]
    pool.set_kv_buffer(None, slots, kv[0].clone(), kv[1].clone(), layer_id_override=layer)
    os.environ[fp4_attention.ENV] = "decode,extend"
    assert fp4_attention.reads_fp4(pool, "decode") and fp4_attention.reads_fp4(pool, "extend")
    small = MHATokenToKVPoolFP4(size=8, page_size=1, dtype=torch.float4_e2m1fn_x2, head_num=heads, head_dim=32,
                                layer_num=1, device="cpu", enable_memory_saver=False, start_layer=0,
                                enable_alt_stream=False)  # fmt: skip
    assert fp4_attention.reads_fp4(small, "decode") and fp4_attention.reads_fp4(small, "extend")
    q = torch.randn(len(lens), heads * group, d, generator=gen).to(torch.bfloat16)
    indptr = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    nsplit = torch.tensor([2, 3], dtype=torch.int32)
    outs = []
    for fp4 in (True, False):
        logits, lse = torch.empty(2, heads * group, 3, d), torch.empty(2, heads * group, 3)
        o = torch.full_like(q, float("nan"))
        args = (indptr, slots, logits, lse, nsplit, 3, 1 / math.sqrt(d), 1.0, 1.0)
        if fp4:
            fp4_attention.forward_decode(pool, layer, q, o, *args)
        else:
            k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
            checks.sglang_decode_attention()(q, k, v, o, *args)
        outs.append(o)
    assert torch.equal(outs[0], outs[1]), "FP4 decode through the glue differs from SGLang's path on its pool"

    # extend: request r's first lens[r] - new[r] tokens are its cached prefix, the rest are new
    new = [5, 30]
    prefix = torch.cat([slots[: lens[0] - new[0]], slots[lens[0] : sum(lens) - new[1]]])
    qo = torch.tensor([0, new[0], sum(new)], dtype=torch.int32)
    kvp = torch.tensor([0, lens[0] - new[0], sum(lens) - sum(new)], dtype=torch.int32)
    fresh = torch.cat([torch.arange(lens[0] - new[0], lens[0]), torch.arange(sum(lens) - new[1], sum(lens))])
    q = torch.randn(sum(new), heads * group, d, generator=gen).to(torch.bfloat16)
    k, v = kv[0][fresh], kv[1][fresh]
    outs = []
    for fp4 in (True, False):
        o = torch.full_like(q, float("nan"))
        args = (qo, kvp, prefix, None, True, None, max(new), 1.0, 1.0, 1 / math.sqrt(d))
        if fp4:
            fp4_attention.forward_extend(pool, layer, q, k, v, o, *args)
        else:
            kb, vb = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
            checks.sglang_extend_attention()(q, k, v, o, kb, vb, *args)
        outs.append(o)
    assert torch.equal(outs[0], outs[1]), "FP4 extend through the glue differs from SGLang's path on its pool"


NVFP4_DECODE = (0, 1, 5)
"""The `CASES` run over an NVFP4 pool here (GQA, MHA, head dim 16; the GPU test runs them all)."""
NVFP4_EXTEND = (0, 3)
"""The `EXTEND_CASES` run over an NVFP4 pool here (prefixes over one block and none, head dim 16)."""


def cases() -> dict[str, Callable[[], object]]:
    """Case id -> check (`tests.interpret`): the dequantized tile (FP32: the interpreter has no BF16 arithmetic),
    each decode and extend case, the NVFP4 pool's, then the SGLang pool end to end."""
    out: dict[str, Callable[[], object]] = {}
    for d in (16, 32, 64, 128):
        out[f"tile-{d}"] = partial(checks.check_tile, d, torch.float32, "cpu")
    for i, case in enumerate(checks.CASES):
        out[f"decode-{i}"] = partial(checks.check_decode, case, torch.float32, torch.float32, "cpu", 1e-4, 1e-4)
    for i, case in enumerate(checks.EXTEND_CASES):
        out[f"extend-{i}"] = partial(checks.check_extend, case, torch.float32, torch.float32, "cpu", 0, 0)
    out["nvfp4-e4m3-decode"] = partial(checks.check_e4m3_decode, "cpu")
    for d in (16, 64):
        out[f"nvfp4-tile-{d}"] = partial(checks.check_tile, d, torch.float32, "cpu", NVFP4)
    for i in NVFP4_DECODE:
        out[f"nvfp4-decode-{i}"] = partial(checks.check_decode, checks.CASES[i], torch.float32, torch.float32, "cpu",
                                           1e-4, 1e-4, NVFP4)  # fmt: skip
    for i in NVFP4_EXTEND:
        out[f"nvfp4-extend-{i}"] = partial(checks.check_extend, checks.EXTEND_CASES[i], torch.float32, torch.float32,
                                           "cpu", 0, 0, NVFP4)  # fmt: skip
    out["sglang-pool"] = check_sglang_pool
    return out


if __name__ == "__main__":
    run_cases(cases())
