"""Record capture through SGLang's rollout path on CPU, from forward to record store to handle.

Real SGLang code (0.5.15.post1 with TRACE's plugin hooks applied by SGLang's `load_plugins`, and its four file
patches): `ServerArgs`, `FusedMoE` (weight loader and `forward_impl`, CPU expert path), `MHATokenToKVPoolFP4.
set_kv_buffer`, `ReqToTokenPool`, `Req`, the global experts capturer seam (`sglang.srt.state_capturer`),
`SchedulerBatchResultProcessor._maybe_collect_routed_experts` (request finish), `SchedulerOutputStreamer.
stream_output` (the result batch streamed: TRACE's batch-done hook, then SGLang's `BatchTokenIDOutput` with the
handle in its `customized_info`), `SchedulerWeightUpdaterManager.update_weights_from_*` (weight updates) and
`DefaultPoolConfigurator` (the KV cell size). The scheduler loop, model runner and top-k layer are not built (they
need the GPU stack); the test drives the calls they make with plain data holders (`SimpleNamespace`) in their
place: `capture(layer_id, topk_indices)` as `select_experts` does, `on_forward_end(forward_batch, ...)` as
`ModelRunner.forward` does. `sgl_kernel` is an import stand-in where absent (`tests/sglang_cpu.py`); nothing here
calls it.
"""

import dataclasses
import json
import re
import shutil
from array import array
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.sglang_cpu import init_cpu_parallel_state, load_trace_plugin

load_trace_plugin()

import sglang.srt.layers.moe.fused_moe_triton.layer as layer_mod  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.managers.io_struct import (  # noqa: E402
    BatchTokenIDOutput,
    UpdateWeightFromDiskReqInput,
    unwrap_from_pickle,
)
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor  # noqa: E402
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer  # noqa: E402
from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolFP4, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer, set_global_experts_capturer  # noqa: E402
from transformers import Qwen3MoeConfig  # noqa: E402

from sglang_trace import hooks  # noqa: E402
from sglang_trace.capturer import TraceCapturer, record_bytes_per_slot  # noqa: E402
from sglang_trace.handle import from_meta_info  # noqa: E402
from trace_core.numerics.quant import quantize  # noqa: E402
from trace_core.records.reader import FailedRecordError, RecordReader  # noqa: E402
from trace_core.records.spec import Binding, Record, token_digest  # noqa: E402
from trace_core.records.store import (  # noqa: E402
    finalize_step,
    read_header,
    rollout_rid,
    shard_paths,
    step_dir,
)

H, KV_HEADS, HEAD_DIM, EXPERTS, TOPK, INTER, LAYERS = 64, 2, 32, 4, 2, 32, 2


def qwen3_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        moe_intermediate_size=INTER,
        architectures=["Qwen3MoeForCausalLM"],
    )


def forward_batch(mode: ForwardMode, out_cache_loc: torch.Tensor) -> ForwardBatch:
    """SGLang's own `ForwardBatch` of one forward writing `out_cache_loc` (what `on_forward_end` receives from the
    model runner); the test's positions are one request's."""
    t = out_cache_loc.shape[0]
    return ForwardBatch(
        forward_mode=mode,
        batch_size=1,
        input_ids=torch.zeros(t, dtype=torch.int64),
        req_pool_indices=torch.zeros(1, dtype=torch.int64),
        seq_lens=torch.tensor([t]),
        out_cache_loc=out_cache_loc,
        seq_lens_sum=t,
    )


