"""Fast FP4 kernels (Triton on CUDA) behind torch custom ops; every other device runs the `trace_core` reference."""

from trace_core.kernels.ops import (
    guided_fake_quant,
    quantize_nvfp4_weight,
    quantize_record,
    record_buffers,
    rtn_fake_quant,
    triton_available,
)

__all__ = [
    "guided_fake_quant",
    "quantize_nvfp4_weight",
    "quantize_record",
    "record_buffers",
    "rtn_fake_quant",
    "triton_available",
]
