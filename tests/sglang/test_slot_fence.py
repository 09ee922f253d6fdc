"""`SlotFence` on SGLang's own KV allocators: slots freed while the finish path's copies may still read them are not
handed out until the copies completed, an allocation that needs them waits for the copies, and SGLang's view of
the pool (`available_size`) counts them as free. `Copies` stands in for the copy stream's CUDA event in the
allocator tests; `test_a_finished_requests_records_survive_the_reuse_of_its_slots` runs the real capturer, fence and
(on CUDA, marked `gpu`) copy stream."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.sglang_cpu import import_sglang_as_a_server

import_sglang_as_a_server()  # no plugin needed: no hook runs here

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolFP4, ReqToTokenPool  # noqa: E402

from sglang_trace.capturer import TraceCapturer  # noqa: E402
from sglang_trace.config import ModelLayout, TraceArgs, parse_layers, parse_sites  # noqa: E402
from sglang_trace.moe import ExpertWeights  # noqa: E402
from sglang_trace.slot_fence import SlotFence  # noqa: E402
from trace_core.numerics.quant import quantize  # noqa: E402
from trace_core.records.reader import RecordReader  # noqa: E402


class Copies:
    """Completion of queued copies, as `torch.cuda.Event` reports it: not done until the test (or a wait) says so."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def allocator(size: int = 16, need_sort: bool = False) -> TokenToKVPoolAllocator:
    return TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", kvcache=None, need_sort=need_sort)


@pytest.mark.parametrize("need_sort", [False, True])
def test_slots_freed_before_their_copies_ran_are_not_handed_out_until_the_copies_completed(need_sort):
    alloc = allocator(need_sort=need_sort)
    fence = SlotFence(alloc)
    finished = alloc.alloc(10)
    fence.arm()  # a request finished: its records will be copied
    alloc.free(finished)  # SGLang releases its KV right after
    copies = Copies()
    fence.seal(copies)
    assert alloc.available_size() == 16 and fence.held_tokens == 10  # SGLang sees the slots as free
    other = alloc.alloc(6)  # the slots that were free all along
    assert other is not None and not set(other.tolist()) & set(finished.tolist())
    fence.release()  # copies still running: nothing given back
    assert fence.held_tokens == 10 and copies.waited == 0
    again = alloc.alloc(4)  # only held slots are left: the allocation waits for the copies, then gets them
    assert copies.waited == 1 and set(again.tolist()) <= set(finished.tolist())
    assert fence.stats.alloc_waits == 1 and fence.held_tokens == 0 and fence.stats.released_slots == 10
    assert alloc.available_size() == 6


def test_completed_copies_give_their_slots_back_without_a_wait_and_later_frees_join_the_newest():
    alloc = allocator()
    fence = SlotFence(alloc)
    a, b = alloc.alloc(4), alloc.alloc(4)
    fence.arm()
    alloc.free(a)
    first = Copies()
    fence.seal(first)
    alloc.free(b)  # an eviction while the copies run: it may be a finished request's slots, held too
    assert fence.held_tokens == 8 and fence.stats.held_frees == 2
    first.done = True
    fence.release()
    assert fence.held_tokens == 0 and first.waited == 0 and alloc.available_size() == 16
    assert len(alloc.free_pages) == 16  # back in SGLang's own free list
    c = alloc.alloc(2)
    alloc.free(c)  # nothing armed or running: passed straight on
    assert fence.stats.held_frees == 2 and len(alloc.free_pages) == 16


def test_a_batch_whose_copies_ran_at_once_releases_at_seal_and_clear_waits_for_running_copies():
    alloc = allocator()
    fence = SlotFence(alloc)
    a = alloc.alloc(5)
    fence.arm()
    alloc.free(a)
    fence.seal(None)  # CPU: the copies ran on the scheduler thread
    assert fence.held_tokens == 0 and len(alloc.free_pages) == 16
    b = alloc.alloc(3)
    fence.arm()
    alloc.free(b)
    running = Copies()
    fence.seal(running)
    alloc.clear()  # SGLang's flush_cache: every slot free, after the copies that read them
    assert running.waited == 1 and fence.held_tokens == 0 and alloc.available_size() == 16


def test_an_allocation_that_fails_with_nothing_held_is_not_retried():
    alloc = allocator(size=4)
    fence = SlotFence(alloc)
    fence.arm()
    alloc.free(alloc.alloc(2))  # held for a batch whose copies are not queued yet: no wait can free them
    assert alloc.alloc(3) is None and fence.stats.alloc_waits == 0 and alloc.available_size() == 4


def test_the_paged_allocator_holds_whole_pages():
    alloc = PagedTokenToKVPoolAllocator(32, 4, torch.bfloat16, "cpu", kvcache=None, need_sort=False)
    fence = SlotFence(alloc)
    pages = alloc.alloc(8)  # two pages
    fence.arm()
    alloc.free(pages[:6])  # six tokens in two pages: SGLang frees both pages
    copies = Copies()
    fence.seal(copies)
    assert fence.held_tokens == 8 and alloc.available_size() == 32
    assert alloc.alloc(24) is not None and alloc.alloc(4) is not None and copies.waited == 1