class Rollout:
    """The engine state a scheduler process holds, built from real SGLang parts, plus what each position saw
    (`overrides`: other server arguments)."""

    def __init__(self, store: str | None, **overrides) -> None:
        init_cpu_parallel_state()
        self.args = ServerArgs(
            **dict(
                model_path="dummy",
                device="cpu",
                kv_cache_dtype="fp4_e2m1",
                trace_mode="emulate",
                trace_layers="all",
                trace_record_bits=1,
                trace_store=store,
                enable_return_routed_experts=True,
            )
            | overrides
        )
        set_global_server_args_for_scheduler(self.args)
        self.gen = torch.Generator().manual_seed(0)
        self.moe = [
            layer_mod.FusedMoE(
                num_experts=EXPERTS,
                hidden_size=H,
                intermediate_size=INTER,
                layer_id=i,
                top_k=TOPK,
                params_dtype=torch.bfloat16,
            )
            for i in range(LAYERS)
        ]
        self.load_weights()
        self.pool = MHATokenToKVPoolFP4(
            size=64,
            page_size=1,
            dtype=torch.float4_e2m1fn_x2,
            head_num=KV_HEADS,
            head_dim=HEAD_DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        self.req_to_token_pool = ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
        self.allocator = TokenToKVPoolAllocator(64, torch.float4_e2m1fn_x2, "cpu", self.pool, need_sort=False)
        self.runner = runner = SimpleNamespace(
            server_args=self.args,
            model=torch.nn.ModuleList(self.moe),
            model_config=SimpleNamespace(hf_config=qwen3_moe(), context_len=32),
            token_to_kv_pool=self.pool,
            token_to_kv_pool_allocator=self.allocator,
            max_running_requests=16,
            max_total_num_tokens=64,
            page_size=1,
            device="cpu",
        )
        assert hooks.install_capturer(runner)
        self.capturer: TraceCapturer = get_global_experts_capturer()
        self.sent: list = []  # what the output streamers sent to the detokenizer
        self.seen: dict[int, dict] = {}  # KV slot -> what the last forward that wrote it computed
        self.outputs: list[torch.Tensor] = []  # every MoE layer's output, in forward order

    def load_weights(self, shards: tuple[str, ...] = ("w1", "w3", "w2")) -> None:
        """Every expert's `shards` through the FusedMoE weight loader (w1 gate, w3 up, w2 down)."""
        shapes = {"w1": ("w13_weight", (INTER, H)), "w3": ("w13_weight", (INTER, H)), "w2": ("w2_weight", (H, INTER))}
        for layer in self.moe:
            for e in range(EXPERTS):
                for sid in shards:
                    name, shape = shapes[sid]
                    w = (torch.randn(*shape, generator=self.gen) * 0.05).to(torch.bfloat16)
                    layer.weight_loader(getattr(layer, name), w, name, sid, e)

    def forward(
        self, slots: list[int], mode: ForwardMode, *, graph_replay: bool = False, skip_moe=(), skip_routes=()
    ) -> None:
        """One model forward over rows `slots`: each MoE layer routes and runs its experts, each attention layer
        writes K/V; then the forward ends, as in ModelRunner.forward. `graph_replay`: report the forward as a CUDA
        graph replay (no eager staging check); `skip_moe`: MoE layers whose FusedMoE does not run (a replay whose
        captured graph lacks the TRACE hooks); `skip_routes`: MoE layers whose route capture does not run."""
        t = len(slots)
        loc = torch.tensor(slots, dtype=torch.int64)
        rows = [dict() for _ in range(t)]
        for layer in range(LAYERS):
            x = torch.randn(t, H, generator=self.gen).to(torch.bfloat16) * (layer + 1)
            ids = torch.stack([torch.randperm(EXPERTS, generator=self.gen)[:TOPK] for _ in range(t)]).to(torch.int32)
            if layer not in skip_routes:
                get_global_experts_capturer().capture(layer_id=layer, topk_indices=ids)
            topk = StandardTopKOutput(torch.rand(t, TOPK, generator=self.gen), ids, None)
            if layer not in skip_moe:
                self.outputs.append(self.moe[layer].forward_impl(x, topk))
            k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=self.gen).to(torch.bfloat16)
            v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=self.gen).to(torch.bfloat16)
            self.pool.set_kv_buffer(None, loc, k.clone(), v.clone(), layer_id_override=layer)
            for r in range(t):
                rows[r][(layer, "moe_in")] = x[r]
                rows[r][(layer, "k")] = k[r].reshape(-1)
                rows[r][(layer, "v")] = v[r].reshape(-1)
                rows[r][("routes", layer)] = ids[r]
        for slot, row in zip(slots, rows, strict=True):
            self.seen[slot] = row
        batch = forward_batch(mode, loc)
        routes_output = get_global_experts_capturer().on_forward_end(
            forward_batch=batch, can_run_graph=graph_replay, cuda_graph_batch=None, no_copy_to_cpu=False
        )
        assert routes_output is None  # nothing for SGLang's result processing to finalize

    def processors(self) -> tuple[SchedulerBatchResultProcessor, SchedulerOutputStreamer]:
        """SGLang's result processor and output streamer of one scheduler, built by their own dataclass
        constructors; the fields the finish and streaming paths read are real (the request pool, server arguments,
        parallel ranks), the others None. The streamer's detokenizer socket is `self.sent`."""
        streamer = SchedulerOutputStreamer(
            send_to_detokenizer=SimpleNamespace(send_output=lambda out, *a, **k: self.sent.append(out)),
            tree_cache=None,
            ps=SimpleNamespace(dp_rank=0, attn_tp_rank=0),
            server_args=self.args,
            is_generation=True,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            disaggregation_mode=DisaggregationMode.NULL,
            enable_hicache_storage=lambda: False,
        )
        fields = {f.name: None for f in dataclasses.fields(SchedulerBatchResultProcessor)}
        processor = SchedulerBatchResultProcessor(
            **fields
            | dict(
                is_generation=True,
                server_args=self.args,
                req_to_token_pool=self.req_to_token_pool,
                output_streamer=streamer,
            )
        )
        return processor, streamer

    def request(self, rid: str, req_pool_idx: int, slots: list[int], *, r3: bool = True) -> Req:
        """SGLang's `Req` of a request that finished by length after one output token: its prompt ids are its slot
        numbers (the tests use slots as token ids), `req_to_token` holds its slots, and seqlen = len(slots) + 1
        (the last sampled token has no KV yet). `r3`: it asked for its routed experts."""
        self.req_to_token_pool.req_to_token[req_pool_idx, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
        req = Req(rid, "", array("q", slots), SamplingParams(max_new_tokens=1), return_routed_experts=r3)
        req.req_pool_idx = req_pool_idx
        req.output_ids.append(0)
        req.finished_reason, req.finished_len = FINISH_LENGTH(length=1), 1
        return req

    def finish(self, rid: str, req_pool_idx: int, slots: list[int]) -> Req:
        """One request finishes alone in its result batch (see `finish_batch`)."""
        return self.finish_batch([(rid, req_pool_idx, slots)])[0]

    def finish_batch(self, requests: list[tuple[str, int, list[int]]]) -> list[Req]:
        """Result processing as SGLang's processor runs it: each finished request (rid, req_pool_idx, slots) is
        collected by `_maybe_collect_routed_experts` (TRACE's hook runs first, for every request), and then the
        batch's outputs are streamed (`stream_output`: TRACE's hook moves the batch's records, then SGLang sends the
        `BatchTokenIDOutput` carrying each handle)."""
        processor, streamer = self.processors()
        reqs = []
        for rid, req_pool_idx, slots in requests:
            req = self.request(rid, req_pool_idx, slots, r3=self.args.enable_return_routed_experts)
            processor._maybe_collect_routed_experts(req)
            req.output_ids.append(-1)  # the ids are read by reference on the writer thread: a later id is not
            reqs.append(req)
        sent = len(self.sent)
        streamer.stream_output(reqs, False)
        (out,) = self.sent[sent:]
        assert isinstance(out, BatchTokenIDOutput) and out.rids == [r.rid for r in reqs]
        streamed = unwrap_from_pickle(out.customized_info) or {}
        for i, req in enumerate(reqs):  # what reaches meta_info["trace"]: the handle at the last output token
            trace = streamed["trace"][i] if "trace" in streamed else None
            assert (trace and from_meta_info({"trace": trace})) == handle(req)
        return reqs


def handle(req: Req) -> dict | None:
    """The TRACE handle of a finished request, as `meta_info["trace"]` carries it (None when it has none)."""
    info = req.customized_info or {}
    return from_meta_info({"trace": info["trace"]}) if "trace" in info else None


def expected(rollout: Rollout, slots: list[int], site) -> Record:
    fmt = "nvfp4" if site[1] == "moe_in" else "kv_fp4"
    x = torch.stack([rollout.seen[s][site] for s in slots])
    if fmt == "kv_fp4":
        return Record.from_quantized(quantize(x, fmt), 1)
    return Record.from_quantized(quantize(x, fmt, per_token=True), 1)


def check_store(rollout: Rollout, step: int, rid: str, slots: list[int]) -> None:
    rollout.capturer.flush()
    got = RecordReader(rollout.args.trace_store, step).load([(rid, 0, len(slots))])
    for site in [(layer, kind) for layer in range(LAYERS) for kind in ("moe_in", "k", "v")]:
        rec, ref = got.records[site], expected(rollout, slots, site)
        assert bool(got.has_record[site].all()), site
        assert torch.equal(rec.low_bits[0], ref.low_bits), site
        assert torch.equal(rec.scales[0], ref.scales), site
        if ref.global_scale is not None:
            assert torch.equal(rec.global_scale[0], ref.global_scale), site
    routes = torch.stack([torch.stack([rollout.seen[s][("routes", la)] for la in range(LAYERS)]) for s in slots])
    assert torch.equal(got.routes[0], routes)


@pytest.fixture
def rollout(tmp_path):
    r = Rollout(str(tmp_path / "records"))
    yield r
    r.capturer.close()
    set_global_experts_capturer(None)


def test_two_samples_of_one_prompt_to_store_and_handle(rollout):
    prompt = [10, 11, 12, 13]
    rollout.forward(prompt, ForwardMode.EXTEND)  # sample A prefills the prompt
    rollout.forward([20, 30], ForwardMode.EXTEND)  # A's first output token; B hits the prefix cache, extends one
    rollout.forward([21, 31], ForwardMode.DECODE)  # both decode in one batch
    slots_a, slots_b = prompt + [20, 21], prompt + [30, 31]
    req_a = rollout.finish("traj-A", 0, slots_a)
    req_b = rollout.finish("traj-B", 1, slots_b)
    assert handle(req_a) == {
        "store": rollout.args.trace_store,
        "step": 0,
        "trajectory": "traj-A",
        "attempt": "",
        "policy_version": 0,
        "tokens": 6,
    }  # the token digest is computed on the writer thread: the stored shard's binding carries it
    # R3's meta_info format is kept: [seqlen - 1, num_hidden_layers, topk] int32
    assert req_b.routed_experts.shape == (6, LAYERS, TOPK) and req_b.routed_experts.dtype == torch.int32
    assert torch.equal(req_b.routed_experts[4, 1], rollout.seen[30][("routes", 1)])
    check_store(rollout, 0, "traj-A", slots_a)
    check_store(rollout, 0, "traj-B", slots_b)
    digest = token_digest([*slots_a, 0])  # the rollout's token ids: the test uses slot numbers as ids
    assert RecordReader(rollout.args.trace_store, 0).binding("traj-A") == Binding(0, 0, "traj-A", "", digest)
    stats = rollout.capturer.stats
    assert stats.requests == 2 and stats.trajectories_written == stats.shards_written == 2  # two result batches


def weight_updater(tp_worker) -> SchedulerWeightUpdaterManager:
    """SGLang's scheduler weight updater (its own constructor) over `tp_worker`; no draft worker, the barrier on
    the world group, a cache flush that succeeds."""
    return SchedulerWeightUpdaterManager(
        tp_worker=tp_worker,
        draft_worker=None,
        tp_cpu_group=None,
        memory_saver_adapter=None,
        flush_cache=lambda empty_cache=False: True,
        is_fully_idle=lambda: True,
    )


def disk_update(rollout: Rollout, version: str | None, flush_cache: bool = False):
    """`update_weights_from_disk` through SGLang's weight updater with TRACE's AFTER hook; the tp worker's reload
    runs the same FusedMoE weight loader."""

    def reload(recv_req):
        rollout.load_weights()
        return True, "ok"

    req = UpdateWeightFromDiskReqInput(model_path="unused", weight_version=version, flush_cache=flush_cache)
    return weight_updater(SimpleNamespace(update_weights_from_disk=reload)).update_weights_from_disk(req)


def test_retraction_slot_reuse_and_weight_update_step(rollout):
    rollout.forward([1, 2, 3], ForwardMode.EXTEND)  # request A, retracted afterwards: slots 2, 3 go back
    rollout.forward([2, 3, 7], ForwardMode.EXTEND)  # request C reuses them
    rollout.forward([4, 5], ForwardMode.EXTEND)  # A recomputed into new slots after its prefix slot 1
    rollout.finish("traj-C", 1, [2, 3, 7])
    check_store(rollout, 0, "traj-C", [2, 3, 7])
    before = hooks.EXPERT_WEIGHTS.stats.w13
    assert disk_update(rollout, "7").success
    assert hooks.EXPERT_WEIGHTS.stats.w13 - before == LAYERS * EXPERTS
    rollout.forward([1, 4, 5], ForwardMode.EXTEND)  # A after the update (cache flushed: recomputed)
    finished = rollout.finish("traj-A", 0, [1, 4, 5])
    assert handle(finished)["step"] == 7 and "error" not in handle(finished)
    check_store(rollout, 7, "traj-A", [1, 4, 5])


def test_a_rollout_step_ahead_of_the_weights_files_its_records_under_that_step(rollout):
    """async_lag: the client names the rollout step in the request id (`rollout_rid`); the records go to that
    step's directory, bound to the weight version that computed them, while a plain id keeps the version's step."""
    rollout.forward([1, 2, 3], ForwardMode.EXTEND)
    ahead = rollout.finish(rollout_rid("7", "a1", 2), 0, [1, 2, 3])
    assert handle(ahead) == {
        "store": rollout.args.trace_store,
        "step": 2,
        "trajectory": "7",
        "attempt": "a1",
        "policy_version": 0,
        "tokens": 3,
    }
    rollout.forward([4, 5], ForwardMode.EXTEND)
    assert handle(rollout.finish("8", 1, [4, 5]))["step"] == 0
    check_store(rollout, 2, "7", [1, 2, 3])
    check_store(rollout, 0, "8", [4, 5])
    assert RecordReader(rollout.args.trace_store, 2).binding("7") == Binding(
        2, 0, "7", "a1", token_digest([1, 2, 3, 0])
    )
    assert RecordReader(rollout.args.trace_store, 0).trajectories() == ["8"]


def test_old_weight_tokens_are_never_filed_under_the_new_step(rollout):
    """flush_cache=False (or an in-place pause): a request whose prefix was computed before the update finishes
    after it. Its rows carry weight version 0, the step is 7: the request is refused, not stored under 7."""
    rollout.forward([1, 2, 3], ForwardMode.EXTEND)
    assert disk_update(rollout, "7", flush_cache=False).success
    rollout.forward([4], ForwardMode.DECODE)  # decodes on with the new weights
    req = rollout.finish("mixed", 0, [1, 2, 3, 4])
    assert handle(req)["step"] == 7 and "weight versions [0, 7]" in handle(req)["error"]
    assert req.routed_experts is None
    rollout.forward([10, 11], ForwardMode.EXTEND)
    rollout.finish("fresh", 1, [10, 11])
    check_store(rollout, 7, "fresh", [10, 11])
    with pytest.raises(FailedRecordError, match=r"weight versions \[0, 7\]"):
        RecordReader(rollout.args.trace_store, 7).load([("mixed", 0, 4)])
    assert rollout.capturer.stats.failed == ["mixed"]


def test_an_update_without_weight_version_refuses_records_until_a_versioned_one(rollout):
    assert disk_update(rollout, None).success
    rollout.forward([1, 2], ForwardMode.EXTEND)
    req = rollout.finish("unversioned", 0, [1, 2])
    assert handle(req)["step"] is None and "without a weight_version" in handle(req)["error"]
    assert disk_update(rollout, "3").success
    rollout.forward([1, 2], ForwardMode.EXTEND)
    assert "error" not in handle(rollout.finish("versioned", 0, [1, 2]))
    check_store(rollout, 3, "versioned", [1, 2])


def test_tensor_update_that_bypasses_the_expert_loader_is_refused_and_ipc_moves_the_step(rollout):
    from sglang.srt.managers.io_struct import UpdateWeightsFromIPCReqInput, UpdateWeightsFromTensorReqInput

    applied = []
    worker = SimpleNamespace(
        update_weights_from_tensor=lambda req: applied.append(req) or (True, "ok"),
        update_weights_from_ipc=lambda req: (rollout.load_weights(), (True, "ok"))[1],
    )
    updater = weight_updater(worker)  # barrier: the world group
    req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[], load_format="direct", weight_version="4")
    out = updater.update_weights_from_tensor(req)
    assert not out.success and "load_format='direct'" in out.message and applied == []
    assert rollout.capturer.step == 0
    req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[], load_format=None, weight_version="4")
    assert updater.update_weights_from_tensor(req).success and applied == [req]  # the loader path: applied
    assert rollout.capturer.step == 4
    ipc = UpdateWeightsFromIPCReqInput(zmq_handles={}, weight_version="5", flush_cache=False)
    assert updater.update_weights_from_ipc(ipc).success
    assert rollout.capturer.step == 5


