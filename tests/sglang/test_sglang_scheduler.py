"""TRACE under SGLang's own scheduler on CPU: the `Scheduler` of sglang 0.5.15.post1 (TRACE's plugin hooks applied
by SGLang's `load_plugins`), built by its own constructor, takes requests, schedules batches and processes their
results; only the model worker and the sockets are replaced.

What runs for real:
  * `Scheduler.__init__`: server-args parsing, the model config read from a model directory, the radix cache and
    the KV allocator built by `init_cache_with_memory_pool` on the worker's pools, chunked prefill, the schedule
    policy, the request dispatcher, the grammar manager;
  * one iteration of `event_loop_normal` at a time (`step`): `get_next_batch_to_run` (the prefill adder with prefix
    matching and chunked prefill, `update_running_batch` with its decode memory check and retraction), `run_batch`
    and `process_batch_result` (its `SchedulerBatchResultProcessor`: finish checks, `release_kv_cache`,
    `_maybe_collect_routed_experts` with TRACE's finish hook; its `SchedulerOutputStreamer.stream_output` with
    TRACE's batch-done hook), which sends `BatchTokenIDOutput` with each TRACE handle in its `customized_info`;
  * `process_input_requests` with `TokenizedGenerateReqInput` and `AbortReq`, as the tokenizer manager sends them.
Replaced: the model worker (`CpuWorker`, SGLang's `BaseTpWorker` whose forward is `test_sglang_rollout.Rollout`'s:
SGLang's patched FusedMoE layers, its FP4 KV pool and the TRACE capturer; sampled ids from a seeded generator) and
the ZMQ sockets (a list). SGLang's `ServerArgs` refuses `--kv-cache-dtype fp4_e2m1` on a machine without CUDA
(`_handle_kv4_compatibility`), so the scheduler's settings record `moe_in` only; the worker's capturer, installed by
`hooks.install_capturer` from the rollout's settings, also records K and V of its FP4 pool.

Every request's stored records must equal the reference quantization of what the forward that last wrote each of
its KV slots computed, read when the request finished (later requests may overwrite the slots).
"""

from array import array
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from tests.sglang_cpu import load_trace_plugin

load_trace_plugin()

import dataclasses  # noqa: E402

from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from sglang.srt.managers.io_struct import (  # noqa: E402
    AbortReq,
    BatchTokenIDOutput,
    TokenizedGenerateReqInput,
    unwrap_from_pickle,
)
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.scheduler_components.ipc_channels import SchedulerIpcChannels  # noqa: E402
from sglang.srt.managers.tp_worker import BaseTpWorker  # noqa: E402
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import PortArgs, ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

from sglang_trace.handle import from_meta_info  # noqa: E402
from tests.sglang.test_sglang_rollout import LAYERS, expected, qwen3_moe, rollout  # noqa: E402, F401 (the fixture)
from trace_core.records.reader import RecordReader  # noqa: E402

MAX_RUNNING, CONTEXT = 4, 32  # the rollout's ReqToTokenPool: 4 rows of 32 slots


@pytest.fixture(autouse=True)
def fresh_runtime_context():
    """A `Scheduler` freezes SGLang's process-wide runtime flags (one scheduler per process in a server); each test
    builds its own, so the context is reset around it (SGLang's own test teardown, `reset_context`)."""
    from sglang.srt.runtime_context import reset_context

    reset_context()
    yield
    reset_context()


