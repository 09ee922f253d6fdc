"""The expert FC2-input (down-projection input) convention, shared by rollout, trainer and embedded engine.

One definition, used by SGLang's expert path (`sglang_trace.moe.fc2_input`), the trainer's site code
(`megatron_trace.sites.SiteNumerics.fc2_input`) and the embedded engine (`trace_rl.rollout.engine`):

- what is quantized: each row `act(gate) * up` `[rows, intermediate]` of one (token, routed expert) pair, before
  the top-k weight is applied (the weight multiplies the FC2 output, never the FC2 input);
- format and scale: the recipe's `fc2_in` role (`trace_core.numerics.recipe`), round to nearest, quantize-dequantize;
- NVFP4 (`nvfp4-w4a4-kv4`): E4M3 scales per 16 along the intermediate and one FP32 `S_enc = 2688 / amax` per row,
  `amax` over the row's FULL intermediate width. When the intermediate dimension is sharded (SGLang MoE tensor
  parallelism, Megatron expert tensor parallelism), every shard computes its local row amax (`row_amax`), the
  shards exchange it (max over the TP group) and quantize their columns with the global row amax, so the codes do
  not depend on the TP degree;
- MXFP4 / MXFP8 (the `mxfp4-*` recipes): E8M0 scales per 32 elements only, local to a block, so no amax is
  exchanged across ranks (`needs_row_amax` is False; a shard boundary must fall on a 32-element block boundary).

The FC2 input is not recorded (no record site): both sides round it to nearest under this convention.
"""

from __future__ import annotations

import torch

from trace_core.numerics.recipe import Role
from trace_core.numerics.role_quant import fake_quant, needs_row_amax

__all__ = ["fc2_input_fake_quant", "needs_row_amax", "row_amax"]


def row_amax(h: torch.Tensor) -> torch.Tensor:
    """FP32 `[rows, 1]` amax of each row of `h` `[rows, width]` (of this shard's columns)."""
    return h.detach().abs().amax(dim=-1, keepdim=True).float()


def fc2_input_fake_quant(h: torch.Tensor, role: Role, full_row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize of FC2-input rows `h` `[rows, width]` under the recipe's `fc2_in` role (module
    docstring); straight-through backward. `full_row_amax` `[rows, 1]`, per-token roles only: the amax over the full
    intermediate width when `h` holds a TP shard of it (max of `row_amax` over the shards); None for the full width."""
    return fake_quant(role, h, row_amax=full_row_amax)