def test_a_graph_replay_in_which_a_hook_did_not_run_is_refused_not_stored(rollout):
    """A CUDA-graph replay skips the eager staging check; the in-graph markers catch a layer whose TRACE hooks did
    not run (its staging rows still hold the previous forward's records)."""
    rollout.forward([1, 2], ForwardMode.EXTEND, graph_replay=True)
    rollout.forward([3, 4], ForwardMode.EXTEND, graph_replay=True, skip_moe=(1,))
    ok, stale = rollout.finish("ok", 0, [1, 2]), rollout.finish("stale", 1, [3, 4])
    assert "error" not in handle(ok) and "a hook did not run" in handle(stale)["error"]
    check_store(rollout, 0, "ok", [1, 2])
    assert rollout.capturer.stats.failed == ["stale"]


def test_a_graph_replay_in_which_a_route_capture_did_not_run_is_refused_not_stored(rollout):
    """The routes are the FusedMoE hooks' marker: the staged routes are reset after every forward (to 255, no
    expert id of the rows' uint8 routes), so a replay whose top-k hook did not run for one layer leaves unset
    routes, even where the previous (larger) forward staged valid ids in the same staging rows."""
    rollout.forward([1, 2, 3], ForwardMode.EXTEND, graph_replay=True)
    rollout.forward([4, 5], ForwardMode.EXTEND, graph_replay=True, skip_routes=(1,))
    ok, stale = rollout.finish("ok", 0, [1, 2, 3]), rollout.finish("stale", 1, [4, 5])
    assert "error" not in handle(ok) and "routes of a layer were not staged" in handle(stale)["error"]
    check_store(rollout, 0, "ok", [1, 2, 3])
    assert rollout.capturer.stats.failed == ["stale"]


