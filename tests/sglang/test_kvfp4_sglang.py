"""KV_FP4 against SGLang's own `BlockFP4KVQuantizeUtil` (sglang 0.5.15.post1), bit for bit: the quantizer
`MHATokenToKVPoolFP4.set_kv_buffer` calls for `--kv-cache-dtype fp4_e2m1` (0.5.10's `KVFP4QuantizeUtil`), run as
SGLang runs it (`torch.compile`'d). SGLang is imported as the rest of the SGLang suite imports it (its CPU deps,
the `sgl_kernel` stand-in where the compiled package is absent): a broken SGLang import fails here, it does not
skip.
"""

import pytest
import torch

from tests.sglang_cpu import install_sgl_kernel_stand_in
from trace_core.numerics.e2m1 import pack_fp4, unpack_fp4
from trace_core.numerics.formats import KV_FP4
from trace_core.numerics.quant import Quantized, dequantize, quantize

install_sgl_kernel_stand_in()


@pytest.fixture(scope="module")
def sglang_kvfp4():
    from sglang.srt.layers.quantization.kvfp4_tensor import BlockFP4KVQuantizeUtil

    return BlockFP4KVQuantizeUtil


def kv_like(dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """[tokens, heads, head_dim] K/V-like values over twelve decades, with zero, -0 and boundary blocks."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(96, 4, 128, generator=gen) * torch.logspace(-4, 4, 96).view(96, 1, 1)
    x[0, 0, :16] = 0.0
    x[1, 0, :16] = -0.0
    x[2, 0, :8] = torch.tensor([6.0, 0.25, 0.75, 2.5, 5.0, -1.25, -3.5, -0.1])
    x[3, 1, :16] = 1.5 * 2.0 ** torch.arange(-8, 8, dtype=torch.float32)  # amax/6 at exact powers of two
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    return x.to(dtype).to(device)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kv_fp4_matches_sglang_bit_for_bit(sglang_kvfp4, dtype):
    x = kv_like(dtype)
    packed, scales = sglang_kvfp4.batched_quantize(x)
    q = quantize(x, KV_FP4)
    assert torch.equal(pack_fp4(q.codes), packed)
    assert torch.equal(q.scales.reshape(x.shape[0], -1), scales)
    ours = Quantized(codes=unpack_fp4(packed), scales=scales.reshape(q.scales.shape), global_scale=None, fmt=KV_FP4)
    assert torch.equal(dequantize(ours, dtype), sglang_kvfp4.batched_dequantize(packed, scales, dtype))


@pytest.mark.gpu
def test_kv_fp4_matches_sglang_on_gpu(sglang_kvfp4):
    x = kv_like(torch.bfloat16, "cuda")
    packed, scales = sglang_kvfp4.batched_quantize(x)
    q = quantize(x, KV_FP4)
    assert torch.equal(pack_fp4(q.codes), packed) and torch.equal(q.scales.reshape(x.shape[0], -1), scales)
