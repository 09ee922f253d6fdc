"""Fast FP4 kernels (Triton on CUDA) behind torch custom ops; every other device runs the `trace_core` reference.

`api`: the custom ops and their wrappers; `launch`: the launch settings and the heuristics that pick a kernel;
`triton_fp4`, `triton_token_groups`: the quantize and guided kernels; `fp4_attention`, `fp4_extend_attention`:
attention over the FP4 KV pool."""

from trace_core.kernels.api import (
    guided_fake_quant,
    kernel_rtn_fake_quant,
    quantize_nvfp4_weight,
    quantize_record,
    record_buffers,
)
from trace_core.kernels.launch import triton_available

__all__ = [
    "guided_fake_quant",
    "kernel_rtn_fake_quant",
    "quantize_nvfp4_weight",
    "quantize_record",
    "record_buffers",
    "triton_available",
]