class CpuWorker(BaseTpWorker):
    """SGLang's model-worker interface over the rollout: its pools, and a forward that runs the rollout's layers on
    the batch's KV slots and samples the next ids from a seeded generator."""

    def __init__(self, engine, kv_slots: int, model_config) -> None:
        self.engine, self.model_config, self.kv_slots = engine, model_config, kv_slots
        self.runner = SimpleNamespace(
            req_to_token_pool=engine.req_to_token_pool,
            token_to_kv_pool=engine.pool,
            token_to_kv_pool_allocator=TokenToKVPoolAllocator(
                kv_slots, torch.bfloat16, "cpu", engine.pool, need_sort=False
            ),
            is_hybrid_swa=False,
            sliding_window_size=None,
            full_max_total_num_tokens=kv_slots,
            swa_max_total_num_tokens=None,
            memory_pool_config=SimpleNamespace(max_total_num_tokens=kv_slots),  # the pools are built already
            linear_attn_model_spec=None,
            hybrid_gdn_config=None,
            mamba2_config=None,
            kimi_linear_config=None,
            hybrid_lightning_config=None,
            canary_manager=None,
            attn_backend=None,
            prefill_aware_swa=False,
            model=None,
            forward_stream=torch.cpu.Stream(),  # what the overlap scheduler launches forwards on
            update_weights_from_disk=self.reload_weights,
        )
        self.sampler = torch.Generator().manual_seed(7)

    @property
    def model_runner(self):
        return self.runner

    def init_attention_backends(self) -> None:
        """The forward needs none (the rollout's layers write the pool themselves)."""

    def init_cuda_graphs(self) -> None:
        """No CUDA graphs on CPU."""

    def reload_weights(self, model_path: str, load_format, recapture_cuda_graph: bool = False) -> tuple[bool, str]:
        """The model runner's `update_weights_from_disk`: new expert weights through the FusedMoE weight loader."""
        self.engine.load_weights()
        return True, "Succeeded to update model weights."

    def get_worker_info(self):
        """`TpModelWorker.get_worker_info`'s tuple: token budget, prefill budget, running and queued requests,
        request lengths, seed, device, stream, pool sizes."""
        stream = self.runner.forward_stream
        return (self.kv_slots, 16384, MAX_RUNNING, None, CONTEXT, CONTEXT - 1, 0, "cpu", stream, 4, CONTEXT, 64)

    def forward_batch_generation(self, model_worker_batch, *args, **kwargs) -> GenerationBatchResult:
        batch = model_worker_batch
        self.engine.forward(batch.out_cache_loc.tolist(), batch.forward_mode)
        ids = torch.randint(0, 100, (len(batch.seq_lens),), generator=self.sampler)
        return GenerationBatchResult(logits_output=LogitsProcessorOutput(next_token_logits=None), next_token_ids=ids)


