"""SGLang triton backend: attention straight from the FP4 KV pool (patch 0020), instead of converting the whole
layer buffer to BF16 on every call (`MHATokenToKVPoolFP4.get_key_buffer` / `get_value_buffer`).

Selected by the environment variable `TRACE_FP4_ATTENTION` of the server process: `off` (SGLang unchanged, the
default), or a comma-separated set of the forward phases that read FP4 directly: `decode`, `extend` (prefill and
chunked prefill: the cached prefix is read from the pool, the new tokens' K/V as SGLang passes them), e.g.
`decode,extend`. Any other value is refused when the backend is built. The kernels give SGLang's
dequantize-then-attend result (`trace_core.kernels.fp4_attention`, `fp4_extend_attention`;
tests/test_fp4_attention.py); extend features they refuse (custom mask, sliding window, xai temperature) raise
ValueError naming them.
"""

from __future__ import annotations

import os

import torch

from sglang_trace.kv import _layer_index, check_fp4_pool

ENV = "TRACE_FP4_ATTENTION"
PHASES = ("decode", "extend")


def phases() -> frozenset[str]:
    """The phases that read FP4 directly; ValueError naming the variable for a value that is not `off` or a
    comma-separated set of `PHASES`."""
    value = os.environ.get(ENV, "off")
    if value == "off":
        return frozenset()
    parts = value.split(",")
    if any(p not in PHASES for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(f"{ENV}={value!r} is not 'off' or a comma-separated set of {PHASES}")
    return frozenset(parts)


def reads_fp4(pool, phase: str) -> bool:
    """Whether `phase` attention over `pool` reads FP4 directly: `phase` selected and an FP4 pool (also the
    full-attention pool of a hybrid linear-attention model); for a selected phase, raises as `check_fp4_pool` over
    another FP4 layout and for a head dim the kernels refuse."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {PHASES}")
    if phase not in phases():
        return False
    fp4 = getattr(pool, "full_kv_pool", pool)
    if getattr(fp4, "k_scale_buffer", None) is None:
        return False
    check_fp4_pool(fp4)
    from trace_core.kernels.fp4_attention import MIN_HEAD_DIM

    d = fp4.head_dim
    if d < MIN_HEAD_DIM or d & (d - 1):
        need = f"a power-of-two head dim >= {MIN_HEAD_DIM}"
        raise ValueError(f"{ENV}: the FP4 {phase} attention kernel needs {need}, got {d}")
    return True


def _layer_fp4(pool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(K codes, K scale bytes, V codes, V scale bytes) of model layer `layer_id` in the pool."""
    fp4, local = _layer_index(pool, layer_id)
    k_codes, v_codes = fp4.k_buffer[local].view(torch.uint8), fp4.v_buffer[local].view(torch.uint8)
    return k_codes, fp4.k_scale_buffer[local], v_codes, fp4.v_scale_buffer[local]


def forward_decode(pool, layer_id: int, q: torch.Tensor, o: torch.Tensor, *args, **kwargs) -> None:
    """`decode_attention_fwd(q, k_buffer, v_buffer, o, *args, **kwargs)` of the triton backend with the layer's FP4
    codes and scale bytes in place of the dequantized buffers."""
    from trace_core.kernels.fp4_attention import fp4_decode_attention

    kc, ks, vc, vs = _layer_fp4(pool, layer_id)
    fp4_decode_attention(q, kc, ks, vc, vs, o, *args, **kwargs)


def forward_extend(pool, layer_id: int, q, k, v, o, *args, **kwargs) -> None:
    """`extend_attention_fwd(q, k, v, o, k_buffer, v_buffer, *args, **kwargs)` of the triton backend with the
    layer's FP4 codes and scale bytes in place of the dequantized buffers."""
    from trace_core.kernels.fp4_extend_attention import fp4_extend_attention

    kc, ks, vc, vs = _layer_fp4(pool, layer_id)
    fp4_extend_attention(q, k, v, o, kc, ks, vc, vs, *args, **kwargs)