@pytest.mark.parametrize("r3", [False, True])
def test_sites_none_runs_the_same_numerics_and_records_nothing(tmp_path, r3):
    """`--trace-sites none` (a QAT-only rollout) through the same SGLang parts: the FusedMoE hooks run the recipe's
    numerics, so every MoE layer's output equals that of a server recording every site (capture does not change
    what is served); no record row, host ring or store write exists, no handle is returned, and SGLang's KV budget
    adds nothing. With R3 on only the routes are kept (uint8 rows), and R3's answer holds the routes the top-k chose."""
    runs = {}
    for name, kw in (("capture", {}), ("none", dict(trace_sites="none", trace_store=None))):
        rollout = Rollout(str(tmp_path / name) if name == "capture" else None, enable_return_routed_experts=r3, **kw)
        try:
            rollout.forward([10, 11, 12, 13], ForwardMode.EXTEND)
            rollout.forward([20, 21], ForwardMode.DECODE)
            reqs = rollout.finish_batch([("a", 0, [10, 11, 12, 13, 20]), ("b", 1, [10, 11, 12, 21])])
            rollout.capturer.flush()
            runs[name] = rollout, reqs
        finally:
            rollout.capturer.close()
            set_global_experts_capturer(None)
    (capture, with_records), (none, without) = runs["capture"], runs["none"]
    assert len(none.outputs) == len(capture.outputs) == 2 * LAYERS
    for got, want in zip(none.outputs, capture.outputs, strict=True):
        assert torch.equal(got, want)
    assert all(handle(r) is not None and "error" not in handle(r) for r in with_records)
    assert all(handle(r) is None for r in without) and not (tmp_path / "none").exists()
    cap = none.capturer
    assert cap.ring is None and cap._writer is None and cap.stats.requests == 2 and cap.stats.write_failures == 0
    runner = SimpleNamespace(server_args=none.args, model_config=SimpleNamespace(hf_config=qwen3_moe()), tp_size=1)
    if not r3:
        assert cap.records is None and hooks.record_bytes_per_token(runner) == 0
        assert all(r.routed_experts is None for r in without)
        return
    assert cap.records is not None and cap.records.layouts == {} and cap.records.row.route_dtype == torch.uint8
    assert hooks.record_bytes_per_token(runner) == cap.records.row.row_bytes == 16  # version, uint8 routes, written
    for req, slots in zip(without, ([10, 11, 12, 13, 20], [10, 11, 12, 21]), strict=True):
        want = torch.stack([torch.stack([none.seen[s][("routes", la)] for la in range(LAYERS)]) for s in slots])
        assert torch.equal(req.routed_experts, want)
        assert req.routed_experts.dtype == torch.int32
    for req, twin in zip(without, with_records, strict=True):
        assert torch.equal(req.routed_experts, twin.routed_experts)


class SentinelWrites(TorchDispatchMode):
    """Counts the aten ops that write into the sentinel bytes (routes and hook markers) of a capturer's staging
    rows: every op with a mutated tensor argument on the staging storage whose first byte lies in that range."""

    def __init__(self, records) -> None:
        super().__init__()
        self.storage = records.staging.untyped_storage().data_ptr()
        self.row_bytes, self.sentinels = records.row.row_bytes, records.row.sentinels
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            t = args[i] if i < len(args) else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write and isinstance(t, torch.Tensor)
            if written and t.untyped_storage().data_ptr() == self.storage:
                column = t.storage_offset() * t.element_size() % self.row_bytes
                self.count += self.sentinels.start <= column < self.sentinels.stop
        return func(*args, **kwargs)


