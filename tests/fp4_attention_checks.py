"""Checks of the FP4-KV decode and extend attention kernels, shared by the GPU tests and the Triton-interpreter
test on CPU.

Each case builds an FP4 pool layer (SGLang's layout: codes `[slots, heads, D/2]`, scale bytes `[slots, heads*D/16]`)
of either pool format (`kv_fp4`, or NVFP4 KV: E4M3 scale bytes under the static unit global scale) from K/V-like
values, pages a batch of requests over shuffled slots, and compares the kernel with
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
import triton
import triton.language as tl

from trace_core.kernels.fp4_attention import KV_DTYPES, _fp4_tile, fp4_decode_attention, fp4_words
from trace_core.kernels.fp4_extend_attention import fp4_extend_attention
from trace_core.numerics.e2m1 import pack_fp4
from trace_core.numerics.formats import KV_FP4, NVFP4, FP4Format
from trace_core.numerics.kv_attention import (
    decode_attention_reference,
    dequantize_kv,
    extend_attention_reference,
    extend_tiles,
)
from trace_core.numerics.quant import quantize, static_global_scale

# (kv heads, q heads per kv head, head dim, request lengths, kv splits per request, logit cap, sinks)
CASES = [
    (2, 4, 64, [5, 70, 33], [1, 2, 3], 0.0, False),  # GQA (grouped kernel), several splits, a split shorter than 32
    (2, 1, 64, [5, 70, 33], [1, 2, 3], 0.0, False),  # MHA (one head per program)
    (1, 16, 128, [100, 1], [2, 1], 30.0, True),  # 16 heads per program, logit cap, attention sinks
    (1, 32, 64, [40], [4], 0.0, False),  # more query heads per KV head than one program holds
    (1, 2, 64, [6, 9], [8, 8], 0.0, False),  # 2 query heads per KV head, requests shorter than their empty splits
    (2, 2, 16, [6, 40], [8, 2], 0.0, False),  # head dim 16: the grouped kernel pads its tile to 32 columns
]


STAND_INS = {
    "from sglang.srt.utils import is_hip\n": "is_hip = lambda: False\n",
    "from sglang.srt.utils import is_cuda, is_hip\n": "is_cuda, is_hip = torch.cuda.is_available, lambda: False\n",
    "from sglang.srt.layers.attention.triton_ops.prefill_attention import (\n    context_attention_fwd,\n)\n": "\n\n\n",
}
"""Imports of SGLang's server stack in the triton attention modules, and what stands in for them (as many lines:
the Triton interpreter re-reads a kernel's source by line number)."""


@cache
def sglang_module(relpath: str) -> types.ModuleType:
    """A module of the installed sglang wheel (`srt/...` path) loaded by file path, without running
    `sglang/__init__.py` and `sglang.srt.utils` (they import SGLang's server stack, absent from the CPU test
    install and the GPU image). Those imports are replaced by `STAND_INS` (`is_hip` is False: CUDA or the
    interpreter; `is_cuda` is whether torch sees a GPU, as SGLang's check; the extend module's unused import of
    the prefill kernel is dropped); the rest of the source runs as shipped."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("sglang==0.5.15.post1 is not installed (make setup)")
    path = Path(spec.origin).parent / relpath
    source = path.read_text()
    for line, stand_in in STAND_INS.items():
        source = source.replace(line, stand_in)
    module = types.ModuleType(f"sglang_file_{path.stem}")
    module.__file__ = str(path)
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def sglang_decode_attention():
    """SGLang's triton `decode_attention_fwd` (layers/attention/triton_ops/decode_attention.py)."""
    return sglang_module("srt/layers/attention/triton_ops/decode_attention.py").decode_attention_fwd


def sglang_extend_attention():
    """SGLang's triton `extend_attention_fwd` (layers/attention/triton_ops/extend_attention.py)."""
    return sglang_module("srt/layers/attention/triton_ops/extend_attention.py").extend_attention_fwd


