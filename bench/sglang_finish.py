"""Scheduler-thread time per finished request for TRACE (`TraceCapturer.finish_request` for every request of a
result batch, then `on_batch_done`, the batched transfer into the host ring), for Qwen3-30B-A3B shapes: 48 layers,
4 KV heads of 128 in an FP4 KV pool (`MHATokenToKVPoolFP4`, sglang 0.5.10.post1), K/V sites on the latter 24
layers, MoE-input records and routes of every layer in the device record store, b = 1, one rank. The writer
thread's work is not counted (it runs off the scheduler thread); the next batch starts once the previous one's
writes finished, so queues stay short. On a CPU "device" the transfer's copies are synchronous memcpys.

    python bench/sglang_finish.py --tokens 16384 --batch 4 --device cuda     # run from the checkout to be measured
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolFP4, ReqToTokenPool
from sglang.srt.server_args import ServerArgs

from sglang_trace.capturer import TraceCapturer
from sglang_trace.config import ModelLayout, check_server_args
from sglang_trace.moe import ExpertWeights

LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, TOPK = 48, 4, 128, 2048, 8


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=10, help="result batches timed (after two warm-up batches)")
    p.add_argument("--batch", type=int, default=1, help="requests finishing in one result batch")
    p.add_argument(
        "--kv-only",
        action="store_true",
        help="time only the K/V part: the raw gather request finish now does vs the full per-site records it did",
    )
    a = p.parse_args()
    dev = torch.device(a.device)
    store = tempfile.mkdtemp()
    args = check_server_args(
        ServerArgs(model_path="dummy", trace_mode="emulate", trace_store=store, kv_cache_dtype="fp4_e2m1")
    )
    layout = ModelLayout(
        "Qwen3MoeForCausalLM", LAYERS, tuple(range(LAYERS)), tuple(range(LAYERS)), HIDDEN, KV_HEADS, HEAD_DIM, TOPK
    )
    slots = a.tokens + 1
    pool = MHATokenToKVPoolFP4(
        size=slots,
        page_size=1,
        dtype=torch.float4_e2m1fn_x2,
        head_num=KV_HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device=a.device,
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    for buf in (*pool.k_buffer, *pool.v_buffer, *pool.k_scale_buffer, *pool.v_scale_buffer):
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device=dev))
    req_pool = ReqToTokenPool(size=2, max_context_len=a.tokens + 2, device=a.device, enable_memory_saver=False)
    req_pool.req_to_token[0, : a.tokens] = torch.arange(1, a.tokens + 1, dtype=torch.int32, device=dev)
    cap = TraceCapturer(
        args,
        layout,
        kv_pool=pool,
        max_tokens=a.tokens,
        num_slots=slots + 1,
        max_request_tokens=a.tokens * max(a.batch, 2),  # the host ring holds two batches
        device=dev,
        return_routes=False,
        weights=ExpertWeights(),
    )
    # one forward wrote every position: stand in for its hooks' staging writes (what they wrote does not matter
    # for the finish path), set the hook markers where the capturer has them
    rows = a.tokens
    for site in cap.records.layouts:
        cap.records.staging_rows(site, rows)
    for j in range(len(layout.moe_layers)):
        cap.records.stage_routes(j, torch.zeros(rows, TOPK, dtype=torch.int32, device=dev))
    for i in range(getattr(cap.records, "marks", 0)):
        cap.records.mark(i, rows)
    batch = SimpleNamespace(
        forward_mode=SimpleNamespace(is_idle=lambda: False), out_cache_loc=torch.arange(1, a.tokens + 1, device=dev)
    )
    cap.on_forward_end(batch, False, None)
    if a.kv_only:
        kv_only(a, pool, req_pool, layout, cap)
        return
    times = []
    for i in range(a.requests + 2):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for j in range(a.batch):
            cap.finish_request(f"r{i}-{j}", 0, a.tokens + 1, req_pool, list(range(a.tokens + 1)))
        cap.on_batch_done()
        times.append((time.perf_counter() - t0) / a.batch)
        cap.flush()
    assert cap.stats.write_failures == 0, cap.stats
    assert cap.stats.transfers == a.requests + 2, cap.stats  # one transfer per result batch
    cap.close()
    ms = [t * 1e3 for t in times[2:]]
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                "tokens": a.tokens,
                "batch": a.batch,
                "kv_sites": 2 * len(cap.spec.attn_layers),
                "finish_ms_per_request_median": statistics.median(ms),
                "finish_ms": ms,
            }
        )
    )


def kv_only(a, pool, req_pool, layout, cap) -> None:
    """K/V work per finished request: `gather_kv_raw` (what request finish does on the scheduler thread now) vs
    `gather_kv_shard` (raw gather plus unpacking and low-bit packing, which it did before and the writer thread
    does now)."""
    from sglang_trace.kv import gather_kv_raw, gather_kv_shard, request_slots

    slots = request_slots(req_pool.req_to_token, 0, a.tokens + 1)
    layers, kinds, bits = cap.spec.attn_layers, cap.kv_kinds, cap.spec.bits
    result = {"tokens": a.tokens, "kv_sites": len(layers) * len(kinds)}
    for name, fn in (
        ("raw_gather_ms", lambda: gather_kv_raw(pool, slots, layers, kinds)),
        ("records_ms", lambda: gather_kv_shard(pool, slots, layers, kinds, bits)),
    ):
        ms = []
        for _ in range(a.requests + 1):
            t0 = time.perf_counter()
            fn()
            if slots.device.type == "cuda":
                torch.cuda.synchronize()
            ms.append((time.perf_counter() - t0) * 1e3)
        result[name] = statistics.median(ms[1:])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