def test_each_moe_layer_writes_its_routes_and_hook_marker_in_one_launch(rollout):
    """Through SGLang's real FusedMoE forward (CPU expert path, both TRACE hooks): per MoE layer one write into
    the staging rows' routes and markers (the FusedMoE hook stages the routes the top-k hook handed on; that copy
    is the layer's marker), plus the reset after the forward; the routes stored are the ones the top-k chose."""
    rollout.forward([1, 2], ForwardMode.EXTEND)  # warm-up: the weight version is written once, outside the range
    with SentinelWrites(rollout.capturer.records) as writes:
        rollout.forward([3, 4, 5], ForwardMode.EXTEND)
    assert writes.count == LAYERS + 1
    assert rollout.capturer.records.marks == 0  # this rank keeps every layer's routes: no marker bytes
    assert "error" not in handle(rollout.finish("a", 0, [3, 4, 5]))
    check_store(rollout, 0, "a", [3, 4, 5])


def test_a_missed_site_or_unwritten_slot_fails_loudly(rollout):
    loc = torch.tensor([3, 4])
    rollout.capturer.capture(0, torch.zeros(2, TOPK, dtype=torch.int32))  # layer 1 never routed, no MoE input
    with pytest.raises(ValueError, match="nothing was captured"):
        rollout.capturer.on_forward_end(forward_batch(ForwardMode.DECODE, loc), False, None)
    req = rollout.finish("never-run", 2, [40, 41])  # R3 on: the routes are read at once
    assert "no captured record" in handle(req)["error"] and req.routed_experts is None


def test_failed_gathers_and_writes_are_counted_and_the_server_keeps_serving(rollout, tmp_path):
    """With routes not returned, finish only enqueues the gather and the write; a failure of either is counted and
    logged on the writer thread, that trajectory is not stored, and later requests are."""
    rollout.capturer.return_routes = False
    rollout.forward([1, 2], ForwardMode.EXTEND)
    assert handle(rollout.finish("ok", 0, [1, 2]))["tokens"] == 2
    assert handle(rollout.finish("never-run", 2, [40, 41]))["trajectory"] == "never-run"
    rollout.capturer.flush()
    good = rollout.capturer._writer
    rollout.capturer._writer = broken = type(good)(str(tmp_path / "other-store"), 0)
    shutil.rmtree(broken.dir)
    broken.dir.write_text("not a directory")  # the step directory became unwritable
    rollout.forward([3, 4], ForwardMode.EXTEND)
    rollout.finish_batch([("disk-error", 1, [3]), ("disk-error-2", 2, [3, 4])])  # one shard: both fail with it
    rollout.capturer.flush()
    rollout.capturer._writer = good
    rollout.forward([5, 6], ForwardMode.EXTEND)
    rollout.finish("after", 3, [5, 6])
    check_store(rollout, 0, "after", [5, 6])
    reader = RecordReader(rollout.args.trace_store, 0)
    for rid, message in (
        ("never-run", "no captured record"),
        ("disk-error", "NotADirectoryError"),
        ("disk-error-2", "NotADirectoryError"),
    ):
        with pytest.raises(FailedRecordError, match=message):
            reader.load([(rid, 0, 1)])
    stats = rollout.capturer.stats
    assert stats.failed == ["never-run", "disk-error", "disk-error-2"] and stats.write_failures == 3
    assert stats.trajectories_written == stats.shards_written == 2


def test_a_transfer_writes_one_shard_holding_all_its_requests(rollout):
    """The requests of one result batch (one transfer) are written in one shard of the step (one temporary file,
    fsync, link and directory fsync for the batch, not per request); each is read back bit for bit, bound to its
    own trajectory and token ids, and the step finalizes with every trajectory indexed in that shard."""
    rollout.forward([1, 2, 3], ForwardMode.EXTEND)
    rollout.forward([4, 5], ForwardMode.EXTEND)
    rollout.forward([6, 7, 8, 9], ForwardMode.EXTEND)
    batch = [("a", 0, [1, 2, 3]), ("b", 1, [4, 5]), ("c", 2, [6, 7, 8, 9])]
    assert all("error" not in handle(r) for r in rollout.finish_batch(batch))
    rollout.capturer.flush()
    (shard,) = shard_paths(step_dir(rollout.args.trace_store, 0))
    assert list(read_header(shard)["trajectories"]) == ["a", "b", "c"]
    stats = rollout.capturer.stats
    assert (stats.transfers, stats.shards_written, stats.trajectories_written, stats.write_failures) == (1, 1, 3, 0)
    finalize_step(rollout.args.trace_store, 0, attempts={"a": "", "b": "", "c": ""})
    reader = RecordReader(rollout.args.trace_store, 0)
    assert reader.index == {"a": shard.name, "b": shard.name, "c": shard.name}
    for rid, _, slots in batch:
        check_store(rollout, 0, rid, slots)
        assert reader.binding(rid) == Binding(0, 0, rid, "", token_digest([*slots, 0]))


def test_a_request_refused_on_the_writer_thread_fails_alone_and_the_rest_share_a_shard(rollout):
    """With routes not returned, the record rows are checked on the writer thread, per request: the one request
    of the transfer whose forward missed a hook is marked failed by itself, and the other requests of the transfer
    are written together in one shard, bit for bit."""
    rollout.capturer.return_routes = False
    rollout.forward([1, 2], ForwardMode.EXTEND)
    rollout.forward([3, 4], ForwardMode.EXTEND, graph_replay=True, skip_moe=(1,))
    rollout.forward([5, 6, 7], ForwardMode.EXTEND)
    batch = [("ok-1", 0, [1, 2]), ("refused", 1, [3, 4]), ("ok-2", 2, [5, 6, 7])]
    assert all("error" not in handle(r) for r in rollout.finish_batch(batch))  # refused after the handle
    rollout.capturer.flush()
    (shard,) = shard_paths(step_dir(rollout.args.trace_store, 0))
    assert list(read_header(shard)["trajectories"]) == ["ok-1", "ok-2"]
    check_store(rollout, 0, "ok-1", [1, 2])
    check_store(rollout, 0, "ok-2", [5, 6, 7])
    with pytest.raises(FailedRecordError, match="hook did not run"):
        RecordReader(rollout.args.trace_store, 0).load([("refused", 0, 2)])
    stats = rollout.capturer.stats
    assert stats.failed == ["refused"] and stats.write_failures == 1
    assert (stats.transfers, stats.shards_written, stats.trajectories_written) == (1, 1, 2)