def fp4_layer(
    slots: int, heads: int, d: int, gen: torch.Generator, kv_fmt: FP4Format = KV_FP4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scale bytes of one pool layer of format `kv_fmt` holding K/V-like rows (magnitudes over two
    decades per slot; NVFP4 with the static S_enc = 1)."""
    x = torch.randn(slots, heads * d, generator=gen) * torch.logspace(-1, 1, slots)[:, None]
    x[0] = 0.0  # SGLang's padding slot
    q = quantize(x, kv_fmt, **({"global_scale": static_global_scale("cpu")} if kv_fmt is NVFP4 else {}))
    return pack_fp4(q.codes).view(slots, heads, d // 2), q.scales


@triton.jit
def _tile_kernel(codes, scales, loc_ptr, out, stride_cs, stride_ch, stride_ss, head, rows, D: tl.constexpr,
                 KV_DTYPE: tl.constexpr, KV_FMT: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, 32)
    tile = _fp4_tile(codes, scales, tl.load(loc_ptr + offs), head, stride_cs, stride_ch, stride_ss, offs < rows, D, 32,
                     KV_DTYPE, 0, KV_FMT)  # fmt: skip
    tl.store(out + offs[:, None] * D + tl.arange(0, D)[None, :], tile)


def _tiles(codes, scales, head, order, rows, kv_dtype, device, kv_fmt) -> list[torch.Tensor]:
    """`_fp4_tile` of KV head `head` at the slots `order` in tiles of 32, the first with `rows` unmasked rows."""
    d = 2 * codes.shape[-1]
    kw, sw = fp4_words(codes.to(device), scales.to(device))
    out = []
    for start in range(0, len(order), 32):
        loc = order[start : start + 32]
        tile = torch.full((32, d), float("nan"), dtype=kv_dtype, device=device)
        _tile_kernel[(1,)](kw, sw, loc.to(device), tile, kw.stride(0), kw.stride(1), sw.stride(0), head,
                           rows if start == 0 else 32, D=d, KV_DTYPE=KV_DTYPES[kv_dtype],
                           KV_FMT=kv_fmt.kernel_id)  # fmt: skip
        out.append(tile.cpu())
    return out


def scale_bytes(kv_fmt: FP4Format) -> torch.Tensor:
    """Every scale byte of the format but NaN: E8M0 0..254 (0 and 1: subnormal scales and values; 254: values that
    overflow to inf), E4M3 all but 0x7F / 0xFF (subnormal, normal, signed)."""
    every = torch.arange(256, dtype=torch.uint8)
    return every[:255] if kv_fmt is KV_FP4 else every[(every & 0x7F) != 0x7F]


def check_tile(d: int, kv_dtype: torch.dtype, device: str, kv_fmt: FP4Format = KV_FP4) -> None:
    """`_fp4_tile` == `dequantize_kv` bit for bit over every slot of a 3-head pool layer of format `kv_fmt` (tiles of
    32 gathered slots, 3 of them masked in each head's first tile), random codes and every scale byte but NaN
    (`scale_bytes`)."""
    gen = torch.Generator().manual_seed(d)
    heads, slots = 3, 256
    codes = torch.randint(0, 256, (slots, heads, d // 2), dtype=torch.uint8, generator=gen)
    every = scale_bytes(kv_fmt)
    scales = every[torch.randint(0, len(every), (slots, heads * d // 16), generator=gen)]
    scales.view(-1)[: len(every)] = every
    want = dequantize_kv(codes, scales, kv_dtype, fmt=kv_fmt)
    bits = torch.int16 if kv_dtype.itemsize == 2 else torch.int32
    for head in range(heads):
        order = torch.randperm(slots, generator=gen)
        for i, tile in enumerate(_tiles(codes, scales, head, order, 29, kv_dtype, device, kv_fmt)):
            loc = order[32 * i : 32 * i + 32]
            ref = want[loc, head]
            if i == 0:
                ref[29:] = 0
            assert torch.equal(tile.view(bits), ref.view(bits)), f"d={d} head={head} slots {loc.tolist()}"


def check_e4m3_decode(device: str) -> None:
    """The tile's in-kernel E4M3 decode (`fp4_attention._scale_values`) of every byte value but the NaNs 0x7F and
    0xFF equals `torch.float8_e4m3fn`'s value bit for bit (the sign of -0 included): one head of 16 elements per
    slot, every code 1.0 (code 2), so each slot's values are its one scale byte's value."""
    every = torch.arange(256, dtype=torch.uint8)
    codes = torch.full((256, 1, 8), 0x22, dtype=torch.uint8)  # two codes 2 (E2M1 1.0) per byte
    tiles = torch.cat(_tiles(codes, every[:, None], 0, torch.arange(256), 32, torch.float32, device, NVFP4))
    want = every.view(torch.float8_e4m3fn).float()[:, None].expand(256, 16)
    finite = (every & 0x7F) != 0x7F
    assert torch.equal(tiles[finite].view(torch.int32), want[finite].view(torch.int32))


def make_case(heads, group, d, lens, splits, dtype, device, seed=0, kv_fmt: FP4Format = KV_FP4):
    gen = torch.Generator().manual_seed(seed)
    slots = sum(lens) + 7
    kc, ks = fp4_layer(slots, heads, d, gen, kv_fmt)
    vc, vs = fp4_layer(slots, heads, d, gen, kv_fmt)
    q = torch.randn(len(lens), heads * group, d, generator=gen).to(dtype)
    indices = torch.randperm(slots - 1, generator=gen)[: sum(lens)] + 1
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    nsplit = torch.tensor(splits, dtype=torch.int32)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return to(q, kc, ks, vc, vs, indptr, indices, nsplit)


def check_decode(case, dtype: torch.dtype, kv_dtype: torch.dtype, device: str, twin_rtol: float, twin_atol: float,
                 kv_fmt: FP4Format = KV_FP4):  # fmt: skip
    """Kernel == SGLang's triton decode on the dequantized cache (bit for bit), and == the twin within tolerance,
    over a pool of format `kv_fmt`."""
    decode_attention_fwd = sglang_decode_attention()
    heads, group, d, lens, splits, cap, with_sinks = case
    q, kc, ks, vc, vs, indptr, indices, nsplit = make_case(heads, group, d, lens, splits, dtype, device, 0, kv_fmt)
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
                                 logit_cap=cap, sinks=sinks, kv_dtype=kv_dtype, kv_fmt=kv_fmt)  # fmt: skip
        else:
            kb, vb = dequantize_kv(kc, ks, kv_dtype, fmt=kv_fmt), dequantize_kv(vc, vs, kv_dtype, fmt=kv_fmt)
            decode_attention_fwd(q, kb, vb, o, indptr, indices, logits, lse, nsplit, max_splits, sm, 1.0, 1.0,
                                 logit_cap=cap, sinks=sinks)  # fmt: skip
        outs.append(o)
    label = f"heads={heads} group={group} d={d} lens={lens} splits={splits} {dtype} {kv_fmt.name}"
    if group > 1 or dtype == torch.float32:  # MHA in BF16: SGLang sums q . k in BF16, the kernel in FP32
        assert torch.equal(outs[0], outs[1]), f"{label}: differs from SGLang's dequantize-then-attend path"
    ref = decode_attention_reference(q, kc, ks, vc, vs, indptr, indices, nsplit, sm, logit_cap=cap, sinks=sinks,
                                     kv_dtype=kv_dtype, kv_fmt=kv_fmt)  # fmt: skip
    torch.testing.assert_close(outs[0], ref, rtol=twin_rtol, atol=twin_atol, msg=lambda m: f"{label}: {m}")
    return (outs[0].float() - ref.float()).abs().max().item()


# (kv heads, q heads per kv head, head dim, cached prefix lengths, new-token lengths, causal, logit cap, sinks)
EXTEND_CASES = [
    (1, 2, 64, [0, 70, 5], [9, 40, 70], True, 0.0, False),  # no prefix, prefix over one key block, two query blocks
    (2, 1, 64, [33], [20], False, 30.0, True),  # MHA, bidirectional, logit cap, sinks
    (1, 2, 128, [130], [3], True, 0.0, False),  # head dim 128, short extend after a long prefix
    (2, 2, 16, [40, 0], [20, 70], True, 0.0, False),  # head dim 16: the kernel pads its tile to 32 columns on CUDA
    (1, 2, 32, [70], [33], True, 0.0, False),  # head dim 32
]


def make_extend_case(case, dtype, device, seed=0, kv_fmt: FP4Format = KV_FP4):
    """(q, k, v of the new tokens, pool codes/scales for K and V of format `kv_fmt`, qo_indptr, kv_indptr,
    kv_indices, max extend)."""
    heads, group, d, prefix, extend = case[:5]
    gen = torch.Generator().manual_seed(seed)
    slots = sum(prefix) + 7
    kc, ks = fp4_layer(slots, heads, d, gen, kv_fmt)
    vc, vs = fp4_layer(slots, heads, d, gen, kv_fmt)
    n = sum(extend)
    q = torch.randn(n, heads * group, d, generator=gen).to(dtype)
    k = (torch.randn(n, heads, d, generator=gen) * 2).to(dtype)
    v = (torch.randn(n, heads, d, generator=gen) * 2).to(dtype)
    indices = torch.randperm(slots - 1, generator=gen)[: sum(prefix)] + 1
    qo = torch.tensor([0, *torch.tensor(extend).cumsum(0).tolist()], dtype=torch.int32)
    kvp = torch.tensor([0, *torch.tensor(prefix).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    return (*to(q, k, v, kc, ks, vc, vs, qo, kvp, indices), max(extend))


def check_extend(case, dtype: torch.dtype, kv_dtype: torch.dtype, device: str, rtol: float, atol: float,
                 kv_fmt: FP4Format = KV_FP4) -> dict:  # fmt: skip
    """Kernel vs SGLang's triton extend on the dequantized cache of format `kv_fmt` (bit for bit when
    `rtol == atol == 0`, else within them) and vs the twin (within them); returns the largest differences and the
    unequal fraction vs SGLang."""
    heads, group, d, prefix, extend, causal, cap, with_sinks = case
    q, k, v, kc, ks, vc, vs, qo, kvp, indices, max_ext = make_extend_case(case, dtype, device, 0, kv_fmt)
    sinks = torch.linspace(-1, 1, heads * group, device=device) if with_sinks else None
    sm = 1 / math.sqrt(d)
    outs = []
    for fp4 in (True, False):
        o = torch.full_like(q, float("nan"))
        if fp4:
            fp4_extend_attention(q, k, v, o, kc, ks, vc, vs, qo, kvp, indices, None, causal, None, max_ext, 1.0, 1.0,
                                 sm, logit_cap=cap, sinks=sinks, kv_dtype=kv_dtype, kv_fmt=kv_fmt)  # fmt: skip
        else:
            kb, vb = dequantize_kv(kc, ks, kv_dtype, fmt=kv_fmt), dequantize_kv(vc, vs, kv_dtype, fmt=kv_fmt)
            sglang_extend_attention()(q, k, v, o, kb, vb, qo, kvp, indices, None, causal, None, max_ext, 1.0, 1.0,
                                      sm, logit_cap=cap, sinks=sinks)  # fmt: skip
        outs.append(o)
    label = f"heads={heads} group={group} d={d} prefix={prefix} extend={extend} causal={causal} {dtype} {kv_fmt.name}"
    if rtol == atol == 0:
        assert torch.equal(outs[0], outs[1]), f"{label}: differs from SGLang's dequantize-then-attend path"
    torch.testing.assert_close(outs[0], outs[1], rtol=rtol, atol=atol, msg=lambda m: f"{label} vs SGLang: {m}")
    ref = extend_attention_reference(q, k, v, kc, ks, vc, vs, qo, kvp, indices, sm, is_causal=causal, logit_cap=cap,
                                     sinks=sinks, kv_dtype=kv_dtype, kv_fmt=kv_fmt,
                                     tiles=extend_tiles(d, q.device)[:2])  # fmt: skip
    tw_rtol, tw_atol = (1e-4, 1e-4) if rtol == atol == 0 else (rtol, atol)
    torch.testing.assert_close(outs[0], ref, rtol=tw_rtol, atol=tw_atol, msg=lambda m: f"{label} vs twin: {m}")
    return {
        "max_vs_sglang": (outs[0].float() - outs[1].float()).abs().max().item(),
        "unequal_vs_sglang": (outs[0] != outs[1]).float().mean().item(),
        "max_vs_twin": (outs[0].float() - ref.float()).abs().max().item(),
    }