def test_another_allocator_is_refused_by_name():
    class HiSparseTokenToKVPoolAllocator:
        page_size = 1

    with pytest.raises(ValueError, match="this server's KV allocator is HiSparseTokenToKVPoolAllocator"):
        SlotFence(HiSparseTokenToKVPoolAllocator())


LAYERS, HIDDEN, KV_HEADS, HEAD_DIM, TOPK, EXPERTS = 2, 256, 2, 128, 2, 8
SLOTS, TOKENS = 64, 40  # a request of TOKENS positions, and a pool that cannot hold two


def forward(cap: TraceCapturer, pool, slots: torch.Tensor, seed: int) -> None:
    """One forward writing every site of `slots` from seed `seed`: the MoE inputs' records (the reference quantizer),
    the routes (the layer's marker) and K/V into the FP4 pool, then the capturer's forward end."""
    gen = torch.Generator().manual_seed(seed)
    n, dev = slots.shape[0], slots.device
    for j in range(LAYERS):
        x = torch.randn(n, HIDDEN, generator=gen).to(dev, torch.bfloat16)
        cap.records.stage_quantized((j, "moe_in"), quantize(x, "nvfp4", per_token=True))
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOPK] for _ in range(n)]).to(dev)
        cap.records.stage_routes(j, ids)
        k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen).to(dev, torch.bfloat16) for _ in "kv")
        pool.set_kv_buffer(None, slots, k, v, layer_id_override=j)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False), out_cache_loc=slots)
    cap.on_forward_end(batch, False, None)


def finish_and_reuse(device: str, store: str, reuse: bool):
    """Request "a" runs and finishes; SGLang frees its slots; on CUDA the copy stream is held back behind a busy
    current stream, so its copies are still queued when the next allocation (`reuse`) takes every slot of the pool
    and a forward overwrites them. Returns (a's stored records, the fence's stats)."""
    layout = ModelLayout("Qwen3MoeForCausalLM", LAYERS, (0, 1), (0, 1), HIDDEN, KV_HEADS, HEAD_DIM, TOPK, EXPERTS)
    args = TraceArgs("emulate", 1, parse_layers("all"), parse_sites("moe_in,k,v"), store=store, step=0)
    pool = MHATokenToKVPoolFP4(size=SLOTS, page_size=1, dtype=torch.float4_e2m1fn_x2, head_num=KV_HEADS,
                               head_dim=HEAD_DIM, layer_num=LAYERS, device=device, enable_memory_saver=False,
                               enable_alt_stream=False)  # fmt: skip
    allocator = TokenToKVPoolAllocator(SLOTS, torch.float4_e2m1fn_x2, device, pool, need_sort=False)
    req_pool = ReqToTokenPool(size=2, max_context_len=TOKENS + 2, device=device, enable_memory_saver=False)
    fence = SlotFence(allocator)
    cap = TraceCapturer(
        args, layout, kv_pool=pool, max_tokens=SLOTS, num_slots=SLOTS + 1, max_request_tokens=TOKENS + 1,
        device=device, return_routes=False, weights=ExpertWeights(), fence=fence,
    )  # fmt: skip
    a = allocator.alloc(TOKENS)
    forward(cap, pool, a, seed=0)
    req_pool.req_to_token[0, :TOKENS] = a.to(torch.int32)
    cap.finish_request("a", 0, TOKENS + 1, req_pool, list(range(TOKENS)), [0])
    allocator.free(a)
    if device == "cuda":
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time before the copy stream may start
    cap.on_batch_done()
    if reuse:
        rest = allocator.alloc(allocator.available_size())  # every slot: a's only after its copies ran
        forward(cap, pool, rest, seed=1)
    cap.close()
    return RecordReader(store, 0).load([("a", 0, TOKENS)]), fence.stats


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_finished_requests_records_survive_the_reuse_of_its_slots(tmp_path, device):
    """The records stored for a finished request are those of its own forward even when every slot it held is
    allocated and overwritten right after it finished: on CUDA the allocation waits for the queued copies (one
    fence wait), on CPU the copies ran before `on_batch_done` returned."""
    alone, _ = finish_and_reuse(device, str(tmp_path / "alone"), reuse=False)
    reused, stats = finish_and_reuse(device, str(tmp_path / "reused"), reuse=True)
    assert stats.alloc_waits == (1 if device == "cuda" else 0) and stats.released_slots == TOKENS
    for site, rec in alone.records.items():
        other = reused.records[site]
        assert torch.equal(rec.low_bits, other.low_bits) and torch.equal(rec.scales, other.scales), site
    assert torch.equal(alone.routes, reused.routes)
