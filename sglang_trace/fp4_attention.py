"""SGLang triton backend: attention straight from the FP4 KV pool (patch 0004), instead of converting the whole
layer buffer to BF16 on every call (`MHATokenToKVPoolFP4.get_key_buffer` / `get_value_buffer`, whose full-pool
temporaries also make CUDA-graph capture run out of memory at real pool sizes).

On by default over an FP4 pool, for decode and extend (prefill and chunked prefill: the cached prefix is read
from the pool, the new tokens' K/V as SGLang passes them). The environment variable `TRACE_FP4_ATTENTION` of the
server process narrows it: `off` (SGLang's dequantize-then-attend path), or a comma-separated set of `decode`,
`extend`. Any other value is refused when the backend is built, and so are backend settings the kernels do not
cover (paged KV, decode context parallelism, MLA, the deterministic unified extend kernel, speculative verify).
The kernels give SGLang's dequantize-then-attend result (`trace_core.kernels.fp4_attention`,
`fp4_extend_attention`; tests/kernels/test_fp4_attention.py); extend features they refuse (custom mask, xai temperature)
raise ValueError naming them. The pool's scale bytes are E8M0 (kv_fp4) or, under an NVFP4-KV recipe, E4M3
(`kv.pool_format`); both kernels and SGLang's dequantize path (`hooks.kv_pool_dequantize`) read them so.
"""

from __future__ import annotations

import os

import torch

from sglang_trace.kv import _layer_index, check_fp4_pool, pool_format

ENV = "TRACE_FP4_ATTENTION"
PHASES = ("decode", "extend")


def phases() -> frozenset[str]:
    """The phases that read FP4 directly over an FP4 pool (default: all); ValueError naming the variable for a
    value that is not `off` or a comma-separated set of `PHASES`."""
    value = os.environ.get(ENV, ",".join(PHASES))
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


def backend_phases(backend) -> frozenset[str]:
    """The phases a `TritonAttnBackend` runs from FP4 codes and scales (empty unless its pool is FP4); ValueError
    naming a backend setting the FP4 kernels do not cover (set `TRACE_FP4_ATTENTION=off` for SGLang's path)."""
    selected = frozenset(p for p in PHASES if reads_fp4(backend.token_to_kv_pool, p))
    if not selected:
        return selected
    problems = []
    if backend.page_size != 1:
        problems.append(f"page size {backend.page_size} (the kernels read token slots; use --page-size 1)")
    if getattr(backend, "dcp_size", 1) > 1:
        problems.append(f"decode context parallelism (dcp size {backend.dcp_size})")
    if backend.use_mla:
        problems.append("MLA")
    if "extend" in selected and backend.enable_deterministic:
        problems.append("--enable-deterministic-inference (its unified extend kernel)")
    if getattr(backend, "use_verify_splitkv", False):
        problems.append("the split-KV speculative verify path")
    if problems:
        raise ValueError(
            f"{ENV}={','.join(sorted(selected))}: the FP4-KV attention kernels do not cover " + "; ".join(problems)
        )
    return selected


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
    fp4_decode_attention(q, kc, ks, vc, vs, o, *args, kv_fmt=pool_format(), **kwargs)


def forward_extend(pool, layer_id: int, q, k, v, o, *args, **kwargs) -> None:
    """`extend_attention_fwd(q, k, v, o, k_buffer, v_buffer, *args, **kwargs)` of the triton backend with the
    layer's FP4 codes and scale bytes in place of the dequantized buffers."""
    from trace_core.kernels.fp4_extend_attention import fp4_extend_attention

    kc, ks, vc, vs = _layer_fp4(pool, layer_id)
    fp4_extend_attention(q, k, v, o, kc, ks, vc, vs, *args, kv_fmt=pool_format(), **kwargs)
