"""FP4 kernels as torch custom ops: CUDA runs the Triton kernels (`launch`), every other device the reference.

Ops (namespace `trace_core`), all on 2-D `[T, D]` inputs with a unit last stride:
- `quantize_record`: fake-quantized output and/or the record (packed low-b code bits, scale bytes, FP32 token
  scale) written into caller-provided buffers, so addresses stay fixed under CUDA-graph capture;
- `fake_quant`: RTN quantize-dequantize, straight-through backward (`kernel_rtn_fake_quant`);
- `guided_fake_quant`: guided rounding from a record, adding the redirected-element count and the code-flip count
  (guided codes whose recorded bits differ from the record's) into two counters it mutates (`guided_fake_quant`
  below attaches the straight-through backward).
They are registered with `torch.library`, so they trace under `torch.compile` and capture in CUDA graphs. Each
wrapper is the fast twin of a `trace_core.numerics` reference, bit for bit: `quantize_record` of `quant.quantize`
and `records.spec.pack_low_bits`, `kernel_rtn_fake_quant` of `guided.rtn_fake_quant`, `guided_fake_quant` of
`guided.guided_round`.
"""

from __future__ import annotations

import torch

from trace_core.kernels.launch import triton_guided, triton_quantize_record
from trace_core.metrics import low_bit_flips
from trace_core.numerics.formats import FP4Format, get_format
from trace_core.numerics.guided import GLOBAL_STATS, GuidanceStats, fallback_scale, guided_quantize, straight_through
from trace_core.numerics.quant import FLOAT_DTYPES, check_scale_args, dequantize, nvfp4_global_scale, quantize
from trace_core.numerics.recipe import Role
from trace_core.records.spec import Record, check_bits, pack_low_bits, packed_len


def _quantize_record_reference(x, fmt, bits, global_scale, per_token, out, low_bits, scales, token_scale) -> None:
    q = quantize(x, fmt, global_scale=global_scale, per_token=per_token)
    if out is not None:
        out.copy_(dequantize(q, x.dtype))
    if low_bits is not None:
        low_bits.copy_(pack_low_bits(q.codes, bits))
        scales.copy_(q.scales)
        if token_scale is not None and q.global_scale is not None:  # per-token nvfp4 (quantize_record checks)
            token_scale.copy_(q.global_scale.reshape(token_scale.shape))


@torch.library.custom_op("trace_core::quantize_record", mutates_args=("out", "low_bits", "scales", "token_scale"))
def _quantize_record_op(
    x: torch.Tensor,
    fmt: str,
    bits: int,
    global_scale: torch.Tensor | None,
    per_token: bool,
    out: torch.Tensor | None,
    low_bits: torch.Tensor | None,
    scales: torch.Tensor | None,
    token_scale: torch.Tensor | None,
) -> None:
    _quantize_record_reference(x, get_format(fmt), bits, global_scale, per_token, out, low_bits, scales, token_scale)


@_quantize_record_op.register_kernel("cuda")
def _(x, fmt, bits, global_scale, per_token, out, low_bits, scales, token_scale) -> None:
    triton_quantize_record(x, get_format(fmt), bits, global_scale, per_token, out, low_bits, scales, token_scale)


@_quantize_record_op.register_fake
def _(x, fmt, bits, global_scale, per_token, out, low_bits, scales, token_scale) -> None:
    return None


