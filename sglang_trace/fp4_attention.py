"""SGLang triton backend: decode attention straight from the FP4 KV pool (patch 0020), instead of converting the
whole layer buffer to BF16 on every call (`MHATokenToKVPoolFP4.get_key_buffer` / `get_value_buffer`).

Selected by the environment variable `TRACE_FP4_ATTENTION` of the server process: `decode` (read FP4 directly in
decode forwards) or `off` (SGLang unchanged, the default); any other value is refused when the backend is built.
Extend (prefill) forwards keep SGLang's path. The kernels give the same result as SGLang's dequantize-then-attend
decode path (`trace_core.kernels.fp4_attention`; tests/test_fp4_attention.py)."""

from __future__ import annotations

import os

import torch

from sglang_trace.kv import _layer_index, check_fp4_pool

ENV = "TRACE_FP4_ATTENTION"
MODES = ("off", "decode")


def mode() -> str:
    """The selected mode; ValueError naming the variable for an unknown value."""
    value = os.environ.get(ENV, "off")
    if value not in MODES:
        raise ValueError(f"{ENV}={value!r} is not one of {MODES}")
    return value


def reads_fp4(pool) -> bool:
    """Whether decode attention over `pool` reads FP4 directly: mode `decode` and an FP4 pool (also the full-attention
    pool of a hybrid linear-attention model); raises as `check_fp4_pool` for `decode` over another FP4 layout."""
    if mode() != "decode":
        return False
    fp4 = getattr(pool, "full_kv_pool", pool)
    if getattr(fp4, "k_scale_buffer", None) is None:
        return False
    check_fp4_pool(fp4)
    return True


def forward_decode(pool, layer_id: int, q: torch.Tensor, o: torch.Tensor, *args, **kwargs) -> None:
    """`decode_attention_fwd(q, k_buffer, v_buffer, o, *args, **kwargs)` of the triton backend with the layer's FP4
    codes and scale bytes in place of the dequantized buffers."""
    from trace_core.kernels.fp4_attention import fp4_decode_attention

    fp4, local = _layer_index(pool, layer_id)
    k_codes, v_codes = fp4.k_buffer[local].view(torch.uint8), fp4.v_buffer[local].view(torch.uint8)
    fp4_decode_attention(q, k_codes, fp4.k_scale_buffer[local], v_codes, fp4.v_scale_buffer[local], o, *args, **kwargs)
