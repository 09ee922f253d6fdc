"""`TraceCapturer`: SGLang's routed-experts (R3) capturer seam, taken over to capture TRACE records.

SGLang already calls its global experts capturer (`sglang.srt.state_capturer`) where record capture needs it:
`capture(layer_id, topk_indices)` in every MoE layer's top-k (inside CUDA graphs) and `on_forward_end(forward_batch,
...)` after every forward; the plugin hook on `ModelRunner.init_routed_experts_capturer` installs a `TraceCapturer`
in its place when `--trace-mode` is not off, which
  * stages the MoE-input records (written by the FusedMoE hook, `moe_input`) and the routes of every MoE layer in a
    `trace_core.records.capture.RecordCapturer` (fixed staging rows, copied after every forward into a store keyed by KV
    slot on the GPU, next to the KV cache; SGLang's memory budget counts it per token, patch 0013);
  * at request finish (`finish_request`, called for every finished request before its KV is released, by the
    plugin hook on `_maybe_collect_routed_experts`) returns the handle `meta_info["trace"]` carries and queues the
    request; when the scheduler has processed a result batch (`on_batch_done`, the hook on `stream_output`) it
    queues the gathers of every queued request's records and K/V and their copy into a bounded host ring on a
    stream of its own (the `SlotFence` holds the requests' KV slots until the copies ran, so the scheduler thread
    does not wait for the host link) and hands them to a writer thread, which collects the attention-TP ranks' K/V
    and record shards in one gather and writes the store's shards;
  * under attention TP keeps only its share of the MoE layers' records, markers and routes (`record_shards`;
    the inputs and routes are the same on every rank), so each rank's record store is about 1 / TP of one rank's;
  * still answers R3's `get_topk` (`[seqlen - 1 - start_len, num_hidden_layers, topk]` int32) when
    `--enable-return-routed-experts` is on; its routes come from the same record rows, so they reach the store
    whether or not a request asked for them.
With `--trace-sites none` (`TraceArgs.records` False) it runs the recipe's numerics hooks only: no record rows, host
ring, writer or handle, nothing reaches a store; with `--enable-return-routed-experts` rank 0 keeps routes-only rows
for R3's answer (checked as above), which are never stored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from sglang.srt.state_capturer.routed_experts import RoutedExpertsCapturer

from sglang_trace.config import ModelLayout, TraceArgs, kv_kinds, layout_fields, model_spec
from sglang_trace.debug import DebugTap
from sglang_trace.kv import gather_to_first, kv_records_from_shards, kv_row_bytes, request_slots
from sglang_trace.kv_gather import KVGather
from sglang_trace.moe import ExpertWeights, emulate_moe_input, fc2_input, native_moe_input
from sglang_trace.slot_fence import SlotFence
from trace_core.numerics.formats import FP4Format
from trace_core.records.capture import RecordCapturer, RowReader, record_row_layout, shard_layers
from trace_core.records.host_ring import HostRing, RingStats
from trace_core.records.layout import TrajectoryRecords
from trace_core.records.spec import Binding, ModelShape, token_digest
from trace_core.records.store import StepWriter, parse_rollout_rid, write_failure
from trace_core.sites import Site

logger = logging.getLogger(__name__)

UNKNOWN_VERSION = -1  # rows computed after a weight update that carried no usable weight_version
RING_REQUESTS = 2  # the default host ring holds at least this many requests of the full context length
# default host ring per rank (--trace-host-ring-gb): room for one result batch of 256 requests of 1,280 tokens at
# Qwen3-30B-A3B's default policy (6.6 GB), so such a batch does not wait for the store writer
RING_BYTES = 8 << 30
TRANSFER_BYTES = 1 << 30  # a transfer's host span holds at most this (more requests: more transfers, more shards)
STAGING_BYTES = 512 << 20  # device buffers of one piece of a transfer (a longer transfer runs in pieces)
SLOW_FINISH_S = 0.05  # a result batch whose transfers hold the scheduler thread longer is logged (`on_batch_done`)


@dataclass
class TraceStats:
    """Counters a server reports: requests and tokens recorded, result batches and transfers (one host copy and,
    under attention TP, one gather each), shards and trajectories written to the store, failed (records refused
    or the write failed)."""

    requests: int = 0
    tokens: int = 0
    batches: int = 0
    transfers: int = 0
    pieces: int = 0  # device pieces of the transfers (a staging buffer and a host copy each)
    collectives: int = 0
    shards_written: int = 0  # shard files: one per transfer and step writer (a trajectory id once per shard)
    trajectories_written: int = 0
    write_failures: int = 0
    failed: list[str] = field(default_factory=list)  # trajectories (rids) refused or not written, last 1000
    finish_s: float = 0.0  # scheduler-thread seconds in on_batch_done (host-ring waits included)
    write_s: float = 0.0  # writer-thread seconds in the transfers' writes
    host_bytes: int = 0  # bytes copied into the host ring


@dataclass
class _Finished:
    """A finished request waiting for its result batch to close: its binding (the token digest still empty: the
    writer thread fills it in from `ids()`), its KV slots (a view of its `req_to_token` row, valid until the
    scheduler's next allocation), the store writer of its step, and why it is refused (if known). The token ids
    are SGLang's own lists, kept by reference (no copy on the scheduler thread): the prompt ids and the first
    `outputs` entries of the output ids."""

    binding: Binding | None
    slots: torch.Tensor
    writer: StepWriter | None
    error: str | None = None
    prompt: Sequence[int] = ()
    output: Sequence[int] = ()
    outputs: int = 0

    def ids(self) -> list[int]:
        """The request's prompt + output ids at finish."""
        return [*self.prompt, *self.output[: self.outputs]]


@dataclass(frozen=True)
class RecordShard:
    """What one attention-TP rank keeps in its device record store: the MoE-input sites and routes of the MoE
    layers it owns, and a hook marker for each of those whose routes it does not keep (where it keeps a layer's
    routes, the FusedMoE hook stages them, and they are that layer's marker); each in MoE-layer order. MoE inputs
    and routes are the same on every TP rank, so each is kept by one rank only; the store-writing rank merges the
    shards (`TraceCapturer._merge`)."""

    sites: tuple[Site, ...]
    marks: tuple[int, ...]
    routes: tuple[int, ...]


def record_shards(
    args: TraceArgs, layout: ModelLayout, tp_size: int = 1, routes_on_first: bool = False
) -> list[RecordShard]:
    """The record shards of `tp_size` attention-TP ranks (rank order; MoE layers assigned by
    `trace_core.records.capture.shard_layers`). `routes_on_first`: rank 0 keeps every layer's routes (R3's answer is
    read on rank 0 at finish). With `--trace-sites none` nothing is kept (every shard empty), except rank 0's routes
    when `routes_on_first` (R3's answer only)."""
    if not args.records:
        routes = tuple(layout.moe_layers) if routes_on_first else ()
        return [RecordShard((), (), routes if rank == 0 else ()) for rank in range(tp_size)]
    spec = model_spec(args, layout)
    sites = [s for s in spec.sites() if s[1] == "moe_in"]
    shards = []
    for rank, mine in enumerate(shard_layers(layout.moe_layers, [layer for layer, _ in sites], tp_size)):
        routes = (tuple(layout.moe_layers) if rank == 0 else ()) if routes_on_first else mine
        marks = tuple(layer for layer in mine if layer not in routes)
        shards.append(RecordShard(tuple(s for s in sites if s[0] in mine), marks, routes))
    return shards


def keeps_rows(args: TraceArgs, shard: RecordShard) -> bool:
    """Whether a rank of this shard has a record store at all: always when the server records, else only for the
    routes R3 answers from (`--trace-sites none`)."""
    return args.records or bool(shard.routes)


def record_args(args: TraceArgs, layout: ModelLayout, shard: RecordShard | None = None) -> dict:
    """`RecordCapturer` arguments of one rank's record shard (default: one rank keeps everything); one
    definition for the capturer and the memory accounting: what one KV slot holds in that rank's record store
    (routes as `trace_core.records.capture.route_dtype` of the model's expert count)."""
    if shard is None:
        shard = record_shards(args, layout)[0]
    return dict(
        spec=model_spec(args, layout),
        shape=ModelShape(hidden=layout.hidden, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim),
        sites=list(shard.sites),
        routes=(len(shard.routes), layout.topk) if shard.routes else None,
        marks=len(shard.marks),
        versioned=True,
        num_experts=layout.num_experts,
    )


def shard_reader(args: TraceArgs, layout: ModelLayout, shard: RecordShard) -> RowReader:
    """Reads rows of `shard`'s record store (on the rank that merges the shards)."""
    rec = record_args(args, layout, shard)
    layouts, row = record_row_layout(**rec)
    return RowReader(layouts, row, rec["routes"], rec["marks"], versioned=True)


def record_bytes_per_slot(args: TraceArgs, layout: ModelLayout, tp_size: int = 1, routes_on_first: bool = False) -> int:
    """Device bytes the record store adds to every KV slot on each of `tp_size` attention-TP ranks: the largest
    rank's shard (added to SGLang's per-token KV cell size on every rank, so all ranks size their KV pools alike);
    0 with `--trace-sites none` and R3 off (no record store)."""
    return max(
        shard_reader(args, layout, shard).row.row_bytes if keeps_rows(args, shard) else 0
        for shard in record_shards(args, layout, tp_size, routes_on_first)
    )


def finish_device_bytes(args: TraceArgs) -> int:
    """Device memory the finish path may hold at once on each rank, which SGLang's KV budget sets aside (the plugin's
    hook after `_profile_available_bytes`): one piece's buffers, `STAGING_BYTES` (the pieces run one after another
    on the copy stream, each reusing the last one's memory); 0 when nothing is recorded."""
    return STAGING_BYTES if args.records else 0


def ring_bytes(args: TraceArgs, token_bytes: int, max_request_tokens: int, num_slots: int) -> int:
    """The finish path's host ring size on each rank: `--trace-host-ring-gb`, else `RING_BYTES` bounded by the KV
    pool's tokens (no result batch finishes more), and at least `RING_REQUESTS` requests of the context length.
    ValueError naming the flag when a given size cannot hold one request."""
    one = max_request_tokens * token_bytes
    if args.host_ring_gb is None:
        return max(min(RING_BYTES, num_slots * token_bytes), RING_REQUESTS * one)
    size = int(args.host_ring_gb * 2**30)
    if size < one:
        raise ValueError(
            f"--trace-host-ring-gb {args.host_ring_gb}: {size} bytes cannot hold one request of {max_request_tokens} "
            f"tokens x {token_bytes} bytes ({one / 2**30:.3f} GiB)"
        )
    return size


class TraceCapturer(RoutedExpertsCapturer):
    """Record capture for one scheduler/TP process (see the module docstring).

    Args:
        args: validated `--trace-*` settings. layout: the model's layers and widths.
        kv_pool: the FP4 KV pool (`MHATokenToKVPoolFP4`); None when no k/v site is recorded.
        max_tokens: most token rows one forward runs (staging rows). num_slots: KV slots + page size.
        max_request_tokens: the longest request (SGLang's context length); the host ring holds at least one.
        device: where staging and the record store live.
        return_routes: answer R3's `get_topk` (`--enable-return-routed-experts`).
        weights: the emulated expert weights whose completeness every forward checks.
        tp_rank, tp_size: attention-TP rank and size. Each rank keeps the MoE-input records, hook markers and
            routes of its share of the MoE layers (`record_shards`); rank 0 merges the shards and writes the store.
        trace_group: a gloo group over the attention-TP ranks, created at start-up for TRACE alone (each transfer's
            K/V and record shards are gathered to rank 0 over it, on the writer thread); required when tp_size > 1.
        moe_tp_group: SGLang's MoE-TP `GroupCoordinator` (the FC2-input row amax is taken over it); None for one rank.
        host_ring_bytes: host ring size on each rank; default `ring_bytes`.
        fence: the `SlotFence` on SGLang's KV allocator, which holds the finished requests' slots until the finish
            path's copies read them; required on CUDA when records are stored (on CPU the copies run at once).
        debug: the `--trace-debug-layer` tap (None: off).

    Hook markers: per MoE layer, the last FusedMoE hook of the layer (the FC2-input site in emulate mode, the
    MoE-input site in native mode) writes into the forward's staging rows, in CUDA graphs too. On a rank that
    keeps the layer's routes, that write is the routes' copy: the top-k hook (`capture`) only hands its `topk_ids`
    on, and the FusedMoE hook stages them (one launch per layer for both); elsewhere it sets the layer's marker
    byte (`RecordCapturer(marks=...)`). The capturer resets staged routes to -1 and markers to unset after every
    forward, so a forward in which the top-k hook or the FusedMoE hooks of a layer did not run leaves -1 routes or
    an unset marker; a request with such a row is refused, never stored. Every row also
    carries the weight version (RL step) of the forward that wrote it; a request whose rows were computed under
    another version than the step it finishes in is refused.
    """

    def __init__(
        self,
        args: TraceArgs,
        layout: ModelLayout,
        *,
        kv_pool,
        max_tokens: int,
        num_slots: int,
        max_request_tokens: int,
        device: torch.device | str,
        return_routes: bool,
        weights: ExpertWeights,
        tp_rank: int = 0,
        tp_size: int = 1,
        trace_group=None,
        moe_tp_group=None,
        host_ring_bytes: int | None = None,
        fence: SlotFence | None = None,
        debug: DebugTap | None = None,
    ) -> None:
        if not args.enabled:
            raise ValueError("TraceCapturer needs --trace-mode other than off")
        self.args, self.layout, self.weights = args, layout, weights
        self.spec = model_spec(args, layout)
        if self.spec.attn_layers and kv_pool is None:
            raise ValueError("k/v sites are recorded but no FP4 KV pool was given")
        self.kv_pool, self.kv_kinds = kv_pool, kv_kinds(args)
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"TP rank {tp_rank} outside [0, {tp_size})")
        group_size = 1 if trace_group is None else torch.distributed.get_world_size(trace_group)
        if group_size != tp_size:
            raise ValueError(f"TRACE's group spans {group_size} ranks, the attention-TP size is {tp_size}")
        # record shards: each rank keeps its MoE layers' records, markers and routes; rank 0 keeps every layer's
        # routes when R3 answers at finish
        self.shards = record_shards(args, layout, tp_size, routes_on_first=return_routes)
        shard = self.shards[tp_rank]
        self.mark_index = {layer: i for i, layer in enumerate(shard.marks)}
        self.route_index = {layer: i for i, layer in enumerate(shard.routes)}
        self.moe_index = {layer: i for i, layer in enumerate(layout.moe_layers)}
        # the FusedMoE hooks of a layer run in one call chain (dispatch -> MoE-input site -> runner -> FC2-input
        # site), so its last hook marks the layer (by staging its routes where this rank keeps them)
        self.moe_mark = "fc2" if args.mode == "emulate" else "moe_in"
        rec = record_args(args, layout, shard)
        # --trace-sites none: no record store on this rank, unless it keeps the routes R3 answers from
        self.records: RecordCapturer | None = None
        if keeps_rows(args, shard):
            self.records = RecordCapturer(max_tokens=max_tokens, num_slots=num_slots, device=device, **rec)
        self.readers = [shard_reader(args, layout, s) for s in self.shards] if tp_rank == 0 and args.records else []
        self.site_order = [s for s in self.spec.sites() if s[1] == "moe_in"]  # one rank's record order
        # host bytes per token of a transfer, the same on every rank (so all ranks run the same transfers and
        # gathers): this rank's record row, then its K/V record row, padded to the largest rank's record row + K/V
        self.kv_bytes = self._kv_bytes()
        self.kv_gather = KVGather(kv_pool, self.spec.attn_layers, self.kv_kinds) if self.kv_bytes else None
        self.row_bytes = 0 if self.records is None else self.records.row.row_bytes
        self.shard_bytes = record_bytes_per_slot(args, layout, tp_size, routes_on_first=return_routes)
        self.token_bytes = token_bytes = self.kv_bytes + self.shard_bytes
        self.ring: HostRing | None = None  # the finish path's host ring: none when nothing is stored
        self.ring_tokens = 0
        if args.records:
            if host_ring_bytes is None:
                host_ring_bytes = ring_bytes(args, token_bytes, max_request_tokens, num_slots)
            if host_ring_bytes < max_request_tokens * token_bytes:
                raise ValueError(
                    f"TRACE host ring of {host_ring_bytes} bytes cannot hold one request of {max_request_tokens} "
                    f"tokens x {token_bytes} bytes"
                )
            self.ring_tokens = host_ring_bytes // token_bytes
            self.ring = HostRing(self.ring_tokens * token_bytes, pin=torch.device(device).type == "cuda")
        self.return_routes = return_routes
        self.tp_rank, self.tp_size, self.trace_group, self.moe_tp_group = tp_rank, tp_size, trace_group, moe_tp_group
        self.step: int | None = args.step
        self.debug = debug
        self.stats = TraceStats()
        self._writer = StepWriter(self._store(), args.step) if tp_rank == 0 and args.records else None
        self._ahead: dict[int, StepWriter] = {}  # writers of rollout steps other than the weight version's
        # one writer thread per rank: it runs the transfers (and their gathers) in the order the batches closed
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trace-store")
        # CUDA: the gathers and device-to-host copies of the finish path run on a stream of their own, after the
        # forwards queued before them and beside the later ones, which cannot touch their slots (the fence holds them)
        on_cuda = self.ring is not None and torch.device(device).type == "cuda"
        if on_cuda and fence is None:
            raise ValueError("TRACE's finish path on CUDA needs the KV allocator's SlotFence")
        self.fence = fence
        self._copy_stream = torch.cuda.Stream(torch.device(device)) if on_cuda else None
        self._writes: list[Future] = []
        self._pending: list[_Finished] = []  # finished in the result batch being processed
        self._lock = threading.Lock()
        self._moe_rows: dict[int, int] = {}  # MoE layer -> token rows of its current forward
        self._topk: tuple[int, torch.Tensor] | None = None  # (MoE layer, top-k ids) handed on by the last top-k hook
        self._fc2_layer: int | None = None  # MoE layer whose MoE-input site ran last (the fused FC2 site's layer)
        self._routes: dict[int, torch.Tensor] = {}  # req_pool_idx -> routes of the request finished last

    @property
    def transfer_bytes(self) -> int:
        """Device bytes per token of a transfer's piece: the staging buffer (this rank's rows); without the one-launch
        kernel (`KVGather.rows`, on CUDA) also the raw K/V rows and `kv_rows_from_raw`'s temporaries (a few copies
        of one site group, within the raw rows)."""
        gather = self.kv_gather
        raw_kv = gather.width if gather is not None and not gather.kernel else 0
        return self.row_bytes + self.kv_bytes + 2 * raw_kv

    def counters(self) -> dict:
        """What `/server_info` reports under `internal_states[i]["trace"]` (`hooks.add_internal_state`): the
        `TraceStats` counters (`failed` as a count) and the host ring's size and waits, plain numbers."""
        stats = {k: v for k, v in asdict(self.stats).items() if k != "failed"}
        stats["failed"] = len(self.stats.failed)
        ring = asdict(self.ring.stats) if self.ring is not None else asdict(RingStats())
        capacity = self.ring.capacity if self.ring is not None else 0
        return {
            **stats,
            "ring": {**ring, "capacity": capacity, "tokens": self.ring_tokens},
            "token_bytes": self.token_bytes,
            "device_reserved_bytes": finish_device_bytes(self.args),
            "fence": {**asdict(self.fence.stats), "held_tokens": self.fence.held_tokens} if self.fence else None,
            "model": layout_fields(self.layout),  # what a trainer checks its model against (served_layout_mismatch)
        }

    def _kv_bytes(self) -> int:
        """K/V record bytes per token on this rank (`kv_rows_from_raw`'s row), 0 without k/v sites."""
        if not self.spec.attn_layers:
            return 0
        return kv_row_bytes(self._kv_sites(), self._kv_width(), self.spec.bits)

    def _kv_sites(self) -> int:
        return len(self.spec.attn_layers) * len(self.kv_kinds)

    def _kv_width(self) -> int:
        """Elements of one K/V site row on this rank (its KV heads x head_dim)."""
        pool = getattr(self.kv_pool, "full_kv_pool", self.kv_pool)
        return pool.head_num * pool.head_dim

    # --- forward side -------------------------------------------------------------------------------------------

    def moe_input(self, layer_id: int, x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE-input site of FusedMoE layer `layer_id` on its dispatched input `[T, H]`: returns what the
        experts compute with (emulate: the input quantize-dequantized under the recipe; native: `x` itself)."""
        site = (layer_id, "moe_in")
        rows = None
        self._moe_rows[layer_id] = x.shape[0]
        self._fc2_layer = layer_id
        if self.moe_mark == "moe_in":
            self._mark(layer_id, x.shape[0])
        if self.records is not None and site in self.records.layouts:
            rows = self.records.staging_rows(site, x.shape[0])
        if self.args.mode == "emulate":
            x = emulate_moe_input(x, self.spec.bits, rows, self.args.recipe.moe_in)
            if self.debug is not None:
                self.debug.moe_input(layer_id, x)
            return x
        if rows is not None:
            if input_scale is None:
                raise ValueError(f"native MoE-input records of layer {layer_id} need the layer's NVFP4 input scale")
            native_moe_input(x, self.spec.bits, input_scale, rows, self.args.recipe.moe_in)
        return x

    def fc2_input(self, layer_id: int, h: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """The FC2-input site of MoE layer `layer_id` on this rank's `act(gate) * up` rows: what the second GEMM
        computes with (emulate: `trace_core.numerics.fc2`'s quantize-dequantize; native: the kernel quantizes). `fused`:
        the rows are all (token, top-k) pairs of the forward (the GPU kernel sequence), not one expert's."""
        if self.args.mode != "emulate":
            return h
        # token rows of this layer's forward (the CPU path calls this once per expert, on that expert's rows)
        self._mark(layer_id, self._moe_rows.get(layer_id, 0))
        h = fc2_input(h, self.moe_tp_group, self.args.recipe.fc2_in)
        if fused and self.debug is not None:
            self.debug.fc2_input(layer_id, h)
        return h

    def fused_fc2_layer(self) -> int:
        """The MoE layer whose FC2 input the fused kernel sequence is computing: the one whose MoE-input site ran
        last in this forward (the sequence has no layer id); RuntimeError when none did."""
        if self._fc2_layer is None:
            raise RuntimeError("TRACE FC2-input site reached without a MoE-input site before it in this forward")
        layer, self._fc2_layer = self._fc2_layer, None
        return layer

    def capture(self, layer_id: int, topk_indices: torch.Tensor) -> None:
        """R3 hook in every MoE layer's top-k: hand the routes `[T, topk (+ fused shared)]` of `layer_id` on to the
        layer's FusedMoE hook (`_mark`), which stages them, on the rank that keeps them. No launch here: SGLang's
        top-k writes padded rows' ids to -1 in place after this hook (rows past the forward's tokens, never
        stored), and its logical-to-physical expert map returns a new tensor, so the ids staged are the logical
        ids this hook saw."""
        self._topk = (layer_id, topk_indices) if layer_id in self.route_index else None

    def _mark(self, layer_id: int, rows: int) -> None:
        """The last FusedMoE hook of MoE layer `layer_id` ran on the forward's token rows [0, rows): on the rank
        that keeps the layer's routes, stage the routes the layer's top-k hook handed on (when it ran in this layer,
        on as many rows; else they stay -1 and the rows are refused); on a rank that keeps only its marker, set
        it."""
        if self.records is None:  # --trace-sites none on a rank keeping no routes: nothing to stage
            return
        index = self.route_index.get(layer_id)
        if index is not None:
            handed, self._topk = self._topk, None
            if handed is not None and handed[0] == layer_id and handed[1].shape[0] == rows:
                self.records.stage_routes(index, handed[1][:, : self.layout.topk])
            return
        index = self.mark_index.get(layer_id)
        if index is not None:
            self.records.mark(index, rows)

    def on_forward_end(
        self, forward_batch, can_run_graph: bool, cuda_graph_batch: int | None, no_copy_to_cpu: bool = False
    ) -> None:
        """After every forward: copy the staged rows into the record store at the batch's KV slots (on the GPU).
        Returns None: nothing is copied to the host per forward, so SGLang's overlap path has nothing to finalize."""
        self._topk = None  # routes a FusedMoE hook did not stage stay -1: never carried into the next forward
        self._fc2_layer = None
        if self._pending:  # finished requests whose batch was never closed: their slots may have been reused
            self._refuse_pending("its result batch was not closed before the next forward (slots may be reused)")
        self.weights.check_complete()
        if forward_batch.forward_mode.is_idle():
            return
        version = UNKNOWN_VERSION if self.step is None else self.step
        if self.fence is not None:
            self.fence.release()
        if self.records is not None:  # none with --trace-sites none (unless this rank keeps R3's routes)
            self.records.on_forward_end(forward_batch.out_cache_loc, graph_replay=bool(can_run_graph), version=version)
        if self.debug is not None:
            self.debug.on_forward_end(forward_batch.out_cache_loc)

    # --- request finish -----------------------------------------------------------------------------------------

    def finish_request(
        self,
        rid: str,
        req_pool_idx: int,
        seqlen: int,
        req_to_token_pool,
        tokens: Sequence[int],
        output_ids: Sequence[int] = (),
    ) -> dict | None:
        """Queue a finished request's records (positions [0, seqlen - 1)) for the store; returns the handle on the
        store-writing rank (None elsewhere). Must run before the request's KV is released; `on_batch_done` moves
        the queued requests once the result batch is processed. `rid` is `<trajectory>#<attempt>@<step>`
        (`trace_core.records.store.rollout_rid`; without `@<step>` the step is the weight version, a plain id the
        trajectory of attempt ""), and `tokens` + `output_ids` the request's prompt + output ids (SGLang's
        `origin_input_ids` and `output_ids`, kept by reference and read on the writer thread; a later append to
        `output_ids` is not read): the records are bound to (rollout step, policy version = the weight version,
        trajectory, attempt, token digest, computed on the writer thread: hashing a long request's ids costs about a
        millisecond) and stored under the rollout step, which may run ahead of the weights (`async_lag`); the handle
        repeats the binding except for the digest (the stored shard's binding carries it).

        No device work or wait here, except R3's answer (`--enable-return-routed-experts`), which is read at once.
        A request whose records are refused (a hook did not run, rows of another weight version, unwritten rows)
        or whose write fails is not stored: it is counted in `stats`, logged, and marked failed in the store
        (`trace_core.records.store.write_failure`, which the reader reports); the server keeps serving. When that is
        known at finish (R3 on, or no weight version), the handle also says so (`"error"`).

        `--trace-sites none`: nothing is queued and no handle returned; with R3 on, rank 0 reads the routes for R3's
        answer from its routes-only rows (the same checks; refused routes leave R3's answer empty and return
        `{"error": ...}` in place of a handle)."""
        if len(tokens) + len(output_ids) != seqlen:
            raise ValueError(f"request {rid!r}: {len(tokens) + len(output_ids)} prompt + output ids, seqlen {seqlen}")
        slots = request_slots(req_to_token_pool.req_to_token, req_pool_idx, seqlen)
        length = slots.shape[0]
        if self.debug is not None and self.tp_rank == 0:
            self.debug.save(Path(self._store()) / "debug" / f"{rid}.pt", slots)
        self.stats.requests += 1
        self.stats.tokens += length
        if not self.args.records:
            return self._routes_only(rid, req_pool_idx, slots)
        if self.fence is not None:  # SGLang frees the slots next: held until the batch's copies ran
            self.fence.arm()
        if self._writer is None:  # every rank queues the request: its K/V shard joins the batch's gather
            self._pending.append(_Finished(None, slots, None))
            return None
        version = self.step
        trajectory, attempt, rollout_step = parse_rollout_rid(str(rid))
        step = version if rollout_step is None else rollout_step
        handle = {
            "store": str(self.args.store),
            "step": step,
            "trajectory": trajectory,
            "attempt": attempt,
            "policy_version": version,
            "tokens": length,
        }
        if version is None or step is None:
            error = "the weights were updated without an integer weight_version"
            self._failed(trajectory, attempt, step, error)
            self._pending.append(_Finished(None, slots, None, error))
            return {**handle, "error": "TRACE records refused: the weights were updated without a weight_version"}
        binding = Binding(step, version, trajectory, attempt, "", self.args.recipe.name)  # digest: writer thread
        finished = _Finished(binding, slots, self._step_writer(step), None, tokens, output_ids, len(output_ids))
        self._pending.append(finished)
        if self.return_routes:
            if self.records is None:
                raise RuntimeError("R3: this rank keeps no record rows")
            try:
                rows = self.records.gather_rows(slots).cpu()
                routes = self.records.read(rows, version=version).routes
                if routes is None:
                    raise RuntimeError("R3: the capturer's record rows hold no routes")
                self._routes[req_pool_idx] = self._r3_routes(routes)
            except ValueError as e:
                finished.error = f"records refused: {e}"
                self._failed(trajectory, attempt, step, finished.error)
                return {**handle, "error": f"TRACE records refused: {e}"}
        return handle

    def _step_writer(self, step: int) -> StepWriter:
        """The store writer of rollout step `step`: the weight version's, or one of a step the rollout runs ahead
        for (`async_lag`; kept until the next weight update)."""
        if self._writer is None:
            raise RuntimeError("TRACE: a store writer asked for on a rank that writes none")
        if step == self._writer.step:
            return self._writer
        if step not in self._ahead:
            self._ahead[step] = StepWriter(self._store(), step)
        return self._ahead[step]

    def _routes_only(self, rid: str, req_pool_idx: int, slots: torch.Tensor) -> dict | None:
        """`--trace-sites none`: R3's answer for a finished request from the routes-only rows (rank 0 with R3 on;
        checked for written rows, staged routes and, when the step is known, the weight version); nothing else."""
        if not self.return_routes or self.records is None:
            return None
        try:
            routes = self.records.read(self.records.gather_rows(slots).cpu(), version=self.step).routes
            if routes is None:
                raise RuntimeError("R3: the capturer's record rows hold no routes")
        except ValueError as e:
            trajectory, attempt, _ = parse_rollout_rid(str(rid))
            self._failed(trajectory, attempt, None, f"R3 routes refused: {e}")  # no store: counted and logged only
            return {"error": f"TRACE R3 routes refused: {e}"}
        self._routes[req_pool_idx] = self._r3_routes(routes)
        return None

    def on_batch_done(self) -> None:
        """The scheduler processed a result batch (its outputs are about to be streamed): move the records and K/V of
        every request that finished in it to the writer thread. Per transfer (a whole batch, unless it exceeds the
        host ring or `TRANSFER_BYTES`; a longer request goes alone) one slot concatenation and a host ring span,
        which waits while the ring is full (backpressure, `ring.stats.stalls`); per piece of the transfer (`_stage`)
        one gather of the record rows, one of the K/V record rows (`KVGather.rows`: one launch on CUDA), and one
        asynchronous copy into the span, all queued on the copy stream; the fence then holds the requests' freed
        slots until that work ran (`SlotFence.seal`). Every rank runs the same transfers in the same order."""
        if not self._pending:
            return
        ring = self.ring.stats if self.ring is not None else RingStats()
        t0, stalls, stall_s = time.perf_counter(), ring.stalls, ring.stall_s
        pending, self._pending = self._pending, []
        self.stats.batches += 1
        chunks: list[list[_Finished]] = [[]]
        tokens = total = 0
        limit = min(self.ring_tokens, max(1, TRANSFER_BYTES // max(1, self.token_bytes)))
        for finished in pending:
            if chunks[-1] and tokens + finished.slots.shape[0] > limit:
                chunks.append([])
                tokens = 0
            chunks[-1].append(finished)
            tokens += finished.slots.shape[0]
            total += finished.slots.shape[0]
        copied = None  # the copy stream runs in order: the last transfer's event covers the earlier ones
        for chunk in chunks:
            last = self._transfer(chunk)
            copied = copied if last is None else last
        if self.fence is not None:
            self.fence.seal(copied)
        took = time.perf_counter() - t0
        self.stats.finish_s += took
        if took > SLOW_FINISH_S:  # the finish path's profile on a live server: what held the scheduler, and why
            logger.info(
                "TRACE finish: %d requests, %d tokens in %.3f s on the scheduler thread (host ring waits %d, %.3f s); "
                "totals: finish %.3f s, writer %.3f s, %.1f MB to the host",
                len(pending), total, took, ring.stalls - stalls, ring.stall_s - stall_s,
                self.stats.finish_s, self.stats.write_s, self.stats.host_bytes / 1e6,
            )  # fmt: skip

    def _transfer(self, chunk: list[_Finished]) -> torch.cuda.Event | None:
        """One transfer: the chunk's record rows and K/V bytes copied into one host ring span `[n * token_bytes]`
        (this rank's record rows first, 8-byte aligned for the store's word gather, then its K/V record rows; the
        rest of the span pads to the largest rank's rows), then queued for the writer thread. The device work runs
        in pieces of at most `STAGING_BYTES` of buffers (`_stage`, `transfer_bytes` a token), each copied to its
        place in the span; on CUDA all of it is queued on the copy stream, whose event after the last piece this
        returns (None on CPU, where it ran at once)."""
        # a copy of the slots (the finished requests' `req_to_token` rows are reused by the next allocation)
        slots = torch.cat([f.slots for f in chunk])
        n = slots.shape[0]
        ticket, span, copied = None, None, None
        if n:
            if self.records is None or self.ring is None:  # never: nothing is queued with --trace-sites none
                raise RuntimeError("TRACE: a transfer on a capturer that stores nothing (--trace-sites none)")
            ticket, span = self.ring.reserve(n * self.token_bytes)
            piece = max(1, STAGING_BYTES // max(1, self.transfer_bytes))
            if self._copy_stream is not None:
                self._copy_stream.wait_stream(torch.cuda.current_stream(slots.device))
                slots.record_stream(self._copy_stream)
                with torch.cuda.stream(self._copy_stream):
                    for a in range(0, n, piece):
                        self._stage(self.records, slots[a : a + piece], span, a, n)
                    copied = torch.cuda.Event()
                    copied.record(self._copy_stream)
            else:
                for a in range(0, n, piece):
                    self._stage(self.records, slots[a : a + piece], span, a, n)
            self.stats.pieces += -(-n // piece)
            self.stats.host_bytes += n * (self.row_bytes + self.kv_bytes)
            self.stats.transfers += 1
        self._writes = [f for f in self._writes if not f.done()]
        self._writes.append(self._pool.submit(self._write_batch, chunk, n, span, copied, ticket))
        return copied

    def _stage(self, records: RecordCapturer, slots: torch.Tensor, span: torch.Tensor, at: int, n: int) -> None:
        """The record rows and K/V record rows of `slots` (tokens `at:` of a transfer of `n`) gathered on the device
        into one staging buffer and copied to their places in the transfer's host span, on the current stream (the
        copy stream on CUDA, asynchronously into the pinned span: the next piece's buffer reuses this one's memory
        after the copy, in stream order)."""
        m, rb, kb = slots.shape[0], self.row_bytes, self.kv_bytes
        staged = torch.empty(m * (rb + kb), dtype=torch.uint8, device=records.device)
        records.gather_rows(slots, out=staged[: m * rb].view(m, rb))
        if self.kv_gather is not None:  # the low bits are kept here, on the device: 3 x fewer bytes at b = 1
            self.kv_gather.rows(slots, self.spec.bits, out=staged[m * rb :].view(m, kb))
        rows, kv = span[at * rb : (at + m) * rb], span[n * rb + at * kb : n * rb + (at + m) * kb]
        on_cuda = self._copy_stream is not None
        rows.copy_(staged[: m * rb], non_blocking=on_cuda)
        kv.copy_(staged[m * rb :], non_blocking=on_cuda)

    def _write_batch(
        self,
        chunk: list[_Finished],
        n: int,
        span: torch.Tensor | None,
        copied: torch.cuda.Event | None,
        ticket: int | None,
    ) -> None:
        """Writer thread: wait for the transfer's copy, gather every rank's span to rank 0 (one gather under TP),
        then on rank 0 split each rank's span into its record rows and K/V bytes, check, merge and unpack each
        request's records (`_records`: a request refused is marked failed alone), and write the requests that
        passed in one shard per step writer (`_write`; a trajectory id that repeats within the transfer goes in a
        further shard), not one shard (two fsyncs) per request. A refusal or write error is counted, logged and
        marked in the store, never raised; the host ring span is released in every case."""
        t0 = time.perf_counter()
        try:
            if copied is not None:
                copied.synchronize()
            spans: Sequence[torch.Tensor | None] | None = [span]
            if span is not None and self.trace_group is not None:  # n == 0 on every rank alike: no gather
                spans = gather_to_first(span, self.trace_group)
                with self._lock:
                    self.stats.collectives += 1
            if self._writer is None:
                return
            kvs, rows = [], []
            if span is None:
                spans = [None] * len(self.readers)
            if spans is None:
                raise RuntimeError("the gather of the transfer's spans returned nothing on TRACE's first rank")
            for reader, part in zip(self.readers, spans, strict=True):
                rows_end = n * reader.row.row_bytes
                if part is None:  # a transfer of requests with no positions (seqlen 1)
                    part = torch.empty(0, dtype=torch.uint8)
                rows.append(part[:rows_end].view(n, reader.row.row_bytes))
                kvs.append(part[rows_end : rows_end + n * self.kv_bytes].view(n, self.kv_bytes))
            offset = 0
            # id(step writer) -> (that writer, its shards of this transfer: trajectory id -> records)
            shards: dict[int, tuple[StepWriter, list[dict[str | int, TrajectoryRecords]]]] = {}
            for f in chunk:
                at = slice(offset, offset + f.slots.shape[0])
                offset = at.stop
                if f.error is not None:
                    continue
                tr = self._records(f, [r[at] for r in rows], [r[at] for r in kvs] if self.kv_bytes else [])
                if tr is None or tr.binding is None or f.writer is None:
                    continue
                writer, mine = shards.setdefault(id(f.writer), (f.writer, []))
                shard = next((m for m in mine if tr.binding.trajectory not in m), None)  # one id per shard
                if shard is None:
                    shard = {}
                    mine.append(shard)
                shard[tr.binding.trajectory] = tr
            for writer, mine in shards.values():
                for shard in mine:
                    self._write(writer, shard)
        except Exception as e:  # a failed transfer must not take the server down
            logger.error("TRACE transfer of %d requests failed: %s: %s", len(chunk), type(e).__name__, e)
            for f in chunk:
                if f.binding is not None and f.error is None:
                    self._failed(f.binding.trajectory, f.binding.attempt, f.binding.step, f"{type(e).__name__}: {e}")
        finally:
            if ticket is not None and self.ring is not None:
                self.ring.release(ticket)
            with self._lock:
                self.stats.write_s += time.perf_counter() - t0

    def _merge(self, rows: list[torch.Tensor], version: int) -> TrajectoryRecords:
        """One request's MoE-input records and routes from every rank's record rows (rank order), each checked
        (written, hook markers, routes, weight version): the records one rank keeping every layer would hold."""
        parts = [reader.read(r, version=version) for reader, r in zip(self.readers, rows, strict=True)]
        if len(parts) == 1:
            return parts[0]
        length = rows[0].shape[0]
        found = {site: rec for part in parts for site, rec in part.records.items()}
        routes = torch.empty(length, len(self.layout.moe_layers), self.layout.topk, dtype=torch.int32)
        for shard, part in zip(self.shards, parts, strict=True):
            if shard.routes:
                if part.routes is None:
                    raise ValueError(f"the record rows of a shard keeping the routes of {shard.routes} hold none")
                routes[:, [self.moe_index[layer] for layer in shard.routes]] = part.routes
        records = {site: found[site] for site in self.site_order}
        return TrajectoryRecords(num_tokens=length, records=records, routes=routes)

    def _records(self, f: _Finished, rows: list[torch.Tensor], kvs: list[torch.Tensor]) -> TrajectoryRecords | None:
        """One trajectory's records from its record rows and K/V record rows on the host (one of each per rank, rank
        order), checked (`_merge`, the K/V records) and bound; None (the request marked failed alone) when they are
        refused."""
        if f.binding is None:
            raise RuntimeError("TRACE: a request without a binding reached the shard write")
        binding = replace(f.binding, tokens=token_digest(f.ids()))
        try:
            gathered = self._merge(rows, binding.policy_version)
            kv = {}
            if kvs:
                pool = getattr(self.kv_pool, "full_kv_pool", self.kv_pool)
                fmt = self.args.recipe.k.fmt
                if not isinstance(fmt, FP4Format):
                    raise ValueError(f"K/V records in the FP4 KV pool need an FP4 format, the recipe has {fmt.name}")
                kv = kv_records_from_shards(
                    kvs,
                    self.spec.attn_layers,
                    self.kv_kinds,
                    self.spec.bits,
                    shard_width=pool.head_num * pool.head_dim,
                    num_kv_heads=self.layout.num_kv_heads,
                    fmt=fmt,
                )
            records = {**gathered.records, **kv}
            length = rows[0].shape[0]
            if f.writer is None:
                raise RuntimeError("TRACE: a request without a store writer reached the shard write")
            return TrajectoryRecords(num_tokens=length, records=records, routes=gathered.routes, binding=binding)
        except Exception as e:
            self._failed(binding.trajectory, binding.attempt, binding.step, f"{type(e).__name__}: {e}")
            return None

    def _write(self, writer: StepWriter, trajectories: dict[str | int, TrajectoryRecords]) -> None:
        """One shard of one step writer holding `trajectories` (checked and bound by `_records`); if the write
        fails, every trajectory of it is marked failed."""
        try:
            writer.write(trajectories)
        except Exception as e:
            for tr in trajectories.values():
                if tr.binding is not None:
                    b = tr.binding
                    self._failed(b.trajectory, b.attempt, b.step, f"{type(e).__name__}: {e}")
            return
        with self._lock:
            self.stats.shards_written += 1
            self.stats.trajectories_written += len(trajectories)

    def _refuse_pending(self, reason: str) -> None:
        """Drop the queued requests (every rank does, in lockstep) and mark them failed on rank 0."""
        pending, self._pending = self._pending, []
        if self.fence is not None:  # no copy reads their slots
            self.fence.seal(None)
        for f in pending:
            if f.binding is not None and f.error is None:
                self._failed(f.binding.trajectory, f.binding.attempt, f.binding.step, f"records refused: {reason}")

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
            write_failure(self._store(), step, trajectory, attempt, message)
        except OSError as e:
            logger.error("TRACE could not mark trajectory %s failed in the store: %s", trajectory, e)

    def _store(self) -> str:
        """The record store root (`--trace-store`, which `check_server_args` requires with TRACE on)."""
        if self.args.store is None:
            raise ValueError("TRACE records need --trace-store (the record store root)")
        return self.args.store

    def _r3_routes(self, routes: torch.Tensor) -> torch.Tensor:
        """Routes of the MoE layers in R3's layout: `[tokens, num_hidden_layers, topk]`, zeros for other layers."""
        out = torch.zeros(routes.shape[0], self.layout.num_layers, self.layout.topk, dtype=torch.int32)
        out[:, list(self.layout.moe_layers)] = routes
        return out

    def get_topk(self, req_pool_idx: int, seqlen: int, req_to_token_pool, start_len: int = 0) -> torch.Tensor | None:
        """R3's answer for the request `finish_request` just handled: positions [start_len, seqlen - 1) (SGLang
        passes the length through the stop condition); None when R3 is off or the records were refused."""
        if start_len < 0:
            raise ValueError(f"start_len={start_len} must be non-negative")
        if not self.return_routes:
            return None
        routes = self._routes.pop(req_pool_idx, None)
        if routes is None:
            return None
        return routes[min(start_len, seqlen - 1) : seqlen - 1]

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
        self._ahead.clear()
        if self._writer is not None and step is not None:
            self._writer = StepWriter(self._store(), step)

    def flush(self) -> None:
        """Move the queued requests (`on_batch_done`) and wait for every store write (failures are in `stats`)."""
        self.on_batch_done()
        writes, self._writes = self._writes, []
        for f in writes:
            f.result()

    def close(self) -> None:
        self.flush()
        if self.fence is not None:
            self.fence.drain()
        self._pool.shutdown()