class CpuScheduler(Scheduler):
    """SGLang's `Scheduler` with the CPU worker and a list for its sockets. It also notes, for each finished
    request, its KV slots and what the forwards that last wrote them saw (to check the store later)."""

    def __init__(self, engine, kv_slots: int, server_args: ServerArgs) -> None:
        self.engine, self.kv_slots = engine, kv_slots
        self.sent: list = []
        self.launched: list = []  # (forward mode, rids) of every batch launched
        self.finished_slots: dict[str, tuple[list[int], dict]] = {}
        port_args = PortArgs.init_new(server_args)
        super().__init__(server_args, port_args, 0, 0, 0, 0, 0, 0, None)
        self.result_queue: deque = deque()  # event_loop_overlap's
        self.schedule_stream = self.device_module.Stream(priority=0)  # as run_event_loop sets it up on CPU
        self.schedule_stream.synchronize = lambda: None

    def init_ipc_channels(self, port_args) -> None:
        send = SimpleNamespace(send_output=lambda out, *args, **kwargs: self.sent.append(out))
        self.ipc_channels = SchedulerIpcChannels(
            recv_from_tokenizer=None,
            recv_from_rpc=None,
            send_to_tokenizer=send,
            send_to_detokenizer=send,
            send_metrics_from_scheduler=None,
        )
        self.load_snapshot_writer = None

    def init_tp_model_worker(self) -> None:
        self.tp_worker = CpuWorker(self.engine, self.kv_slots, self.model_config)

    def init_batch_result_processor(self) -> None:
        """SGLang's result processor, with one addition at request finish: before SGLang's (and TRACE's) finish
        path runs, note the request's KV slots and what the forwards that last wrote them saw."""
        super().init_batch_result_processor()
        sched, base = self, type(self.batch_result_processor)

        class NotingProcessor(base):
            __slots__ = ()

            def _maybe_collect_routed_experts(self, req) -> None:
                slots = sched.req_to_token_pool.req_to_token[req.req_pool_idx, : req.seqlen - 1].tolist()
                sched.finished_slots[req.rid] = (slots, {s: sched.engine.seen[s] for s in slots})
                super()._maybe_collect_routed_experts(req)

        fields = dataclasses.fields(self.batch_result_processor)
        self.batch_result_processor = NotingProcessor(
            **{f.name: getattr(self.batch_result_processor, f.name) for f in fields}
        )

    def step(self):
        """One iteration of the event loop SGLang runs (`event_loop_overlap` or `event_loop_normal`) after
        receiving requests, on the schedule stream; returns the batch it launched (None while paused, as the loops
        skip scheduling then)."""
        if self._engine_paused:
            return None
        with self.device_module.StreamContext(self.schedule_stream):
            batch = self._step_overlap() if self.enable_overlap else self._step_normal()
        if batch is not None:
            self.launched.append((batch.forward_mode, [r.rid for r in batch.reqs]))
        return batch

    def _step_normal(self):
        batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        if batch:
            self.process_batch_result(batch, self.run_batch(batch))
        self.last_batch = batch
        return batch

    def _step_overlap(self):
        """Schedule and launch a batch, then process the previous batch's results (while the launched one would
        run on the GPU)."""
        batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        disable_overlap_for_batch = self.is_disable_overlap_for_batch(batch)
        if disable_overlap_for_batch:
            self.process_batch_result(*self.result_queue.popleft())
        batch_result = None
        if batch:
            batch_result = self.run_batch(batch)
            self.result_queue.append((batch.copy(), batch_result))
        if self.last_batch and not disable_overlap_for_batch:
            self.process_batch_result(*self.result_queue.popleft())
        self.launch_batch_sample_if_needed(batch_result)
        self.last_batch = batch
        return batch

    def run_until_idle(self, steps: int = 60) -> None:
        """Steps until no batch ran and no request waits."""
        try:
            for _ in range(steps):
                if self.step() is None and not self.waiting_queue and self.chunked_req is None:
                    return
        finally:
            self.cur_batch = None  # idle for SGLang's watchdog thread
        raise AssertionError(f"not idle after {steps} steps: {self.launched[-3:]}")

    def outputs(self) -> dict[str, tuple]:
        """rid -> (TRACE handle, finish reason, retraction count) of every finished request streamed so far; the handle
        as `meta_info["trace"]` carries it (the last entry of the request's `customized_info["trace"]` list)."""
        done = {}
        for out in self.sent:
            if isinstance(out, BatchTokenIDOutput):
                info = unwrap_from_pickle(out.customized_info) or {}
                for i, rid in enumerate(out.rids):
                    if out.finished_reasons[i] is not None:
                        handle = from_meta_info({"trace": info["trace"][i]}) if "trace" in info else None
                        done[rid] = (handle, out.finished_reasons[i], out.retraction_counts[i])
        return done