def test_a_retry_in_the_same_transfer_goes_in_a_second_shard_and_finalize_indexes_it(rollout):
    """Two attempts of trajectory x finish in one result batch with y: a trajectory id is never twice in a shard,
    so the retry x#2 goes in a second shard. Finalizing with x's attempt 2 keeps the shard mixing x#1 and y (y
    indexed there, x#1 left out and listed as stale) and the reader returns the retry's records."""
    rollout.forward([1, 2, 3], ForwardMode.EXTEND)
    rollout.forward([4, 5], ForwardMode.EXTEND)
    rollout.forward([6, 7, 8, 9], ForwardMode.EXTEND)
    rollout.finish_batch([("x#1", 0, [1, 2, 3]), ("y#1", 1, [4, 5]), ("x#2", 2, [6, 7, 8, 9])])
    rollout.capturer.flush()
    store = rollout.args.trace_store
    mixed, retry = shard_paths(step_dir(store, 0))  # one writer: its shards in write order
    assert list(read_header(mixed)["trajectories"]) == ["x", "y"] and list(read_header(retry)["trajectories"]) == ["x"]
    assert (rollout.capturer.stats.shards_written, rollout.capturer.stats.trajectories_written) == (2, 3)
    index = finalize_step(store, 0, attempts={"x": "2", "y": "1"})
    assert json.loads(index.read_bytes())["stale"] == [{"shard": mixed.name, "trajectories": ["x"], "set_aside": False}]
    reader = RecordReader(store, 0)
    assert reader.index == {"x": retry.name, "y": mixed.name}
    assert reader.binding("x") == Binding(0, 0, "x", "2", token_digest([6, 7, 8, 9, 0]))
    check_store(rollout, 0, "x", [6, 7, 8, 9])
    check_store(rollout, 0, "y", [4, 5])


def test_chunked_update_may_split_gate_and_up_but_no_forward_runs_half_updated(rollout):
    """A weight update sent in chunks (one update_weights_from_disk per chunk here) may carry an expert's gate and
    up in different chunks; that is fine until a forward runs in between."""
    chunks = iter([("w1",), ("w3", "w2")])

    def reload(recv_req):
        rollout.load_weights(next(chunks))
        return True, "ok"

    updater = weight_updater(SimpleNamespace(update_weights_from_disk=reload))
    req = UpdateWeightFromDiskReqInput(model_path="unused", weight_version="2", flush_cache=False)
    assert updater.update_weights_from_disk(req).success  # gates only
    with pytest.raises(RuntimeError, match="half updated"):
        rollout.forward([1], ForwardMode.EXTEND)
    assert updater.update_weights_from_disk(req).success  # ups and downs
    rollout.forward([1, 2], ForwardMode.EXTEND)
    assert handle(rollout.finish("after-update", 0, [1, 2]))["step"] == 2


def test_one_result_batch_is_one_transfer_and_requests_of_an_unclosed_batch_are_refused(rollout, monkeypatch, caplog):
    """Requests finishing in one result batch move in one transfer when the batch is streamed; a request whose
    batch was never streamed before the next forward (its slots may be reused) is refused, not stored. The finish
    path's time and bytes are counted, and a batch slower than `SLOW_FINISH_S` is logged with its ring waits."""
    import logging

    import sglang_trace.capturer as capturer_module

    rollout.capturer.return_routes = False
    monkeypatch.setattr(capturer_module, "SLOW_FINISH_S", 0.0)
    rollout.forward([1, 2, 3], ForwardMode.EXTEND)
    rollout.forward([4, 5], ForwardMode.EXTEND)
    with caplog.at_level(logging.INFO, logger=capturer_module.logger.name):
        rollout.finish_batch([("a", 0, [1, 2, 3]), ("b", 1, [4, 5])])
    stats = rollout.capturer.stats
    assert (stats.batches, stats.transfers, stats.requests) == (1, 1, 2)
    assert rollout.capturer.ring.stats.reserves == 1 and rollout.capturer.ring.stats.bytes == 5 * (
        rollout.capturer.kv_bytes + rollout.capturer.row_bytes
    )
    assert stats.host_bytes == 5 * (rollout.capturer.kv_bytes + rollout.capturer.row_bytes) and stats.finish_s > 0
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("TRACE finish: 2 requests, 5 tokens")]
    check_store(rollout, 0, "a", [1, 2, 3])
    check_store(rollout, 0, "b", [4, 5])
    processor, _ = rollout.processors()
    processor._maybe_collect_routed_experts(rollout.request("unclosed", 2, [4, 5], r3=False))  # no stream_output
    rollout.forward([4, 5], ForwardMode.EXTEND)  # the next forward before the batch was streamed
    rollout.capturer.flush()
    assert stats.failed == ["unclosed"] and stats.transfers == 1 and stats.write_s > 0
    with pytest.raises(FailedRecordError, match="result batch was not closed"):
        RecordReader(rollout.args.trace_store, 0).load([("unclosed", 0, 2)])


