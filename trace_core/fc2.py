"""The expert FC2-input (down-projection input) convention, shared by rollout, trainer and embedded engine.

One definition, used by SGLang's expert path (`sglang_trace.moe.fc2_input`), the trainer's site code
(`megatron_trace.sites.SiteNumerics.fc2_input`) and the embedded engine (`trace_rl.engine`):

- what is quantized: each row `act(gate) * up` `[rows, intermediate]` of one (token, routed expert) pair, before
  the top-k weight is applied (the weight multiplies the FC2 output, never the FC2 input);
- format: NVFP4 RTN (E2M1 codes, one E4M3 scale per 16 consecutive intermediate elements), quantize-dequantize;
- scale: one FP32 `S_enc = 2688 / amax` per row, where `amax` is taken over the row's FULL intermediate width. When
  the intermediate dimension is sharded (SGLang MoE tensor parallelism, Megatron expert tensor parallelism), every
  shard computes its local row amax (`row_amax`), the shards exchange it (max over the TP group) and quantize their
  columns with the global row amax, so the codes do not depend on the TP degree.

The FC2 input is not recorded (no record site): both sides round it to nearest under this convention.
"""

from __future__ import annotations

import torch

from trace_core.formats import NVFP4
from trace_core.kernels import rtn_fake_quant
from trace_core.quant import nvfp4_global_scale

FC2_INPUT_FORMAT = NVFP4


def row_amax(h: torch.Tensor) -> torch.Tensor:
    """FP32 `[rows, 1]` amax of each row of `h` `[rows, width]` (of this shard's columns)."""
    return h.detach().abs().amax(dim=-1, keepdim=True).float()


def fc2_input_fake_quant(h: torch.Tensor, full_row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """NVFP4 quantize-dequantize of FC2-input rows `h` `[rows, width]` with a per-row scale (module docstring);
    straight-through backward. `full_row_amax` `[rows, 1]`: the amax over the full intermediate width when `h`
    holds a TP shard of it (max of `row_amax` over the shards); None when `h` is the full width."""
    if full_row_amax is None:  # the kernel's per-token scale: the same S_enc from the row amax, in one pass
        return rtn_fake_quant(h, FC2_INPUT_FORMAT, per_token=True)
    if tuple(full_row_amax.shape) != (h.shape[0], 1):
        raise ValueError(f"full_row_amax must be [{h.shape[0]}, 1], got {tuple(full_row_amax.shape)}")
    return rtn_fake_quant(h, FC2_INPUT_FORMAT, global_scale=nvfp4_global_scale(full_row_amax))
