"""TRACE core: engine-agnostic FP4 numerics, records and metrics shared by the rollout and trainer sides."""

from trace_core.numerics.formats import KV_FP4, MXFP4, MXFP4_OCP, NVFP4, FP4Format, get_format
from trace_core.numerics.guided import GuidanceStats, guided_round, rtn_fake_quant
from trace_core.numerics.quant import Quantized, decode_scales, dequantize, quantize
from trace_core.records.spec import Record, RecordSpec, bytes_per_token, pack_low_bits, unpack_low_bits

__all__ = [
    "FP4Format",
    "GuidanceStats",
    "KV_FP4",
    "MXFP4",
    "MXFP4_OCP",
    "NVFP4",
    "Quantized",
    "Record",
    "RecordSpec",
    "bytes_per_token",
    "decode_scales",
    "dequantize",
    "get_format",
    "guided_round",
    "pack_low_bits",
    "quantize",
    "rtn_fake_quant",
    "unpack_low_bits",
]