def request(rid: str, prompt: list[int], new_tokens: int) -> TokenizedGenerateReqInput:
    """What the tokenizer manager sends for a prompt of token ids (sampling parameters normalized as it does)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    params.normalize(None)
    return TokenizedGenerateReqInput(
        rid=rid,
        input_text="",
        input_ids=array("q", prompt),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=params,
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
    )


def scheduler(engine, tmp_path, kv_slots: int, **settings) -> CpuScheduler:
    model = tmp_path / "qwen3-moe-tiny"
    qwen3_moe().save_pretrained(model)
    base = dict(
        model_path=str(model),
        device="cpu",
        attention_backend="torch_native",
        disable_overlap_schedule=True,
        skip_tokenizer_init=True,
        max_running_requests=MAX_RUNNING,
        watchdog_timeout=3600,
        trace_mode="emulate",
        trace_sites="moe_in",  # fp4_e2m1 KV is refused by SGLang without CUDA: the worker's pool records K/V
        trace_store=engine.args.trace_store,
    )
    server_args = ServerArgs(**(base | settings))
    set_global_server_args_for_scheduler(server_args)
    return CpuScheduler(engine, kv_slots, server_args)


def check_finished(sched: CpuScheduler, rids: list[str], step: int = 0) -> dict[str, tuple]:
    """Every request in `rids` finished with an error-free handle naming it and RL step `step`, and its stored
    records equal the reference quantization of what the forwards that last wrote its slots saw when it finished."""
    engine = sched.engine
    engine.capturer.flush()
    outputs = sched.outputs()
    reader = RecordReader(engine.args.trace_store, step)
    for rid in rids:
        handle, _, _ = outputs[rid]
        slots, seen = sched.finished_slots[rid]
        assert handle["trajectory"] == rid and handle["tokens"] == len(slots) and "error" not in handle, handle
        assert handle["step"] == step, handle
        got = reader.load([(rid, 0, len(slots))])
        now, engine.seen = engine.seen, seen
        try:
            for site in [(layer, kind) for layer in range(LAYERS) for kind in ("moe_in", "k", "v")]:
                ref = expected(engine, slots, site)
                assert torch.equal(got.records[site].low_bits[0], ref.low_bits), (rid, site)
                assert torch.equal(got.records[site].scales[0], ref.scales), (rid, site)
        finally:
            engine.seen = now
        routes = torch.stack([torch.stack([seen[s][("routes", la)] for la in range(LAYERS)]) for s in slots])
        assert torch.equal(got.routes[0], routes), rid
    return outputs


def run_four_requests(sched: CpuScheduler) -> None:
    """A and B, then (A's prompt cached, A running) C, whose prompt starts with A's and needs two more chunks, and D."""
    sched.process_input_requests([request("A", [11, 12, 13, 14], 3), request("B", [21, 22, 23], 1)])
    sched.step(), sched.step()  # A's prompt fills the first chunk; B's next (overlap: A's result processed)
    long_prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # A's prompt, then 6 more tokens: 2 chunks
    sched.process_input_requests([request("C", long_prompt, 2), request("D", [31, 32], 5)])
    sched.run_until_idle()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_prefix_sharing_chunked_prefill_and_abort_through_sglangs_scheduler(rollout, tmp_path, overlap):  # noqa: F811
    sched = scheduler(rollout, tmp_path, kv_slots=24, chunked_prefill_size=4, disable_overlap_schedule=not overlap)
    assert sched.enable_overlap == overlap
    assert type(sched.tree_cache).__name__ == "RadixCache" and sched.chunked_prefill_size == 4
    run_four_requests(sched)
    sched.process_input_requests([AbortReq(rid="D")])  # D finished already: nothing to abort
    sched.process_input_requests([request("E", [41, 42, 43], 6)])
    sched.step(), sched.step()  # E's prefill, one decode step
    sched.process_input_requests([AbortReq(rid="E")])  # E is running: it finishes aborted at its next step
    sched.run_until_idle()
    prefills = [rids for mode, rids in sched.launched if mode.is_extend()]
    assert sum("C" in rids for rids in prefills) >= 2, prefills  # C's uncached prompt part went in chunks
    outputs = check_finished(sched, ["A", "B", "C", "D", "E"])
    assert sched.finished_slots["C"][0][:4] == sched.finished_slots["A"][0][:4]  # C hit A's cached prompt
    assert outputs["B"][1]["type"] == "length" and outputs["E"][1]["type"] == "abort"
    assert len(sched.finished_slots["E"][0]) < 3 + 6 - 1  # aborted before its last token
    stats = rollout.capturer.stats
    assert stats.write_failures == 0 and stats.trajectories_written == 5


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_retraction_under_kv_pressure_through_sglangs_scheduler(rollout, tmp_path, overlap):  # noqa: F811
    """A KV pool too small for three requests' outputs: SGLang's decode memory check retracts a request, frees its
    slots, and prefills it again later (prompt and output so far)."""
    # schedule_conservativeness: admit all three at once
    settings = dict(schedule_conservativeness=0.05, disable_overlap_schedule=not overlap)
    sched = scheduler(rollout, tmp_path, kv_slots=20, **settings)
    sched.process_input_requests([request(rid, [10 * i + 1, 10 * i + 2, 10 * i + 3], 9) for i, rid in enumerate("PQR")])
    sched.run_until_idle()
    outputs = check_finished(sched, ["P", "Q", "R"])
    assert max(retracted for _, _, retracted in outputs.values()) >= 1
    assert rollout.capturer.stats.write_failures == 0


@pytest.mark.parametrize(
    ("overlap", "settings"),
    [
        (False, dict(disable_radix_cache=True)),
        (False, dict(enable_mixed_chunk=True)),
        (True, dict(enable_mixed_chunk=True)),
    ],
    ids=["chunk-cache", "mixed-chunk", "mixed-chunk-overlap"],
)
def test_cache_and_batch_modes_through_sglangs_scheduler(rollout, tmp_path, overlap, settings):  # noqa: F811
    """`--disable-radix-cache` (SGLang's ChunkCache: no prefix sharing) and `--enable-mixed-chunk` (decode rows of
    running requests in a prefill chunk's forward), with the normal and the overlap loop."""
    settings = dict(chunked_prefill_size=4, disable_overlap_schedule=not overlap, **settings)
    sched = scheduler(rollout, tmp_path, kv_slots=24, **settings)
    run_four_requests(sched)
    check_finished(sched, ["A", "B", "C", "D"])
    if settings.get("disable_radix_cache"):
        assert type(sched.tree_cache).__name__ == "ChunkCache"
    else:
        assert any(mode.is_mixed() for mode, _ in sched.launched)
    assert rollout.capturer.stats.write_failures == 0 and rollout.capturer.stats.trajectories_written == 4


def test_handles_reach_meta_info_through_sglangs_tokenizer_manager(rollout, tmp_path):  # noqa: F811
    """With `--skip-tokenizer-init` the scheduler sends its `BatchTokenIDOutput` straight to the tokenizer manager,
    whose real `_handle_batch_output` accumulates each request's `customized_info` into `meta_info`: `meta_info[
    "trace"]` is the per-output-token list whose last entry is the handle (`sglang_trace.handle.from_meta_info`),
    with no TRACE patch on that path. The manager is built without its constructor (no sockets, no tokenizer):
    only the state its output handler reads, one `ReqState` per request as `generate_request` registers it. The
    multi-tokenizer split of the same output (`_handle_output_by_index`) keeps each request's handle."""
    import asyncio

    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.multi_tokenizer_mixin import _handle_output_by_index
    from sglang.srt.managers.tokenizer_manager import ReqState, TokenizerManager
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats

    sched = scheduler(rollout, tmp_path, kv_slots=24, chunked_prefill_size=4)
    run_four_requests(sched)
    handles = {rid: handle for rid, (handle, _, _) in sched.outputs().items()}
    assert sorted(handles) == list("ABCD") and all(h["trajectory"] == rid for rid, h in handles.items())
    manager = TokenizerManager.__new__(TokenizerManager)
    manager.server_args, manager.enable_metrics = sched.server_args, False
    manager.dump_requests_folder = manager.crash_dump_folder = None
    states = {
        rid: ReqState([], False, asyncio.Event(), GenerateReqInput(input_ids=[1], rid=rid), APIServerReqTimeStats())
        for rid in "ABCD"
    }
    manager.rid_to_state = dict(states)
    outputs = [out for out in sched.sent if isinstance(out, BatchTokenIDOutput) and out.rids]
    for out in outputs:
        asyncio.run(manager._handle_batch_output(out))
    for rid, state in states.items():
        meta = state.out_list[-1]["meta_info"]
        assert state.finished and from_meta_info(meta) == handles[rid]
        assert len(meta["trace"]) == len(state.out_list[-1]["output_ids"])  # one entry per output token
    assert not manager.rid_to_state  # every request finished and was released
    for out in outputs:
        for i, rid in enumerate(out.rids):
            if out.finished_reasons[i] is not None:
                single = _handle_output_by_index(out, i)
                assert from_meta_info({"trace": unwrap_from_pickle(single.customized_info)["trace"][0]}) == handles[rid]


def test_weight_updates_through_sglangs_scheduler(rollout, tmp_path):  # noqa: F811
    """`UpdateWeightFromDiskReqInput` through the scheduler's dispatcher and its real `SchedulerWeightUpdaterManager.
    update_weights_from_disk` (TRACE's AFTER hook sets the step): with `flush_cache=False` a request reusing a
    prompt cached under the old weights is refused (error in its handle, marked failed in the store), never filed
    under the new step; with a flush (SGLang's real
    `flush_cache` empties the radix tree) the next request's records are stored under the new step."""
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

    from trace_core.records.reader import FailedRecordError

    sched = scheduler(rollout, tmp_path, kv_slots=24)
    prompt = [11, 12, 13, 14]
    sched.process_input_requests([request("A", prompt, 2)])
    sched.run_until_idle()
    check_finished(sched, ["A"], step=0)
    update = UpdateWeightFromDiskReqInput(model_path="new-weights", weight_version="1", flush_cache=False)
    sched.process_input_requests([update])
    assert rollout.capturer.step == 1 and sched.tree_cache.total_size() > 0  # the cache kept A's prompt
    sched.process_input_requests([request("B", prompt + [15], 2)])
    sched.run_until_idle()
    handle = sched.outputs()["B"][0]
    assert sched.finished_slots["B"][0][:4] == sched.finished_slots["A"][0][:4]  # B reused A's old-weight prompt
    assert handle["step"] == 1 and "computed under weight versions [0, 1]" in handle["error"]
    rollout.capturer.flush()
    with pytest.raises(FailedRecordError, match="weight versions"):
        RecordReader(rollout.args.trace_store, 1).load([("B", 0, 5)])
    sched.process_input_requests([UpdateWeightFromDiskReqInput(model_path="new-weights", weight_version="2")])
    assert rollout.capturer.step == 2 and sched.tree_cache.total_size() == 0  # flushed
    sched.process_input_requests([request("C", prompt + [15], 2)])
    sched.run_until_idle()
    check_finished(sched, ["C"], step=2)


def test_an_in_place_pause_across_a_weight_update_through_sglangs_scheduler(rollout, tmp_path):  # noqa: F811
    """`PauseGenerationReqInput(mode="in_place")`, an update without a flush, `ContinueGenerationReqInput`, all
    through the scheduler's dispatcher: the running request keeps its old-weight KV and finishes under the new
    weights, so its records are refused (error in its handle), never filed under the new step."""
    from sglang.srt.managers.io_struct import (
        ContinueGenerationReqInput,
        PauseGenerationReqInput,
        UpdateWeightFromDiskReqInput,
    )

    sched = scheduler(rollout, tmp_path, kv_slots=24)
    sched.process_input_requests([request("R", [51, 52, 53], 6)])
    sched.step(), sched.step()  # prefill, one decode step
    sched.process_input_requests([PauseGenerationReqInput(mode="in_place")])
    assert sched.step() is None and sched.running_batch.reqs  # paused with R running
    update = UpdateWeightFromDiskReqInput(model_path="new-weights", weight_version="1", flush_cache=False)
    sched.process_input_requests([update, ContinueGenerationReqInput()])
    sched.run_until_idle()
    handle = sched.outputs()["R"][0]
    assert handle["step"] == 1 and "computed under weight versions [0, 1]" in handle["error"]
    rollout.capturer.flush()
    assert rollout.capturer.stats.trajectories_written == 0 and rollout.capturer.stats.failed == ["R"]
