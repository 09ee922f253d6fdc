"""`TraceCapturer`: SGLang's routed-experts (R3) capturer seam, taken over to capture TRACE records.

SGLang already calls its global experts capturer at the three moments record capture needs: `capture(layer_id,
topk_ids)` in every MoE layer's top-k (inside CUDA graphs), `on_forward_end(forward_batch, ...)` after every
forward, and `get_routed_experts(...)` for every finished request just before its KV is released. The patched
`RoutedExpertsCapturer.create` returns a `TraceCapturer` when `--trace-mode` is not off, which
  * stages the MoE-input records (written by the FusedMoE hook, `moe_input`) and the routes of every MoE layer in a
    `trace_core.capture.RecordCapturer` (fixed staging rows; on CUDA an async pinned host ring keyed by KV slot, so
    R3's synchronous device-to-host copy is gone);
  * at request finish (`finish_request`, called by the patched `maybe_collect_routed_experts` with the request)
    gathers the request's MoE records and routes by its slots, reads its K/V records out of the FP4 KV pool, hands
    them to the record store on a writer thread and returns the handle `meta_info["trace"]` carries;
  * still answers `get_routed_experts` in R3's format (`[seqlen - 1, num_hidden_layers, topk]` int32) when
    `--enable-return-routed-experts` is on.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from sglang.srt.layers.moe.routed_experts_capturer import RoutedExpertsCapturer

from sglang_trace.config import ModelLayout, TraceArgs, kv_kinds, model_spec
from sglang_trace.kv import gather_kv_raw, gather_kv_raw_tp, kv_records_from_shards, request_slots
from sglang_trace.moe import ExpertWeights, emulate_moe_input, fc2_input, native_moe_input
from trace_core.capture import RecordCapturer
from trace_core.records import Binding, ModelShape, token_digest
from trace_core.store import StepWriter, TrajectoryRecords, parse_rollout_rid, write_failure

logger = logging.getLogger(__name__)

UNKNOWN_VERSION = -1  # rows computed after a weight update that carried no usable weight_version
MAX_PENDING_WRITES = 256  # shards queued for the writer thread before request finish waits (backpressure)


@dataclass
class TraceStats:
    """Counters a server reports: requests and tokens recorded, store writes done, failed (records refused or
    the write failed) and waits on a full write queue."""

    requests: int = 0
    tokens: int = 0
    shards_written: int = 0
    write_failures: int = 0
    write_stalls: int = 0
    failed: list[str] = field(default_factory=list)  # trajectories (rids) refused or not written, last 1000


class TraceCapturer(RoutedExpertsCapturer):
    """Record capture for one scheduler/TP process (see the module docstring).

    Args:
        args: validated `--trace-*` settings. layout: the model's layers and widths.
        kv_pool: the FP4 KV pool (`MHATokenToKVPoolFP4`); None when no k/v site is recorded.
        max_tokens: most token rows one forward runs (R3's device-buffer rows). num_slots: KV slots + page size.
        device: where staging lives. return_routes: answer `get_routed_experts` (R3's flag).
        weights: the emulated expert weights whose completeness every forward checks.
        tp_rank, tp_group: attention-TP rank and group (K/V shards are gathered over it; rank 0 writes the store).
        moe_tp_group: SGLang's MoE-TP `GroupCoordinator` (the FC2-input row amax is taken over it); None for one rank.

    Hook markers (`RecordCapturer(marks=...)`): per MoE layer, the FusedMoE hooks (marked by the FC2-input site in
    emulate mode, the MoE-input site in native mode) and the route capture each mark the forward's rows, in CUDA
    graphs too; a request with a row a hook did not mark is refused, never stored. Every row also carries the weight
    version (RL step) of the forward that wrote it; a request whose rows were computed under another version than
    the step it finishes in is refused.
    """

    def __init__(
        self,
        args: TraceArgs,
        layout: ModelLayout,
        *,
        kv_pool,
        max_tokens: int,
        num_slots: int,
        device: torch.device | str,
        return_routes: bool,
        weights: ExpertWeights,
        tp_rank: int = 0,
        tp_group=None,
        moe_tp_group=None,
    ) -> None:
        if not args.enabled:
            raise ValueError("TraceCapturer needs --trace-mode other than off")
        self.args, self.layout, self.weights = args, layout, weights
        self.spec = model_spec(args, layout)
        if self.spec.attn_layers and kv_pool is None:
            raise ValueError("k/v sites are recorded but no FP4 KV pool was given")
        self.kv_pool, self.kv_kinds = kv_pool, kv_kinds(args)
        self.route_index = {layer: i for i, layer in enumerate(layout.moe_layers)}
        # the FusedMoE hooks of a layer run in one call chain (dispatch -> MoE-input site -> runner -> FC2-input
        # site), so its last hook marks the layer; routes come from the top-k module and are marked separately
        self.moe_mark = "fc2" if args.mode == "emulate" else "moe_in"
        shape = ModelShape(hidden=layout.hidden, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim)
        # MoE inputs and routes are the same on every TP rank; only rank 0 (which writes the store) keeps them
        self.records = (
            RecordCapturer(
                self.spec,
                shape,
                max_tokens=max_tokens,
                num_slots=num_slots,
                sites=[s for s in self.spec.sites() if s[1] == "moe_in"],
                routes=(len(layout.moe_layers), layout.topk),
                device=device,
                marks=2 * len(layout.moe_layers),
                versioned=True,
            )
            if tp_rank == 0
            else None
        )
        self.return_routes = return_routes
        self.tp_rank, self.tp_group, self.moe_tp_group = tp_rank, tp_group, moe_tp_group
        self.step = args.step
        self.stats = TraceStats()
        self._writer = StepWriter(args.store, self.step) if tp_rank == 0 else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trace-store") if tp_rank == 0 else None
        self._writes: list[Future] = []
        self._lock = threading.Lock()
        self._moe_rows: dict[int, int] = {}  # MoE layer -> token rows of its current forward
        self._routes: dict[int, torch.Tensor] = {}  # req_pool_idx -> routes of the request finished last

    # --- forward side -------------------------------------------------------------------------------------------

    def moe_input(self, layer_id: int, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE-input site of FusedMoE layer `layer_id` on its dispatched input `[T, H]`: returns what the
        experts compute with (emulate: the input quantize-dequantized under the recipe; native: `x` itself)."""
        site = (layer_id, "moe_in")
        rows = None
        self._moe_rows[layer_id] = x.shape[0]
        if self.moe_mark == "moe_in":
            self._mark(layer_id, "moe", x.shape[0])
        if self.records is not None and site in self.records.layouts:
            rows = self.records.staging_rows(site, x.shape[0])
        if self.args.mode == "emulate":
            return emulate_moe_input(x, self.spec.bits, rows, self.args.recipe.moe_in)
        if rows is not None:
            if input_scale is None:
                raise ValueError(f"native MoE-input records of layer {layer_id} need the layer's NVFP4 input scale")
            native_moe_input(x, self.spec.bits, input_scale, rows, self.args.recipe.moe_in)
        return x

    def fc2_input(self, layer_id: int, h: torch.Tensor) -> torch.Tensor:
        """The FC2-input site of MoE layer `layer_id` on this rank's `act(gate) * up` rows: what the second GEMM
        computes with (emulate: `trace_core.fc2`'s quantize-dequantize; native: the kernel quantizes)."""
        if self.args.mode != "emulate":
            return h
        # token rows of this layer's forward (the CPU path calls this once per expert, on that expert's rows)
        self._mark(layer_id, "moe", self._moe_rows.get(layer_id, 0))
        return fc2_input(h, self.moe_tp_group, self.args.recipe.fc2_in)

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """R3 hook in every MoE layer's top-k: stage the routes `[T, topk (+ fused shared)]` of `layer_id`."""
        if self.records is not None:
            self.records.stage_routes(self.route_index[layer_id], topk_ids[:, : self.layout.topk])
            self._mark(layer_id, "routes", topk_ids.shape[0])

    def _mark(self, layer_id: int, kind: str, rows: int) -> None:
        """Set the hook marker of (`layer_id`, `kind`: "moe" or "routes") on the forward's token rows [0, rows)
        (rank 0 only)."""
        if self.records is None:
            return
        self.records.mark(2 * self.route_index[layer_id] + (kind == "routes"), rows)

    def on_forward_end(self, forward_batch, can_run_graph: bool, cuda_graph_batch: int | None) -> None:
        """After every forward: ship the staged rows to the host store at the batch's KV slots (async on CUDA)."""
        self.weights.check_complete()
        if self.records is None or forward_batch.forward_mode.is_idle():
            return
        version = UNKNOWN_VERSION if self.step is None else self.step
        self.records.on_forward_end(forward_batch.out_cache_loc, graph_replay=bool(can_run_graph), version=version)

    # --- request finish -----------------------------------------------------------------------------------------

    def finish_request(
        self, rid: str, req_pool_idx: int, seqlen: int, req_to_token_pool, tokens: list[int]
    ) -> dict | None:
        """Records of a finished request (positions [0, seqlen - 1)) to the store; returns the handle on the
        store-writing rank (None elsewhere). Must run before the request's KV is released. `rid` is
        `<trajectory>#<attempt>` (`trace_core.store.rollout_rid`; a plain id is the trajectory of attempt ""), and
        `tokens` the request's prompt + output ids: the records are bound to (step, policy version = step,
        trajectory, attempt, token digest), which the handle repeats.

        The scheduler thread only enqueues work: the K/V rows are indexed out of the pool on the current stream
        (ordered before any reuse of the slots) and copied to pinned memory without waiting; the MoE records and
        routes are read from the host store on the capture drain thread, after every forward submitted so far;
        the writer thread waits for both and writes the shard. Only R3's answer (`--enable-return-routed-experts`)
        is waited for here. A request whose records are refused (a hook did not run, rows of another weight
        version, unwritten rows) or whose write fails is not stored: it is counted in `stats`, logged, and marked
        failed in the store (`trace_core.store.write_failure`, which the reader reports); the server keeps
        serving. When that is known at finish (R3 on), the handle also says so (`"error"`)."""
        if len(tokens) != seqlen:
            raise ValueError(f"request {rid!r}: {len(tokens)} prompt + output ids, seqlen {seqlen}")
        slots = request_slots(req_to_token_pool.req_to_token, req_pool_idx, seqlen)
        length = slots.shape[0]
        raws: list[torch.Tensor] = []
        if self.spec.attn_layers:  # one all-gather over attention TP: every rank takes part
            raw = gather_kv_raw(self.kv_pool, slots, self.spec.attn_layers, self.kv_kinds)
            raws = [raw] if self.tp_group is None else gather_kv_raw_tp(raw, self.tp_group)
        self.stats.requests += 1
        self.stats.tokens += length
        if self._writer is None:
            return None  # other ranks send no output: neither records nor R3 routes are needed there
        writer, step = self._writer, self.step
        trajectory, attempt = parse_rollout_rid(str(rid))
        handle = {
            "store": str(self.args.store),
            "step": step,
            "trajectory": trajectory,
            "attempt": attempt,
            "policy_version": step,
            "tokens": length,
        }
        if step is None:
            self._failed(trajectory, attempt, None, "the weights were updated without an integer weight_version")
            return {**handle, "error": "TRACE records refused: the weights were updated without a weight_version"}
        binding = Binding(step, step, trajectory, attempt, token_digest(tokens), self.args.recipe.name)
        handle["token_digest"] = binding.tokens
        moe = self.records.gather_async(slots, length, version=step)
        kv, copied = _to_host(raws)
        if self.return_routes:
            try:
                self._routes[req_pool_idx] = self._r3_routes(moe.result().routes)
            except ValueError as e:
                self._failed(trajectory, attempt, step, f"records refused: {e}")
                return {**handle, "error": f"TRACE records refused: {e}"}
        self._bound_writes()
        self._writes.append(self._pool.submit(self._write, writer, binding, length, moe, kv, copied))
        return handle

    def _write(
        self,
        writer: StepWriter,
        binding: Binding,
        length: int,
        moe: Future,
        raws: list[torch.Tensor],
        copied: torch.cuda.Event | None,
    ) -> None:
        """Writer thread: one trajectory's shard (K/V records unpacked from the ranks' raw bytes here, off the
        scheduler thread); a refusal or write error is counted, logged and marked in the store, never raised."""
        try:
            gathered = moe.result()
            if copied is not None:
                copied.synchronize()
            kv = {}
            if raws:
                pool = getattr(self.kv_pool, "full_kv_pool", self.kv_pool)
                kv = kv_records_from_shards(
                    raws,
                    self.spec.attn_layers,
                    self.kv_kinds,
                    self.spec.bits,
                    shard_width=pool.head_num * pool.head_dim,
                    num_kv_heads=self.layout.num_kv_heads,
                )
            records = {**gathered.records, **kv}
            tr = TrajectoryRecords(num_tokens=length, records=records, routes=gathered.routes, binding=binding)
            writer.write({binding.trajectory: tr})
        except Exception as e:
            self._failed(binding.trajectory, binding.attempt, binding.step, f"{type(e).__name__}: {e}")
            return
        with self._lock:
            self.stats.shards_written += 1

    def _failed(self, trajectory: str, attempt: str, step: int | None, message: str) -> None:
        """Count and log a request whose records are not stored; mark it failed in the store when its step is
        known (a marker that cannot be written either is logged too)."""
        logger.error("TRACE records of trajectory %s (attempt %r) not stored: %s", trajectory, attempt, message)
        with self._lock:
            self.stats.write_failures += 1
            self.stats.failed = (self.stats.failed + [trajectory])[-1000:]
        if step is None:
            return
        try:
            write_failure(self.args.store, step, trajectory, attempt, message)
        except OSError as e:
            logger.error("TRACE could not mark trajectory %s failed in the store: %s", trajectory, e)

    def _bound_writes(self) -> None:
        """Backpressure: at most `MAX_PENDING_WRITES` shards queued; a full queue waits for the oldest (counted)."""
        self._writes = [f for f in self._writes if not f.done()]
        if len(self._writes) >= MAX_PENDING_WRITES:
            self.stats.write_stalls += 1
            self._writes.pop(0).result()

    def _r3_routes(self, routes: torch.Tensor) -> torch.Tensor:
        """Routes of the MoE layers in R3's layout: `[tokens, num_hidden_layers, topk]`, zeros for other layers."""
        out = torch.zeros(routes.shape[0], self.layout.num_layers, self.layout.topk, dtype=torch.int32)
        out[:, list(self.layout.moe_layers)] = routes
        return out

    def get_routed_experts(self, req_pool_idx: int, seqlen: int, req_to_token_pool) -> torch.Tensor | None:
        """R3's answer for the request `finish_request` just handled (None when R3 is off)."""
        if not self.return_routes:
            return None
        return self._routes.pop(req_pool_idx, None)

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def set_step(self, step: int | None) -> None:
        """Later forwards run the weights of RL step `step` (after a weight update; None: unknown, their requests
        are refused); writes in flight finish first."""
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"RL step must be a non-negative int or None, got {step!r}")
        if step == self.step:
            return
        self.flush()
        logger.info("TRACE step %s done: %s", self.step, self.stats)
        self.step = step
        if self._writer is not None and step is not None:
            self._writer = StepWriter(self.args.store, step)

    def flush(self) -> None:
        """Wait for every store write queued so far (failures are in `stats`)."""
        writes, self._writes = self._writes, []
        for f in writes:
            f.result()

    def close(self) -> None:
        self.flush()
        if self.records is not None:
            self.records.close()
        if self._pool is not None:
            self._pool.shutdown()

    def get_host_cache(self):
        return None if self.records is None else self.records.host

    def get_device_cache(self):
        return None if self.records is None else self.records.staging


def _to_host(raws: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Copies of the ranks' raw K/V bytes in one pinned host tensor (PyTorch's caching host allocator), started
    without waiting; the event marks their end."""
    if not raws or raws[0].device.type != "cuda":
        return raws, None
    stacked = torch.stack(raws) if len(raws) > 1 else raws[0].unsqueeze(0)
    host = torch.empty(stacked.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(stacked, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return list(host.unbind(0)), copied
