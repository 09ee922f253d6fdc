"""The Triton kernels (trace_core.kernels): quantize-and-record, guided fake-quant, FP4-KV attention; CPU interpreter,
compiled-code and GPU checks."""
