"""The finish path's K/V record rows on the GPU: `KVGather.rows` (one Triton launch a piece) against its twin
`kv_rows_from_raw(gather_kv_raw(...))` (about 80 launches a piece), at Qwen3-30B-A3B's KV shape (48 layers, 4 KV heads
of 128, every layer's K and V recorded, b = 1).

Checks the two bit for bit (b = 1..4), then queues one result batch's transfer as the capturer does: `--requests`
requests of `--tokens` tokens, in pieces of `--staging-mb` of device buffers (the capturer's `STAGING_BYTES`), each
piece's rows gathered and copied into pinned host memory on a side stream. Reports the calling thread's wall and
CPU time to queue the pieces (what the scheduler thread pays) and the time until the copies completed. The pool is
a stand-in holding `MHATokenToKVPoolFP4`'s per-layer buffers (same shapes and dtypes), so SGLang need not be
installed.

    python bench/kv_rows.py --tokens 16384 --requests 8
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: this checkout's packages

from sglang_trace.kv import gather_kv_raw, kv_row_bytes, kv_rows_from_raw
from sglang_trace.kv_gather import KVGather

LAYERS, KV_HEADS, HEAD_DIM = 48, 4, 128


def stand_in_pool(slots: int, device: str) -> SimpleNamespace:
    """`MHATokenToKVPoolFP4`'s buffers, random bytes: per layer packed codes `[slots, heads, head_dim / 2]` and scale
    bytes `[slots, heads * head_dim / 16]`, uint8."""

    def buffers(*shape: int) -> list[torch.Tensor]:
        return [torch.randint(0, 256, shape, dtype=torch.uint8, device=device) for _ in range(LAYERS)]

    rows = slots + 1
    return SimpleNamespace(
        k_buffer=buffers(rows, KV_HEADS, HEAD_DIM // 2),
        v_buffer=buffers(rows, KV_HEADS, HEAD_DIM // 2),
        k_scale_buffer=buffers(rows, KV_HEADS * HEAD_DIM // 16),
        v_scale_buffer=buffers(rows, KV_HEADS * HEAD_DIM // 16),
        store_dtype=torch.uint8,
        head_num=KV_HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        start_layer=0,
        end_layer=LAYERS,
    )


def queue_transfer(
    gather: KVGather, slots: torch.Tensor, bits: int, host: torch.Tensor, twin: bool, staging: int
) -> dict:
    """One transfer's pieces on a side stream: rows gathered into a staging buffer, copied into `host`."""
    width, sites = KV_HEADS * HEAD_DIM, 2 * LAYERS
    row = kv_row_bytes(sites, width, bits)
    per_token = row + (2 * gather.width if twin else 0)  # the twin's raw rows and temporaries, as the capturer counts
    piece = max(1, staging // per_token)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.thread_time()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for a in range(0, slots.shape[0], piece):
            part = slots[a : a + piece]
            staged = torch.empty(part.shape[0], row, dtype=torch.uint8, device=slots.device)
            if twin:
                kv_rows_from_raw(gather_kv_raw(gather.pool, part, gather.layers, gather.kinds), sites, width, bits,
                                 out=staged)  # fmt: skip
            else:
                gather.rows(part, bits, out=staged)
            host[a * row : (a + part.shape[0]) * row].view(part.shape[0], row).copy_(staged, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    queued, cpu = time.perf_counter() - t0, time.thread_time() - c0
    done.synchronize()
    total = time.perf_counter() - t0
    return {"pieces": -(-slots.shape[0] // piece), "queue_ms": 1e3 * queued, "queue_cpu_ms": 1e3 * cpu,
            "until_copied_ms": 1e3 * total, "host_GB": slots.shape[0] * row / 1e9}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--requests", type=int, default=8, help="requests finishing in one result batch")
    p.add_argument("--bits", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--staging-mb", type=int, default=512, help="device buffers of one piece (STAGING_BYTES)")
    a = p.parse_args()
    n = a.tokens * a.requests
    pool = stand_in_pool(n, "cuda")
    kinds = ("k", "v")
    gather = KVGather(pool, tuple(range(LAYERS)), kinds)
    probe = torch.randint(0, n + 1, (4096,), device="cuda", dtype=torch.int32)
    equal = {
        b: torch.equal(
            gather.rows(probe, b), kv_rows_from_raw(gather_kv_raw(pool, probe, gather.layers, kinds), 96, 512, b)
        )
        for b in (1, 2, 3, 4)
    }
    slots = torch.randperm(n, device="cuda")[:n] + 1
    host = torch.empty(n * kv_row_bytes(2 * LAYERS, KV_HEADS * HEAD_DIM, a.bits), dtype=torch.uint8, pin_memory=True)
    runs = {
        name: [queue_transfer(gather, slots, a.bits, host, twin, a.staging_mb << 20) for _ in range(a.repeats + 1)][1:]
        for name, twin in (("kernel", False), ("twin", True))
    }
    print(json.dumps({"device": torch.cuda.get_device_name(), "tokens": a.tokens, "requests": a.requests,
                      "bits": a.bits, "rows_equal_twin": equal, "runs": runs}))  # fmt: skip


if __name__ == "__main__":
    main()
