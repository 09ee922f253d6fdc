"""One-launch gather of a result batch's raw K/V bytes out of SGLang's FP4 KV pool (the finish path's K/V work on
the scheduler thread).

`sglang_trace.kv.gather_kv_raw`, the pure-torch twin, runs two index ops per (layer, K/V) site and one
concatenation: 193 launches per result batch for Qwen3-30B-A3B's 48 layers, each a few microseconds of scheduler
CPU time. `KVGather` does the same copy in one Triton launch: a table of the per-layer buffers' device addresses,
built once (SGLang allocates its KV pool once, at start-up), and a kernel that copies row `slots[i]` of every
buffer into row i of the output, in `gather_kv_raw`'s column order. It is a byte copy, so bit-identical to the twin
(`tests/sglang/test_sglang_kv.py` runs it under the Triton interpreter; the GPU bench checks it on the device).

`KVGather.rows` gathers the finish path's K/V record rows in one launch as well: per site the low b bits of each
code (`pack_low_bits` order) and the scale bytes, `kv_rows_from_raw(gather_kv_raw(...))` without the raw rows and
the twin's ~13 launches per group of sites (a transfer's pieces queue their launches on the copy stream, where a long
queue makes the scheduler thread wait for the host link).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_trace.kv import KV_BLOCK, _layer_index, check_fp4_pool, gather_kv_raw, kv_row_bytes, kv_rows_from_raw
from trace_core.records.spec import check_bits, packed_len

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines without triton use the twin (`KVGather.kernel` is False there)
    triton = None

ROWS_PER_PROGRAM = 16

if triton is not None:

    @triton.jit
    def _kv_gather_kernel(ptrs, widths, offsets, slots, out, n_rows, out_stride, BR: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        entry = tl.program_id(1)
        base = tl.load(ptrs + entry).to(tl.pointer_type(tl.uint8))
        width = tl.load(widths + entry)
        col0 = tl.load(offsets + entry)
        cols = tl.arange(0, BLOCK)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & (cols[None, :] < width)
        slot = tl.load(slots + rows, mask=row_ok, other=0).to(tl.int64)
        values = tl.load(base + slot[:, None] * width + cols[None, :], mask=mask)
        tl.store(out + rows[:, None].to(tl.int64) * out_stride + col0 + cols[None, :], values, mask=mask)

    @triton.jit
    def _kv_rows_kernel(
        ptrs, widths, offsets, packs, slots, out, n_rows, out_stride, BITS: tl.constexpr, BR: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        # entry = one buffer of one site: packed codes (pack 1: keep each code's low BITS) or scale bytes (copied)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        entry = tl.program_id(1)
        base = tl.load(ptrs + entry).to(tl.pointer_type(tl.uint8))
        width = tl.load(widths + entry)
        col0 = tl.load(offsets + entry)
        flag = tl.load(packs + entry)
        pack, copy = flag != 0, flag == 0
        cols = tl.arange(0, BLOCK)
        row_ok = rows < n_rows
        slot = tl.load(slots + rows, mask=row_ok, other=0).to(tl.int64)
        src = base + slot[:, None] * width
        out_width = tl.where(pack, width // 4 * BITS, width)
        mask = row_ok[:, None] & (cols[None, :] < out_width)
        copied = tl.load(src + cols[None, :], mask=mask & copy, other=0).to(tl.int32)
        # output byte o of a code buffer: byte o % BITS of group o // BITS, the 8 codes of input bytes 4g .. 4g + 3
        # (first code in the low nibble), each code's low BITS at stream bit BITS * code (little-endian)
        group = cols // BITS
        v = tl.zeros([BR, BLOCK], dtype=tl.int32)
        for k in tl.static_range(4):
            b = tl.load(src + (4 * group + k)[None, :], mask=mask & pack, other=0).to(tl.int32)
            code_bits = (b & ((1 << BITS) - 1)) | (((b >> 4) & ((1 << BITS) - 1)) << BITS)
            v = v | (code_bits << (2 * BITS * k))
        packed = (v >> (8 * (cols % BITS))[None, :]) & 255
        values = tl.where(pack, packed, copied).to(tl.uint8)
        tl.store(out + rows[:, None].to(tl.int64) * out_stride + col0 + cols[None, :], values, mask=mask)


class KVGather:
    """`gather_kv_raw(pool, slots, layers, kinds)` for a fixed pool and site list, in one kernel launch on CUDA.

    Args:
        pool: SGLang's FP4 KV pool (`MHATokenToKVPoolFP4`, or a `HybridLinearKVPool` holding one).
        layers, kinds: the recorded attention layers and K/V kinds (the output's column order).
        kernel: run the Triton kernel (default: on CUDA); False runs the twin, `gather_kv_raw`.
    """

    def __init__(self, pool, layers: Sequence[int], kinds: Sequence[str], *, kernel: bool | None = None) -> None:
        check_fp4_pool(getattr(pool, "full_kv_pool", pool))
        self.pool, self.layers, self.kinds = pool, tuple(layers), tuple(kinds)
        buffers = []
        for layer in self.layers:
            fp4, local = _layer_index(pool, layer)
            for kind in self.kinds:
                buffers.append((fp4.k_buffer if kind == "k" else fp4.v_buffer)[local])
                buffers.append((fp4.k_scale_buffer if kind == "k" else fp4.v_scale_buffer)[local])
        for buf in buffers:
            if buf.dtype != torch.uint8 or not buf.is_contiguous():
                raise ValueError(f"KV buffers must be contiguous uint8, got {buf.dtype} strides {buf.stride()}")
        self.device = buffers[0].device
        self.kernel = self.device.type == "cuda" and triton is not None if kernel is None else kernel
        if self.kernel and triton is None:
            raise ValueError("KVGather(kernel=True) needs triton")
        widths = [buf[0].numel() for buf in buffers]
        self.width = sum(widths)
        self._buffers = buffers  # the address table below points into them
        self._ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=self.device)
        self._widths = torch.tensor(widths, dtype=torch.int32, device=self.device)
        self._offsets = torch.tensor(
            [sum(widths[:i]) for i in range(len(widths))], dtype=torch.int64, device=self.device
        )
        self._block = 1 << max(0, (max(widths) - 1).bit_length())
        self._rows_tables: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # bits -> (columns, packs, BLOCK)

    def _queued(self, table: torch.Tensor) -> torch.Tensor:
        """`table` on the device, its copy queued on the current stream from pinned memory on CUDA: a pageable copy
        would block the calling thread until that stream got to it (on the finish path, the copy stream waiting
        behind the forward: the scheduler thread held for a forward, and the fence never needed)."""
        if self.device.type != "cuda":
            return table.to(self.device)
        return table.pin_memory().to(self.device, non_blocking=True)

    def __call__(self, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 `[len(slots), width]`: the raw K/V bytes of every site at `slots` (int32 or int64 valid KV slots:
        rows of SGLang's `req_to_token`), on the pool's device; written into `out` (contiguous) when given."""
        if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be a 1-D int tensor, got {slots.dtype} {tuple(slots.shape)}")
        if out is not None and (out.shape != (slots.shape[0], self.width) or not out.is_contiguous()):
            raise ValueError(f"out must be contiguous [{slots.shape[0]}, {self.width}], got {tuple(out.shape)}")
        if not self.kernel:
            raw = gather_kv_raw(self.pool, slots, self.layers, self.kinds)
            return raw if out is None else out.copy_(raw)
        slots = slots.to(self.device).contiguous()  # the kernel reads slots[i] by address
        if out is None:
            out = torch.empty(slots.shape[0], self.width, dtype=torch.uint8, device=self.device)
        if slots.shape[0]:
            grid = (triton.cdiv(slots.shape[0], ROWS_PER_PROGRAM), len(self._buffers))
            _kv_gather_kernel[grid](
                self._ptrs,
                self._widths,
                self._offsets,
                slots,
                out,
                slots.shape[0],
                out.stride(0),
                BR=ROWS_PER_PROGRAM,
                BLOCK=self._block,
            )
        return out

    def rows(self, slots: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 `[len(slots), kv_row_bytes]`: the K/V record rows at `slots` (`kv_rows_from_raw` of `self(slots)`:
        per site the low `bits` of each code, then its scale bytes), in one kernel launch on CUDA (the twin
        elsewhere); written into `out` (contiguous) when given."""
        check_bits(bits)
        sites = len(self._buffers) // 2
        width = 2 * self._buffers[0][0].numel()  # elements per site row (two codes a byte, the same for every site)
        row_width = kv_row_bytes(sites, width, bits)
        if out is not None and (out.shape != (slots.shape[0], row_width) or not out.is_contiguous()):
            raise ValueError(f"out must be contiguous [{slots.shape[0]}, {row_width}], got {tuple(out.shape)}")
        if not self.kernel:
            return kv_rows_from_raw(self(slots), sites, width, bits, out=out)
        if bits not in self._rows_tables:
            low, scales = packed_len(width, bits), width // KV_BLOCK
            columns = [i // 2 * (low + scales) + (low if i % 2 else 0) for i in range(len(self._buffers))]
            packs = [1 - i % 2 for i in range(len(self._buffers))]
            self._rows_tables[bits] = (
                self._queued(torch.tensor(columns, dtype=torch.int64)),
                self._queued(torch.tensor(packs, dtype=torch.int32)),
                1 << max(0, (max(low, scales) - 1).bit_length()),
            )
        table_offsets, table_packs, block = self._rows_tables[bits]
        slots = slots.to(self.device).contiguous()
        if out is None:
            out = torch.empty(slots.shape[0], row_width, dtype=torch.uint8, device=self.device)
        if slots.shape[0]:
            grid = (triton.cdiv(slots.shape[0], ROWS_PER_PROGRAM), len(self._buffers))
            _kv_rows_kernel[grid](
                self._ptrs, self._widths, table_offsets, table_packs, slots, out, slots.shape[0], out.stride(0),
                BITS=bits, BR=ROWS_PER_PROGRAM, BLOCK=block,
            )  # fmt: skip
        return out
