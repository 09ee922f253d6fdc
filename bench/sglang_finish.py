"""Scheduler-thread time per finished request for TRACE (`TraceCapturer.finish_request` for every request of a
result batch, then `on_batch_done`, the batched transfer into the host ring: wall time until control returns to
the scheduler, the device idle at the start), for Qwen3-30B-A3B shapes: 48 layers, 4 KV heads of 128 in an FP4 KV
pool (`MHATokenToKVPoolFP4`, the installed sglang), the default `--trace-layers` and `--trace-sites` (MoE-input
records and K/V of the recorded layers, routes of every layer), b = 1, one rank. The writer thread's work and the
asynchronous copy are not counted in it (they run off the scheduler thread); `writer_MBps` is the host bytes of a
batch over the writer thread's own time on it (`TraceStats.write_s`: check, merge, unpack, compress, write). The next
batch starts once the previous one's writes finished, so queues stay short. On a CPU "device" the transfer's copies
are synchronous memcpys.
`--kv-gather torch` times the K/V gather as per-site index ops (`gather_kv_raw`) instead of `KVGather`'s one launch.

    python bench/sglang_finish.py --tokens 16384 --batch 4 --device cuda     # run from the checkout to be measured
    python bench/sglang_finish.py --shape tiny --tokens 8 --batch 28 --device cpu  # the live RL runs' tiny model

The KV pool, request pool and KV allocator are SGLang's own (`MHATokenToKVPoolFP4`, `ReqToTokenPool`,
`TokenToKVPoolAllocator` under the capturer's `SlotFence`), as on a server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import device_name, sync
from sglang_trace.config import SERVER_ARGS_FIELDS, ModelLayout, TraceArgs, parse_layers, parse_sites

# --shape: (layers, KV heads, head dim, hidden, top-k); `tiny` is the live RL runs' model (`trace-rl make-model`)
SHAPES = {"qwen3-30b-a3b": (48, 4, 128, 2048, 8), "tiny": (2, 2, 16, 64, 2)}


def sglang_parts(tokens: int, device: str, layers: int, kv_heads: int, head_dim: int):
    """SGLang's FP4 KV pool of `tokens` slots, a request pool for requests of `tokens + 1` ids, and the KV allocator
    over the pool (`TokenToKVPoolAllocator`), with the installed version."""
    import sglang
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolFP4, ReqToTokenPool

    pool = MHATokenToKVPoolFP4(size=tokens + 1, page_size=1, dtype=torch.float4_e2m1fn_x2, head_num=kv_heads,
                               head_dim=head_dim, layer_num=layers, device=device, enable_memory_saver=False,
                               enable_alt_stream=False)  # fmt: skip
    req_pool = ReqToTokenPool(size=2, max_context_len=tokens + 2, device=device, enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(tokens + 1, torch.float4_e2m1fn_x2, device, pool, need_sort=False)
    return f"sglang {sglang.__version__}", pool, req_pool, allocator


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-30b-a3b", help="the model's layers and widths")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=10, help="result batches timed (after one warm-up batch)")
    p.add_argument("--batch", type=int, default=1, help="requests finishing in one result batch")
    p.add_argument("--sites", default=str(SERVER_ARGS_FIELDS["trace_sites"]), help="--trace-sites of the capturer")
    p.add_argument("--store-dir", help="where the record store is written (default: the system temp dir)")
    p.add_argument("--kv-gather", choices=("kernel", "torch"), default="kernel", help="K/V gather on the device")
    p.add_argument(
        "--kv-only",
        action="store_true",
        help="time only the K/V part: the raw gather request finish now does vs the full per-site records it did",
    )
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.store_dir) as store:  # the record store, removed after the run
        bench(a, store)


def bench(a: argparse.Namespace, store: str) -> None:
    """Time the finish path of `a`'s shape and batches, writing the records into `store`."""
    dev = torch.device(a.device)
    from sglang_trace.capturer import TraceCapturer, record_bytes_per_slot
    from sglang_trace.config import model_spec
    from sglang_trace.kv import gather_kv_raw, kv_row_bytes
    from sglang_trace.kv_gather import KVGather
    from sglang_trace.moe import ExpertWeights
    from sglang_trace.slot_fence import SlotFence

    defaults = SERVER_ARGS_FIELDS
    args = TraceArgs(
        mode="emulate",
        bits=int(defaults["trace_record_bits"]),
        layers=parse_layers(str(defaults["trace_layers"])),
        sites=parse_sites(a.sites),
        store=store,
        step=0,
    )
    layers, kv_heads, head_dim, hidden, topk = SHAPES[a.shape]
    layout = ModelLayout(
        "Qwen3MoeForCausalLM", layers, tuple(range(layers)), tuple(range(layers)), hidden, kv_heads, head_dim, topk
    )
    kv_sites = len(model_spec(args, layout).attn_layers) * 2
    token_bytes = kv_row_bytes(kv_sites, kv_heads * head_dim, args.bits) + record_bytes_per_slot(args, layout)
    slots = a.tokens + 1
    ran, pool, req_pool, allocator = sglang_parts(a.tokens, a.device, layers, kv_heads, head_dim)
    for buf in (*pool.k_buffer, *pool.v_buffer, *pool.k_scale_buffer, *pool.v_scale_buffer):
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, device=dev))
    req_pool.req_to_token[0, : a.tokens] = torch.arange(1, a.tokens + 1, dtype=torch.int32, device=dev)
    cap = TraceCapturer(
        args,
        layout,
        kv_pool=pool,
        max_tokens=a.tokens,
        num_slots=slots + 1,
        max_request_tokens=a.tokens,
        device=dev,
        return_routes=False,
        weights=ExpertWeights(),
        host_ring_bytes=a.batch * a.tokens * token_bytes,  # one result batch (the bench flushes between batches)
        fence=SlotFence(allocator),
    )
    if a.kv_gather == "torch":
        cap.kv_gather = KVGather(pool, cap.spec.attn_layers, cap.kv_kinds, kernel=False)
    probe = torch.randint(1, slots, (4096,), device=dev, dtype=torch.int32)  # req_to_token's dtype
    kv_equal = cap.kv_gather is None or torch.equal(
        cap.kv_gather(probe), gather_kv_raw(pool, probe, cap.spec.attn_layers, cap.kv_kinds)
    )
    # one forward wrote every position: stand in for its hooks' staging writes (what they wrote does not matter
    # for the finish path), set the hook markers where the capturer has them
    rows = a.tokens
    for site in cap.records.layouts:
        cap.records.staging_rows(site, rows)
    for j in range(len(layout.moe_layers)):
        cap.records.stage_routes(j, torch.zeros(rows, topk, dtype=torch.int32, device=dev))
    for i in range(getattr(cap.records, "marks", 0)):
        cap.records.mark(i, rows)
    batch = SimpleNamespace(
        forward_mode=SimpleNamespace(is_idle=lambda: False), out_cache_loc=torch.arange(1, a.tokens + 1, device=dev)
    )
    cap.on_forward_end(batch, False, None)
    if a.kv_only:
        kv_only(a, pool, req_pool, layout, cap)
        return
    times, cpu_times, finish_times, write_times, writer_s = [], [], [], [], []
    prompt, output = list(range(a.tokens)), [0]  # the request's own id lists (SGLang's Req holds them)
    for i in range(a.requests + 1):
        sync(dev)
        t0, c0 = time.perf_counter(), time.thread_time()
        for j in range(a.batch):
            cap.finish_request(f"r{i}-{j}", 0, a.tokens + 1, req_pool, prompt, output)
        t1 = time.perf_counter()
        cap.on_batch_done()
        times.append((time.perf_counter() - t0) / a.batch)
        finish_times.append((t1 - t0) / a.batch)
        cpu_times.append((time.thread_time() - c0) / a.batch)
        t2, w0 = time.perf_counter(), cap.stats.write_s
        cap.flush()
        write_times.append((time.perf_counter() - t2) / a.batch)
        writer_s.append(cap.stats.write_s - w0)  # the writer thread's own time on this batch's transfers
    assert cap.stats.write_failures == 0, cap.stats
    assert cap.stats.batches == a.requests + 1, cap.stats  # a transfer per `TRANSFER_BYTES` of a result batch
    cap.close()
    ms = [t * 1e3 for t in times[1:]]
    cpu_ms = [t * 1e3 for t in cpu_times[1:]]
    finish_ms = [t * 1e3 for t in finish_times[1:]]
    print(
        json.dumps(
            {
                "device": device_name(dev),
                "sglang": ran,
                "tokens": a.tokens,
                "batch": a.batch,
                "kv_gather": a.kv_gather,
                "kv_gather_equals_twin": kv_equal,
                "recorded_moe_layers": len(cap.spec.moe_layers),
                "kv_sites": 2 * len(cap.spec.attn_layers),
                "host_bytes_per_token": token_bytes,
                "transfers_per_batch": cap.stats.transfers / cap.stats.batches,
                "finish_ms_per_request_median": statistics.median(ms),
                "finish_ms": ms,
                "finish_request_ms_per_request_median": statistics.median(finish_ms),
                "scheduler_cpu_ms_per_request_median": statistics.median(cpu_ms),
                "flush_wait_ms_per_request_median": 1e3 * statistics.median(write_times[1:]),
                "writer_ms_per_request_median": 1e3 * statistics.median(writer_s[1:]) / a.batch,
                "writer_MBps": a.batch * a.tokens * token_bytes / statistics.median(writer_s[1:]) / 1e6,
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
            sync(slots.device)
            ms.append((time.perf_counter() - t0) * 1e3)
        result[name] = statistics.median(ms[1:])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
