"""Run by tests/test_kernels.py with TRITON_INTERPRET=1: the Triton kernels on CPU tensors against the reference.

The interpreter converts FP32 to BF16 by truncation, whereas GPUs round to nearest even, so BF16 *outputs* are
checked on the GPU only; BF16 inputs and their records are checked here."""

import torch

from tests import kernel_checks
from trace_core.kernels import ops


def main() -> None:
    n = 0
    for fmt, modes in kernel_checks.SCALE_MODES.items():
        d = 80 if fmt in ("nvfp4", "kv_fp4") else 96  # not a multiple of the kernel chunk
        for mode in modes:
            for dtype in (torch.float32, torch.float16):
                for bits in (1, 2, 3, 4):
                    kernel_checks.check_quantize_record(fmt, 6, d, dtype, bits, mode, "cpu", ops.triton_quantize_record)
                    kernel_checks.check_guided(fmt, 6, d, dtype, bits, bits, mode, "cpu", ops.triton_guided)
                    n += 2
            kernel_checks.check_guided(fmt, 5, d, torch.float32, 4, 1, mode, "cpu", ops.triton_guided)
            kernel_checks.check_quantize_record(fmt, 1, d, torch.float32, 1, mode, "cpu", ops.triton_quantize_record)
            n += 2
    # small tiles: several chunks per row (the last one partly masked), and per-token nvfp4 rows wider than one
    # tile (a first pass for the row amax), as on the GPU for rows wider than LAUNCH["quant"]["row_chunk"]
    saved = {k: dict(v) for k, v in ops.LAUNCH.items()}
    try:
        ops.LAUNCH["quant"].update(rows=2, chunk=32, row_chunk=32)
        ops.LAUNCH["guided"].update(rows=2, chunk=32)
        for fmt, modes in kernel_checks.SCALE_MODES.items():
            for mode in modes:
                for bits in (1, 4):
                    kernel_checks.check_quantize_record(fmt, 5, 160, torch.float32, bits, mode, "cpu",
                                                        ops.triton_quantize_record)  # fmt: skip
                    kernel_checks.check_guided(fmt, 5, 160, torch.float32, 4, bits, mode, "cpu", ops.triton_guided)
                    n += 2
    finally:
        ops.LAUNCH.clear()
        ops.LAUNCH.update(saved)
    print(f"checked {n} kernel configurations")


if __name__ == "__main__":
    main()
