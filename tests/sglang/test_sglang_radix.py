"""TRACE records when SGLang's own prefix cache and KV allocator choose the slots (sglang 0.5.15.post1, CPU).

The scheduler's path for each request, with the real `RadixCache` (`match_prefix`, `inc_lock_ref`,
`cache_finished_req`, `evict`), the real `TokenToKVPoolAllocator` and the real `Req`: match the prompt in the radix
tree, allocate slots for the rest, run the forwards (patched FusedMoE layers, FP4 KV pool, TRACE capturer: see
`test_sglang_rollout.Rollout`), then at finish SGLang's result processor's `_maybe_collect_routed_experts` (TRACE's
plugin hook before it), the radix cache's `cache_finished_req` (which frees the duplicate slots), and the output
streamer's `stream_output` (TRACE's batch-done hook before it), in that order. Records are
checked against what the forward that last wrote each slot computed.
"""

from array import array

import torch

from tests.sglang_cpu import load_trace_plugin

load_trace_plugin()

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from tests.sglang.test_sglang_rollout import Rollout, check_store, handle, rollout  # noqa: E402, F401 (the fixture)


class Scheduler:
    """The prefix cache, allocator and result processing of one scheduler, around a `Rollout`."""

    def __init__(self, engine: Rollout) -> None:
        self.rollout = engine
        self.alloc = TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", engine.pool, need_sort=False)
        self.tree = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=engine.req_to_token_pool,
                token_to_kv_pool_allocator=self.alloc,
                page_size=1,
            )
        )
        self.processor, self.streamer = engine.processors()

    def run(self, rid: str, pool_idx: int, prompt: list[int], output: list[int]) -> tuple[Req, list[int]]:
        """Prefill the uncached part of `prompt`, decode `output` (its last token is sampled, never fed back),
        finish. Returns the request and the KV slots of its positions."""
        req = Req(rid, "", array("q", prompt), SamplingParams(max_new_tokens=len(output)))
        match = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt))))
        prefix = match.device_indices.tolist()
        self.tree.inc_lock_ref(match.last_device_node)
        req.last_node, req.cache_protected_len, req.req_pool_idx = match.last_device_node, len(prefix), pool_idx
        new = self.alloc.alloc(len(prompt) - len(prefix)).tolist()
        self.rollout.forward(new, ForwardMode.EXTEND)
        slots = prefix + new
        for token in output[:-1]:
            req.output_ids.append(token)
            slot = self.alloc.alloc(1).tolist()
            self.rollout.forward(slot, ForwardMode.DECODE)
            slots += slot
        req.output_ids.append(output[-1])
        self.rollout.req_to_token_pool.req_to_token[pool_idx, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        req.kv_committed_len = len(slots)
        req.finished_reason, req.finished_len = FINISH_LENGTH(length=len(output)), len(output)
        self.processor._maybe_collect_routed_experts(req)
        self.tree.cache_finished_req(req)  # frees the slots the tree already held
        self.streamer.stream_output([req], False)
        return req, slots


def test_slots_chosen_by_sglangs_radix_cache_and_allocator_carry_the_right_records(rollout):  # noqa: F811
    sched = Scheduler(rollout)
    a, slots_a = sched.run("A", 0, [11, 12, 13, 14], [21, 22])
    b, slots_b = sched.run("B", 1, [11, 12, 13, 15], [31, 32])
    assert slots_b[:3] == slots_a[:3] and not set(slots_b[3:]) & set(slots_a)  # B's prompt hit A's cached prefix
    assert "error" not in handle(a) and "error" not in handle(b) and handle(b)["tokens"] == len(slots_b)
    check_store(rollout, 0, "A", slots_a)
    check_store(rollout, 0, "B", slots_b)  # B's first three positions: what A's prefill computed
    hold = sched.alloc.alloc(sched.alloc.available_size())  # the allocator can only hand out evicted slots now
    sched.tree.evict(EvictParams(num_tokens=4))
    c, slots_c = sched.run("C", 2, [41, 42, 43], [51])
    assert set(slots_c) <= set(slots_a) | set(slots_b)  # C's slots were A's or B's, written again by C
    check_store(rollout, 0, "C", slots_c)
    assert rollout.capturer.stats.write_failures == 0 and rollout.capturer.stats.trajectories_written == 3
    sched.alloc.free(hold)