def test_server_info_reports_the_finish_path_counters(rollout):
    """SGLang's own `Scheduler.get_internal_state` (what `/server_info` returns under `internal_states`), with the
    plugin's AFTER hook: TRACE's counters under "trace", as `bench/serve.py` reads them per point."""
    from sglang.srt.managers.io_struct import GetInternalStateReq
    from sglang.srt.managers.scheduler import Scheduler

    from bench.serve import server_summary
    from bench.serve_records import finish_path

    cap = rollout.capturer
    cap.return_routes = False
    before = cap.counters()
    rollout.forward([1, 2, 3], ForwardMode.EXTEND)
    rollout.forward([4, 5], ForwardMode.EXTEND)
    rollout.finish_batch([("a", 0, [1, 2, 3]), ("b", 1, [4, 5])])
    cap.flush()
    runner = SimpleNamespace(weight_load_mem_usage=1.0, graph_mem_usage=0.0)
    scheduler = SimpleNamespace(  # the attributes get_internal_state reads
        metrics_reporter=SimpleNamespace(last_gen_throughput=0.0),
        tp_worker=SimpleNamespace(model_runner=runner),
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: SimpleNamespace(mem_usage=0.5)),
        max_total_num_tokens=64,
        max_running_requests=16,
        spec_algorithm=SpeculativeAlgorithm.NONE,
    )
    state = Scheduler.get_internal_state(scheduler, GetInternalStateReq()).internal_state
    trace = state["trace"]
    assert json.loads(json.dumps(trace)) == trace  # plain numbers: /server_info serves it as JSON
    assert (trace["requests"], trace["batches"], trace["transfers"], trace["trajectories_written"]) == (2, 1, 1, 2)
    assert trace["tokens"] == 5 and trace["host_bytes"] == 5 * (cap.kv_bytes + cap.row_bytes)
    assert trace["finish_s"] == cap.stats.finish_s > 0 and trace["write_s"] == cap.stats.write_s > 0
    assert trace["failed"] == 0 and trace["ring"]["reserves"] == 1 and trace["ring"]["stalls"] == 0
    assert trace["ring"]["capacity"] == cap.ring.capacity and trace["token_bytes"] == cap.token_bytes
    assert state["memory_usage"]["token_capacity"] == 64  # SGLang's own state is still there
    point = finish_path(before, trace)  # what the serving bench makes of one point
    assert (point["finish_requests"], point["finish_tokens_per_request"], point["finish_transfers"]) == (2, 2.5, 1)
    assert point["finish_ms_per_request"] == pytest.approx(1e3 * cap.stats.finish_s / 2)
    assert point["writer_GBps"] == pytest.approx(trace["host_bytes"] / cap.stats.write_s / 1e9)
    assert point["ring_wait_s"] == 0 and point["record_write_failures"] == 0
    assert trace["fence"]["held_tokens"] == 0 and point["fence_alloc_waits"] == 0  # CPU: the copies ran at once
    server = server_summary({"internal_states": [state]}, start_s=1.0)  # the bench's record of the server
    assert server["host_ring"] == {
        "gib": cap.ring.capacity / 2**30,
        "tokens": cap.ring_tokens,
        "token_bytes": cap.token_bytes,
    }
    assert server["finish_device_reserved_gib"] == trace["device_reserved_bytes"] / 2**30 == 0.5


RING_LINE = re.compile(r"host ring ([\d.]+) GiB \((\d+) tokens of (\d+) bytes")


def test_the_server_logs_its_host_ring_at_start_up(tmp_path, caplog):
    """`install_capturer` logs the host ring it allocated (size, tokens, bytes per token), for the operator."""
    import logging

    with caplog.at_level(logging.INFO, logger=hooks.logger.name):
        r = Rollout(str(tmp_path / "records"))
    try:
        found = [RING_LINE.search(rec.getMessage()) for rec in caplog.records]
        ring = next(m for m in found if m is not None)
        assert float(ring[1]) == round(r.capturer.ring.capacity / 2**30, 2)
        assert (int(ring[2]), int(ring[3])) == (r.capturer.ring_tokens, r.capturer.token_bytes)
    finally:
        r.capturer.close()


def test_a_batch_larger_than_the_host_transfer_moves_in_several_transfers(rollout, monkeypatch):
    """A result batch whose records exceed `TRANSFER_BYTES` (here three tokens' host bytes) moves in transfers of at
    most that much, in order; a longer request goes alone; every request is stored whole."""
    import sglang_trace.capturer as capturer_module

    cap = rollout.capturer
    cap.return_routes = False
    monkeypatch.setattr(capturer_module, "TRANSFER_BYTES", 3 * cap.token_bytes)
    rollout.forward([1, 2, 3, 4], ForwardMode.EXTEND)
    rollout.forward([5, 6], ForwardMode.EXTEND)
    rollout.forward([7], ForwardMode.EXTEND)
    rollout.finish_batch([("long", 0, [1, 2, 3, 4]), ("b", 1, [5, 6]), ("c", 2, [7])])
    stats = cap.stats
    assert (stats.batches, stats.transfers, stats.pieces, stats.requests) == (1, 2, 2, 3)  # [long], [b, c]
    assert cap.ring.stats.reserves == 2 and stats.host_bytes == 7 * (cap.kv_bytes + cap.row_bytes)
    for rid, slots in (("long", [1, 2, 3, 4]), ("b", [5, 6]), ("c", [7])):
        check_store(rollout, 0, rid, slots)


def test_a_transfer_runs_in_device_pieces_of_at_most_the_staging_bytes(rollout, monkeypatch):
    """The device work of a transfer (record rows, raw K/V rows and the low bits taken from them: `transfer_bytes`
    a token) runs in pieces of at most `STAGING_BYTES` (here two tokens' worth), each copied to its place in the
    transfer's one host span, however long the request; the stored records are those of one piece."""
    import sglang_trace.capturer as capturer_module

    cap = rollout.capturer
    cap.return_routes = False
    raw = cap.kv_gather.width
    assert cap.transfer_bytes == cap.row_bytes + cap.kv_bytes + 2 * raw and raw > cap.kv_bytes
    monkeypatch.setattr(capturer_module, "STAGING_BYTES", 2 * cap.transfer_bytes + 1)
    staged = []
    stage = cap._stage
    monkeypatch.setattr(cap, "_stage", lambda rec, slots, *a: staged.append(slots.tolist()) or stage(rec, slots, *a))
    rollout.forward([1, 2, 3, 4, 5], ForwardMode.EXTEND)
    rollout.forward([6, 7], ForwardMode.EXTEND)
    rollout.finish_batch([("long", 0, [1, 2, 3, 4, 5]), ("b", 1, [6, 7])])
    stats = cap.stats
    assert (stats.transfers, stats.pieces) == (1, 4) and staged == [[1, 2], [3, 4], [5, 6], [7]]
    assert cap.ring.stats.reserves == 1 and stats.host_bytes == 7 * (cap.kv_bytes + cap.row_bytes)
    for rid, slots in (("long", [1, 2, 3, 4, 5]), ("b", [6, 7])):
        check_store(rollout, 0, rid, slots)


def test_the_serving_benchs_finish_path_reads_a_server_that_stores_no_records():
    """`bench/serve.py` reads the finish-path counters of every TRACE server, also one with `--trace-sites none`,
    which has no slot fence (it stores nothing)."""
    from bench.serve_records import finish_path

    none = Rollout(None, trace_sites="none")
    counters = none.capturer.counters()
    assert counters["fence"] is None and none.capturer.fence is None
    point = finish_path(counters, counters)
    assert point["fence_alloc_waits"] is None and point["finish_requests"] == 0
    none.capturer.close()


