"""Checks of the FP4-KV decode attention kernels, shared by the GPU tests and the Triton-interpreter test on CPU.

Each case builds an FP4 pool layer (SGLang's layout: codes `[slots, heads, D/2]`, scale bytes `[slots, heads*D/16]`)
from K/V-like values, pages a batch of requests over shuffled slots, and compares the kernel with
- SGLang's own triton `decode_attention_fwd` on the dequantized buffers (what `MHATokenToKVPoolFP4.get_key_buffer`
  hands it): equal bit for bit, same attention math on the same values (GQA; MHA in FP32 only, since in BF16
  SGLang's MHA kernel sums q . k in BF16 and the FP4 kernel in FP32);
- the pure-torch twin `decode_attention_reference`: within `TWIN_RTOL` / `TWIN_ATOL`, the FP32 sum-order and
  `exp` differences (the twin replays the kernels' blocks, splits and casts).
"""

from __future__ import annotations

import importlib.util
import math
import types
from functools import cache
from pathlib import Path

import torch

from trace_core.e2m1 import pack_fp4
from trace_core.formats import KV_FP4
from trace_core.kernels.fp4_attention import fp4_decode_attention
from trace_core.kv_attention import decode_attention_reference, dequantize_kv
from trace_core.quant import quantize

# (kv heads, q heads per kv head, head dim, request lengths, kv splits per request, logit cap, sinks)
CASES = [
    (2, 4, 64, [5, 70, 33], [1, 2, 3], 0.0, False),  # GQA (grouped kernel), several splits, a split shorter than 32
    (2, 1, 64, [5, 70, 33], [1, 2, 3], 0.0, False),  # MHA (one head per program)
    (1, 16, 128, [100, 1], [2, 1], 30.0, True),  # 16 heads per program, logit cap, attention sinks
    (1, 32, 64, [40], [4], 0.0, False),  # more query heads per KV head than one program holds
]


@cache
def sglang_module(relpath: str) -> types.ModuleType:
    """A module of the installed sglang wheel (`srt/...` path) loaded by file path, without running
    `sglang/__init__.py` and `sglang.srt.utils` (they import SGLang's server stack, absent from the CPU test
    install and the GPU image). The triton decode module's one such import, `is_hip`, is answered `False` (CUDA,
    or the interpreter); the rest of its source runs as shipped."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("sglang==0.5.10.post1 is not installed (pip install --no-deps)")
    path = Path(spec.origin).parent / relpath
    source = path.read_text().replace("from sglang.srt.utils import is_hip\n", "is_hip = lambda: False\n")
    module = types.ModuleType(f"sglang_file_{path.stem}")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def sglang_decode_attention():
    """SGLang's triton `decode_attention_fwd` (layers/attention/triton_ops/decode_attention.py)."""
    return sglang_module("srt/layers/attention/triton_ops/decode_attention.py").decode_attention_fwd


def fp4_layer(slots: int, heads: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scale bytes of one pool layer holding K/V-like rows (magnitudes over two decades per slot)."""
    x = torch.randn(slots, heads * d, generator=gen) * torch.logspace(-1, 1, slots)[:, None]
    x[0] = 0.0  # SGLang's padding slot
    q = quantize(x, KV_FP4)
    return pack_fp4(q.codes).view(slots, heads, d // 2), q.scales


def make_case(heads, group, d, lens, splits, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = sum(lens) + 7
    kc, ks = fp4_layer(slots, heads, d, gen)
    vc, vs = fp4_layer(slots, heads, d, gen)
    q = torch.randn(len(lens), heads * group, d, generator=gen).to(dtype)
    indices = torch.randperm(slots - 1, generator=gen)[: sum(lens)] + 1
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    nsplit = torch.tensor(splits, dtype=torch.int32)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return to(q, kc, ks, vc, vs, indptr, indices, nsplit)


def check_decode(case, dtype: torch.dtype, kv_dtype: torch.dtype, device: str, twin_rtol: float, twin_atol: float):
    """Kernel == SGLang's triton decode on the dequantized cache (bit for bit), and == the twin within tolerance."""
    decode_attention_fwd = sglang_decode_attention()
    heads, group, d, lens, splits, cap, with_sinks = case
    q, kc, ks, vc, vs, indptr, indices, nsplit = make_case(heads, group, d, lens, splits, dtype, device)
    b, hq, max_splits = q.shape[0], q.shape[1], max(splits)
    sinks = torch.linspace(-1, 1, hq, device=device) if with_sinks else None
    sm = 1 / math.sqrt(d)
    outs = []
    for fp4 in (True, False):
        logits = torch.full((b, hq, max_splits, d), float("nan"), device=device)
        lse = torch.full((b, hq, max_splits), float("nan"), device=device)
        o = torch.full_like(q, float("nan"))
        if fp4:
            fp4_decode_attention(q, kc, ks, vc, vs, o, indptr, indices, logits, lse, nsplit, max_splits, sm,
                                 logit_cap=cap, sinks=sinks, kv_dtype=kv_dtype)  # fmt: skip
        else:
            kb, vb = dequantize_kv(kc, ks, kv_dtype), dequantize_kv(vc, vs, kv_dtype)
            decode_attention_fwd(q, kb, vb, o, indptr, indices, logits, lse, nsplit, max_splits, sm, 1.0, 1.0,
                                 logit_cap=cap, sinks=sinks)  # fmt: skip
        outs.append(o)
    label = f"heads={heads} group={group} d={d} lens={lens} splits={splits} {dtype}"
    if group > 1 or dtype == torch.float32:  # MHA in BF16: SGLang sums q . k in BF16, the kernel in FP32
        assert torch.equal(outs[0], outs[1]), f"{label}: differs from SGLang's dequantize-then-attend path"
    ref = decode_attention_reference(q, kc, ks, vc, vs, indptr, indices, nsplit, sm, logit_cap=cap, sinks=sinks,
                                     kv_dtype=kv_dtype)  # fmt: skip
    torch.testing.assert_close(outs[0], ref, rtol=twin_rtol, atol=twin_atol, msg=lambda m: f"{label}: {m}")
    return (outs[0].float() - ref.float()).abs().max().item()