def _check_2d(x: torch.Tensor, fmt: FP4Format, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{what} must be a 2-D [T, D] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{what} dtype {x.dtype} is not supported; use one of {FLOAT_DTYPES}")
    if x.shape[1] == 0 or x.shape[1] % fmt.block:
        raise ValueError(
            f"{what} shape {tuple(x.shape)}: D must be a non-zero multiple of the {fmt.name} block {fmt.block}"
        )
    if x.stride(1) != 1:
        raise ValueError(f"{what} must have a unit last stride, got strides {x.stride()}")


def _check_buffer(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, x: torch.Tensor, name: str) -> None:
    if buf.dtype != dtype or tuple(buf.shape) != shape or buf.device != x.device:
        raise ValueError(
            f"{name} buffer must be {dtype} {shape} on {x.device}, got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
        )
    if buf.dim() == 2 and buf.stride(1) != 1:
        raise ValueError(f"{name} buffer must have a unit last stride, got strides {buf.stride()}")


def _global_scale_tensor(x: torch.Tensor, fmt: FP4Format, global_scale, per_token: bool) -> torch.Tensor | None:
    gs = check_scale_args(fmt, global_scale, per_token, (x.shape[0],), x.device)
    if fmt.has_global_scale and gs is None and not per_token:
        raise ValueError(f"{fmt.name} kernels need a static global_scale (0-d or [T, 1]) or per_token=True")
    return None if gs is None else gs.contiguous()


def record_buffers(t: int, d: int, fmt: FP4Format | str, bits: int, device, per_token: bool = False):
    """Allocate (low_bits, scales, token_scale) record buffers for `t` rows of width `d`."""
    fmt = get_format(fmt)
    low = torch.empty(t, packed_len(d, check_bits(bits)), dtype=torch.uint8, device=device)
    scales = torch.empty(t, d // fmt.block, dtype=torch.uint8, device=device)
    token = torch.empty(t, 1, dtype=torch.float32, device=device) if per_token else None
    return low, scales, token


def quantize_record(
    x: torch.Tensor,
    fmt: FP4Format | str,
    bits: int,
    *,
    global_scale: float | torch.Tensor | None = None,
    per_token: bool = False,
    out: torch.Tensor | None = None,
    low_bits: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    token_scale: torch.Tensor | None = None,
) -> None:
    """Fake-quantize `x` into `out` and/or write its record into `low_bits`, `scales` (and `token_scale` for
    per-token nvfp4). Pass `low_bits=None` for the no-record variant (uncaptured layers)."""
    fmt = get_format(fmt)
    _check_2d(x, fmt, "quantize_record input")
    gs = _global_scale_tensor(x, fmt, global_scale, per_token)
    t, d = x.shape
    if out is not None:
        _check_buffer(out, (t, d), x.dtype, x, "out")
    if low_bits is not None:
        check_bits(bits)
        if scales is None:
            raise ValueError("a record needs a scales buffer next to low_bits")
        _check_buffer(low_bits, (t, packed_len(d, bits)), torch.uint8, x, "low_bits")
        _check_buffer(scales, (t, d // fmt.block), torch.uint8, x, "scales")
        if per_token and fmt.has_global_scale:
            if token_scale is None:
                raise ValueError("a per-token nvfp4 record needs a token_scale buffer [T, 1]")
            _check_buffer(token_scale, (t, 1), torch.float32, x, "token_scale")
    elif out is None:
        raise ValueError("quantize_record has nothing to write: pass out and/or low_bits + scales")
    _quantize_record_op(x, fmt.name, bits, gs, per_token, out, low_bits, scales, token_scale)


@torch.library.custom_op("trace_core::fake_quant", mutates_args=())
def _fake_quant_op(x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None, per_token: bool) -> torch.Tensor:
    return dequantize(quantize(x, fmt, global_scale=global_scale, per_token=per_token), x.dtype)


@_fake_quant_op.register_kernel("cuda")
def _(x, fmt, global_scale, per_token):
    out = torch.empty_like(x)
    triton_quantize_record(x, get_format(fmt), 0, global_scale, per_token, out, None, None, None)
    return out


@_fake_quant_op.register_fake
def _(x, fmt, global_scale, per_token):
    return torch.empty_like(x)


def _identity_backward(ctx, grad, *rest):
    return grad, None, None, None


_fake_quant_op.register_autograd(_identity_backward)


def kernel_rtn_fake_quant(
    x: torch.Tensor, fmt: FP4Format | str, *, global_scale: float | torch.Tensor | None = None, per_token: bool = False
) -> torch.Tensor:
    """RTN quantize-dequantize of a `[T, D]` tensor with a straight-through backward through the
    `trace_core::fake_quant` op: the Triton kernel on CUDA, the reference elsewhere. The values are those of the
    reference `trace_core.numerics.guided.rtn_fake_quant`; nvfp4 without a scale takes the per-tensor one."""
    fmt = get_format(fmt)
    _check_2d(x, fmt, "kernel_rtn_fake_quant input")
    if fmt.has_global_scale and global_scale is None and not per_token:
        global_scale = quantize_global_scale(x)
    return _fake_quant_op(x.contiguous(), fmt.name, _global_scale_tensor(x, fmt, global_scale, per_token), per_token)


def quantize_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor nvfp4 `S_enc = 2688 / amax` (1 when amax is 0), as the reference computes it."""
    return nvfp4_global_scale(x.detach().abs().amax())


@torch.library.custom_op("trace_core::guided_fake_quant", mutates_args=("redirected", "flipped"))
def _guided_op(
    x: torch.Tensor,
    fmt: str,
    bits: int,
    record_bits: int,
    low_bits: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    has_record: torch.Tensor | None,
    redirected: torch.Tensor,
    flipped: torch.Tensor,
) -> torch.Tensor:
    f = get_format(fmt)
    rec = Record(fmt=f, bits=record_bits, n=x.shape[1], low_bits=low_bits, scales=scales, global_scale=global_scale)
    guided, moved = guided_quantize(x, rec, bits)
    flips = low_bit_flips(guided.codes, rec.code_bits(), record_bits)
    if has_record is not None:
        moved &= has_record.unsqueeze(-1)
        flips &= has_record.unsqueeze(-1)
    redirected += moved.sum().to(redirected.device)
    flipped += flips.sum().to(flipped.device)
    return dequantize(guided, x.dtype)


@_guided_op.register_kernel("cuda")
def _(x, fmt, bits, record_bits, low_bits, scales, global_scale, has_record, redirected, flipped):
    return triton_guided(x, fmt, bits, record_bits, low_bits, scales, global_scale, has_record, redirected, flipped)


@_guided_op.register_fake
def _(x, fmt, bits, record_bits, low_bits, scales, global_scale, has_record, redirected, flipped):
    return torch.empty_like(x)


def device_counter(count: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`count` as an int64 0-d tensor on `device` that an op can add into: `count` itself when it already is one,
    else a new tensor holding its value. The caller keeps the result in place of `count`."""
    if isinstance(count, torch.Tensor) and count.device == device and count.dtype == torch.int64 and count.dim() == 0:
        return count
    return torch.zeros((), dtype=torch.int64, device=device) + count


def guided_fake_quant(
    x: torch.Tensor,
    record: Record,
    bits: int,
    *,
    has_record: torch.Tensor | None = None,
    stats: GuidanceStats | None = None,
    role: Role | None = None,
    flipped: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kernel twin of `trace_core.numerics.guided.guided_round` for `[T, D]` inputs: same values, same fallback for
    rows without a record (the RTN of the rollout's `role`, `fallback_scale`), same counts in `stats` (default
    `GLOBAL_STATS`). `flipped` (an int64 0-d tensor on x's device, `device_counter`) gets the count of elements on
    rows with a record whose guided code differs from the record's in the bits it keeps, counted in the same pass."""
    check_bits(bits)
    if not isinstance(record, Record):
        raise ValueError(f"guided_fake_quant needs a Record, got {type(record).__name__}")
    _check_2d(x, record.fmt, "guided_fake_quant input")
    if tuple(record.shape) != tuple(x.shape):
        raise ValueError(f"record shape {tuple(record.shape)} does not match input shape {tuple(x.shape)}")
    if bits > record.bits:
        raise ValueError(f"record keeps {record.bits} code bits, cannot guide with {bits}")
    if has_record is not None and (has_record.dtype != torch.bool or tuple(has_record.shape) != (x.shape[0],)):
        raise ValueError(
            f"has_record must be bool of shape {(x.shape[0],)}, got {has_record.dtype} {tuple(has_record.shape)}"
        )
    if flipped is not None and (flipped.dtype != torch.int64 or flipped.dim() != 0 or flipped.device != x.device):
        raise ValueError(
            f"flipped must be an int64 0-d counter on {x.device}, got {flipped.dtype} {tuple(flipped.shape)} on "
            f"{flipped.device}"
        )
    stats = GLOBAL_STATS if stats is None else stats
    stats.redirected = device_counter(stats.redirected, x.device)
    gs = record.global_scale
    gs = gs.to(torch.float32).contiguous() if gs is not None else None
    value = _guided_op(
        x.detach().contiguous(),
        record.fmt.name,
        bits,
        record.bits,
        record.low_bits,
        record.scales,
        gs,
        has_record.contiguous() if has_record is not None else None,
        stats.redirected,
        device_counter(0, x.device) if flipped is None else flipped,
    )
    out = straight_through(x, value)  # the op mutates the counter, so its gradient is attached here
    fallback: int | torch.Tensor = 0
    if has_record is not None:
        # Every row gets the RTN candidate and rows without a record take it: no data-dependent shapes, so
        # nothing waits on the device (CUDA graphs, torch.compile, CPU run-ahead).
        rtn = kernel_rtn_fake_quant(x, record.fmt, **fallback_scale(record, role))
        out = torch.where(has_record.unsqueeze(-1), out, rtn)
        fallback = (~has_record).sum() * x.shape[1]
    stats.guided += x.numel() - fallback
    stats.rtn_fallback += fallback  # counts are device tensors: no host sync until they are read
    return out


def quantize_nvfp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 export of a weight `[N, K]` (blocks of 16 along K, one per-tensor global scale): packed codes
    uint8 `[N, K/2]` (element 2i in the low nibble), E4M3 scale bytes `[N, K/16]`, FP32 `S_enc` (0-d)."""
    _check_2d(w, get_format("nvfp4"), "nvfp4 weight")
    gs = quantize_global_scale(w)
    low, scales, _ = record_buffers(w.shape[0], w.shape[1], "nvfp4", 4, w.device)
    quantize_record(w.contiguous(), "nvfp4", 4, global_scale=gs, low_bits=low, scales=scales)
    return low, scales, gs