def test_the_kv_budget_keeps_the_finish_paths_device_buffers(rollout, monkeypatch):
    """TRACE's AFTER hook on SGLang's `_profile_available_bytes` (the method `_resolve_memory_pool_config` sizes the
    KV pool from) takes the finish path's device buffers off the budget: `STAGING_BYTES` (one piece at a time)
    with records on, nothing with `--trace-sites none` or TRACE off; a budget that cannot hold them is refused
    naming `--mem-fraction-static`. SGLang's memory probe and world group are stood in for (no GPU here)."""
    import sglang.srt.model_executor.model_runner_kv_cache_mixin as mixin

    from sglang_trace.capturer import STAGING_BYTES

    free_gb = 40.0
    monkeypatch.setattr(mixin, "get_available_gpu_memory", lambda *a, **k: free_gb)
    monkeypatch.setattr(mixin, "get_world_group", lambda: SimpleNamespace(world_size=1, cpu_group=None))

    fraction, pre_gb = 0.85, 60.0

    def available(server_args: ServerArgs) -> int:
        runner = SimpleNamespace(
            server_args=server_args, device="cpu", gpu_id=0, mem_fraction_static=fraction, mambaish_config=None
        )
        return mixin.ModelRunnerKVCacheMixin._profile_available_bytes(runner, pre_gb)

    on = rollout.args
    off = ServerArgs(model_path="dummy", device="cpu", kv_cache_dtype="fp4_e2m1")
    none = dataclasses.replace(on, trace_sites="none", trace_store=None)
    upstream = int((free_gb - pre_gb * (1 - fraction)) * (1 << 30))
    assert available(off) == available(none) == upstream
    assert available(on) == upstream - STAGING_BYTES
    assert rollout.capturer.counters()["device_reserved_bytes"] == STAGING_BYTES
    free_gb = pre_gb * (1 - fraction) + 0.25  # 0.25 GiB left for the KV pool
    with pytest.raises(ValueError, match=r"finish path needs 0\.50 GiB .*0\.85 leaves 0\.25 GiB .* raise --mem-frac"):
        available(on)


def test_host_memory_is_a_bounded_ring_whatever_the_kv_pool_size(rollout, monkeypatch):
    """The record store lives on the forward's device (one row per KV slot, counted in SGLang's KV budget by
    `record_bytes_per_token`); the host holds only the ring: `RING_BYTES` (here 1 MiB) bounded by the KV pool's
    tokens and at least two requests of the context length, or `--trace-host-ring-gb`, whatever the pool size."""
    import sglang_trace.capturer as capturer_module

    monkeypatch.setattr(capturer_module, "RING_BYTES", 1 << 20)
    layout = rollout.capturer.layout

    def build(num_slots: int, args=rollout.capturer.args) -> TraceCapturer:
        return TraceCapturer(
            args,
            layout,
            kv_pool=rollout.pool,
            max_tokens=16,
            num_slots=num_slots,
            max_request_tokens=32,
            device="meta",  # the store's device; nothing is allocated for it here
            return_routes=False,
            weights=hooks.EXPERT_WEIGHTS,
        )

    small, mid, huge = build(64), build(1000), build(10**12)
    token = small.kv_bytes + small.row_bytes
    assert small.token_bytes == token and small.ring.capacity == 2 * 32 * token  # two requests of the context
    assert mid.ring.capacity == 1000 * token < 1 << 20  # the pool's tokens: no batch finishes more
    assert huge.ring_tokens == (1 << 20) // token and huge.ring.capacity == huge.ring_tokens * token  # whole tokens
    sized = build(10**12, dataclasses.replace(rollout.capturer.args, host_ring_gb=0.001))
    assert sized.ring_tokens == int(0.001 * 2**30) // token
    with pytest.raises(ValueError, match=r"--trace-host-ring-gb 1e-06: 1073 bytes cannot hold one request of 32"):
        build(64, dataclasses.replace(rollout.capturer.args, host_ring_gb=1e-6))
    assert huge.records.store.device.type == "meta" and huge.records.store.shape[0] == 10**12
    runner = SimpleNamespace(server_args=rollout.args, model_config=SimpleNamespace(hf_config=qwen3_moe()), tp_size=1)
    assert hooks.record_bytes_per_token(runner) == rollout.capturer.records.row.row_bytes
    # under TP every rank counts the largest rank's record shard (test_sglang_config checks the shards)
    runner.tp_size = 2
    r3 = rollout.args.enable_return_routed_experts  # rank 0 then keeps every route
    assert hooks.record_bytes_per_token(runner) == record_bytes_per_slot(rollout.capturer.args, layout, 2, r3)
    assert hooks.record_bytes_per_token(runner) < rollout.capturer.row_bytes
    assert record_bytes_per_slot(rollout.capturer.args, layout) == rollout.capturer.row_bytes
    with pytest.raises(ValueError, match="cannot hold one request of 32 tokens"):
        TraceCapturer(
            rollout.capturer.args,
            layout,
            kv_pool=rollout.pool,
            max_tokens=16,
            num_slots=64,
            max_request_tokens=32,
            device="cpu",
            return_routes=False,
            weights=hooks.EXPERT_WEIGHTS,
            host_ring_bytes=1000,
        )
    for cap in (small, mid, huge, sized):
        cap.close()


def test_the_kv_budget_counts_the_record_store(rollout):
    """TRACE's AFTER hook on `DefaultPoolConfigurator._compute_cell_size`: SGLang's own pool configurator (chosen by
    its factory, as `_resolve_memory_pool_config` does) adds the record store's bytes per slot to the KV cell size,
    so the pool it sizes from the available memory leaves room for the store; TRACE off leaves SGLang's cell."""
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator, create_memory_pool_configurator

    def runner(server_args: ServerArgs) -> SimpleNamespace:
        config = SimpleNamespace(
            hf_config=qwen3_moe(),
            head_dim=HEAD_DIM,
            v_head_dim=HEAD_DIM,
            get_num_kv_heads=lambda tp: KV_HEADS // tp,
        )
        return SimpleNamespace(
            server_args=server_args,
            model_config=config,
            is_hybrid_swa=False,
            is_draft_worker=False,
            mambaish_config=None,
            num_effective_layers=LAYERS,
            kv_cache_dtype=torch.float4_e2m1fn_x2,
            use_mla_backend=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            tp_size=1,
        )

    off = create_memory_pool_configurator(
        runner(ServerArgs(model_path="dummy", device="cpu", kv_cache_dtype="fp4_e2m1"))
    )
    on = create_memory_pool_configurator(runner(rollout.args))
    assert type(off) is type(on) is DefaultPoolConfigurator
    record = rollout.capturer.records.row.row_bytes
    cell = off._cell_size  # SGLang's own KV cell (TRACE off adds nothing)
    assert cell > 0 and on._cell_size == cell + record
    available = 10**9
    tokens_off = off.calculate_pool_sizes(available, page_size=1).max_total_num_tokens
    tokens_on = on.calculate_pool_sizes(available, page_size=1).max_total_num_tokens
    assert (tokens_off, tokens_on) == (available // cell, available // (cell + record))
    assert tokens_on < 0.95 * tokens_off  # the record row is a real share of each cell here
