"""The functions TRACE's SGLang hooks call: the plugin hooks (`sglang_trace.plugin`) and the file patches
(`patches/sglang/v0.5.15.post1/`), one per hook point, each a no-op when `--trace-mode` is off, so SGLang behaves
as upstream unless TRACE is switched on.

| hook | called from |
|---|---|
| `add_cli_args`, `check_server_args` | patch 0001: `ServerArgs.add_cli_args`, `__post_init__` (first and last) |
| `on_expert_weight_loaded` | plugin: after `FusedMoE.weight_loader` (initial load and every weight update) |
| `record_bytes_per_token` | plugin: after `DefaultPoolConfigurator._compute_cell_size` (added to the KV cell size) |
| `finish_device_bytes` | plugin: after `ModelRunnerKVCacheMixin._profile_available_bytes` (taken off the KV budget) |
| `hybrid_full_kv_pool_class` | plugin: before `HybridLinearKVPool.__init__` |
| `kv_pool_quantize` / `kv_pool_dequantize` | plugin: around `BlockFP4KVQuantizeUtil.batched_(de)quantize` |
| `install_capturer` | plugin: around `ModelRunner.init_routed_experts_capturer` (KV pool built, CUDA graphs not yet) |
| `on_moe_input` | plugin: before `FusedMoE.run_moe_core` (right after dispatch) |
| `on_fc2_input_rows` | patch 0002: `_fused_moe_kernel_sequence`, between the activation and the second GEMM (GPU) |
| `on_fc2_input` | patch 0003: the CPU expert path, between the activation and the down projection |
| `on_request_finished` | plugin: before `_maybe_collect_routed_experts` (every finished request, before KV release) |
| `on_batch_done` | plugin: before `SchedulerOutputStreamer.stream_output` (a result batch was processed) |
| `refuse_weight_update` | plugin: around `update_weights_from_tensor`, before updating |
| `on_weights_updated` | plugin: after a successful `update_weights_from_{disk,tensor,distributed,ipc}` |
| `add_internal_state` | plugin: after `Scheduler.get_internal_state` (`/server_info`'s `internal_states`) |
"""

from __future__ import annotations

import functools
import logging
from datetime import timedelta
from typing import Any

import torch

from sglang_trace.config import TraceArgs, add_cli_args, check_server_args, model_layout
from sglang_trace.handle import TRACE_INFO_KEY
from sglang_trace.moe import ExpertWeights
from trace_core.numerics.recipe import get_recipe

__all__ = [
    "add_cli_args",
    "check_server_args",
    "install_capturer",
    "on_batch_done",
    "finish_device_bytes",
    "hybrid_full_kv_pool_class",
    "kv_pool_dequantize",
    "kv_pool_quantize",
    "on_expert_weight_loaded",
    "on_fc2_input",
    "on_fc2_input_rows",
    "on_moe_input",
    "on_request_finished",
    "on_weights_updated",
    "record_bytes_per_token",
    "refuse_weight_update",
]

logger = logging.getLogger(__name__)

TRACE_GROUP_TIMEOUT = timedelta(minutes=10)  # a rank missing from a gather fails that transfer, not the server

# Expert weights of this process (one model per scheduler/TP process).
EXPERT_WEIGHTS = ExpertWeights()


def _server_args():
    from sglang.srt.server_args import get_global_server_args

    return get_global_server_args()


def _capturer():
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    from sglang_trace.capturer import TraceCapturer

    capturer = get_global_experts_capturer()
    return capturer if isinstance(capturer, TraceCapturer) else None


def on_expert_weight_loaded(layer, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str, expert_id) -> None:
    """emulate: quantize-dequantize the expert matrix the loader just wrote under the server's recipe (see
    `ExpertWeights`)."""
    args = _server_args()
    if args.trace_mode != "emulate":
        return
    if type(layer.quant_method).__name__ != "UnquantizedFusedMoEMethod":
        raise ValueError(
            f"--trace-mode emulate needs BF16 routed experts; layer {layer.layer_id} uses "
            f"{type(layer.quant_method).__name__}"
        )
    if expert_id is None:
        raise ValueError(f"--trace-mode emulate: layer {layer.layer_id} loads fused experts (no expert id)")
    EXPERT_WEIGHTS.role = get_recipe(args.trace_recipe).weights
    EXPERT_WEIGHTS.on_loaded(layer, param, loaded_weight, shard_id, expert_id)


DEQUANTIZE_SLOTS = 1 << 16  # pool rows NVFP4 dequantization converts at a time (`kv_pool_dequantize`)


def kv_pool_quantize(original, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP4 KV pool's quantizer, `[T, H, D]` rows to packed codes `[T, H, D/2]` and scale bytes `[T, H*D/16]`:
    SGLang's own (kv_fp4) unless the pool holds NVFP4 (`kv.pool_role`), whose codes and E4M3 bytes TRACE's
    quantizer writes (`trace_core.numerics.role_quant.kv_pool_bytes`, static S_enc = 1)."""
    from sglang_trace.kv import pool_role

    role = pool_role()
    if role is None:
        return original(tensor)
    from trace_core.numerics.role_quant import kv_pool_bytes

    t, h, d = tensor.shape
    codes, scales = kv_pool_bytes(role, tensor.reshape(t, h * d))
    return codes.view(t, h, d // 2), scales


def kv_pool_dequantize(original, codes: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """The FP4 KV pool's dequantizer (SGLang's attend-over-BF16 paths): SGLang's own for kv_fp4 rows, TRACE's
    twin of its FP4-KV attention kernels (`trace_core.numerics.kv_attention.dequantize_kv`) for NVFP4 rows."""
    from sglang_trace.kv import pool_format
    from trace_core.numerics.formats import KV_FP4

    fmt = pool_format()
    if fmt is KV_FP4:
        return original(codes, scales, dtype)
    from trace_core.numerics.kv_attention import dequantize_kv

    slots = codes.shape[0]
    if slots <= DEQUANTIZE_SLOTS:
        return dequantize_kv(codes, scales, dtype, fmt=fmt)
    # a whole layer of a large pool (the triton backend reads one at start-up): in row chunks, so that the FP32
    # temporaries stay at one chunk's and only the output is the layer's size (rows are independent: same values)
    out = torch.empty(slots, codes.shape[1], 2 * codes.shape[2], dtype=dtype, device=codes.device)
    for a in range(0, slots, DEQUANTIZE_SLOTS):
        out[a : a + DEQUANTIZE_SLOTS] = dequantize_kv(
            codes[a : a + DEQUANTIZE_SLOTS], scales[a : a + DEQUANTIZE_SLOTS], dtype, fmt=fmt
        )
    return out


def forward_rows(server_args, max_running_requests: int, context_len: int) -> int:
    """Most token rows one forward can run: a prefill chunk, a decode batch, or a padded CUDA-graph batch. With
    chunked prefill off, SGLang admits a first request longer than the prefill budget (up to the context length),
    and a mixed-chunk batch adds a decode row per running request."""
    chunk = server_args.chunked_prefill_size
    prefill = chunk if chunk and chunk > 0 else max(server_args.max_prefill_tokens, context_len)
    if server_args.enable_mixed_chunk:
        prefill += max_running_requests
    graphs = getattr(server_args, "cuda_graph_config", None)
    graph_rows = [getattr(getattr(graphs, phase, None), "max_bs", None) or 0 for phase in ("decode", "prefill")]
    return max(prefill, max_running_requests, *graph_rows)


def check_moe_layers(model, mode: str) -> int:
    """Every FusedMoE layer of `model` runs an expert path whose sites are hooked; returns how many were checked.

    SGLang resolves `--moe-runner-backend auto` per model and GPU when it builds the layers, so the server
    arguments alone do not say which path runs. emulate needs BF16 experts on the triton runner (CUDA) or
    the torch-native CPU path; native needs standard top-k (routes reach the capturer) on flashinfer_cutlass."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerBackend

    checked = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, FusedMoE):
            continue
        method = layer.quant_method
        runner = getattr(getattr(method, "runner", None), "runner_backend", None)
        if mode == "emulate":
            kind = type(method).__name__
            unhooked = [
                flag
                for flag in ("use_flashinfer_cutlass", "use_flashinfer_trtllm_moe", "use_triton_kernels")
                if getattr(method, flag, False)
            ]
            if getattr(layer, "use_intel_amx_backend", False):
                unhooked.append("CPU AMX fused_experts_cpu")
            if kind != "UnquantizedFusedMoEMethod" or unhooked or runner not in (None, MoeRunnerBackend.TRITON):
                raise ValueError(
                    f"--trace-mode emulate: MoE layer {name} runs {kind} on runner {runner} {unhooked}; only "
                    "BF16 experts on the triton runner carry the FC2-input site (pass --moe-runner-backend triton)"
                )
        elif runner is not None and runner.is_flashinfer_trtllm():
            raise ValueError(f"--trace-mode native: MoE layer {name} routes inside flashinfer_trtllm (no routes)")
        checked += 1
    return checked


def record_bytes_per_token(model_runner) -> int:
    """Device bytes per KV slot of TRACE's record store on each TP rank (0 when off; the largest rank's shard),
    which SGLang adds to its per-token KV cell size before sizing the KV pool: the store is allocated later, with
    one row per slot of that pool."""
    args: TraceArgs = check_server_args(model_runner.server_args)
    if not args.enabled:
        return 0
    from sglang_trace.capturer import record_bytes_per_slot

    layout = model_layout(model_runner.model_config.hf_config)
    routes_on_first = model_runner.server_args.enable_return_routed_experts
    return record_bytes_per_slot(args, layout, model_runner.tp_size, routes_on_first)


def finish_device_bytes(model_runner, available: int) -> int:
    """The KV budget `available` (bytes) SGLang profiled, less the device memory TRACE's finish path may hold at
    once (`sglang_trace.capturer.finish_device_bytes`), so that `--mem-fraction-static` still holds with capture on.
    ValueError naming the flag when nothing would be left for the KV pool."""
    args: TraceArgs = check_server_args(model_runner.server_args)
    from sglang_trace.capturer import finish_device_bytes as reserved

    need = reserved(args)
    if not need:
        return available
    if available <= need:
        raise ValueError(
            f"TRACE's finish path needs {need / 2**30:.2f} GiB of device memory for its transfers, and "
            f"--mem-fraction-static {model_runner.mem_fraction_static} leaves "
            f"{max(0, available) / 2**30:.2f} GiB for the KV pool: raise --mem-fraction-static"
        )
    logger.info("TRACE: %.2f GiB of the KV budget kept for the finish path's device transfers", need / 2**30)
    return available - need


def trace_group(tp):
    """A gloo group over the attention-TP ranks for TRACE's record and K/V gathers (None for one rank), created at
    start-up by every rank in the same order, so TRACE's collectives never interleave with SGLang's on its own
    groups."""
    import torch.distributed as dist

    if tp.world_size == 1:
        return None
    if dist.get_world_size() != tp.world_size:
        raise ValueError(
            f"TRACE needs the TP group to span the whole process group (world {dist.get_world_size()}, TP "
            f"{tp.world_size}): pipeline, data or expert parallelism across processes is not traced"
        )
    return dist.new_group(ranks=list(tp.ranks), backend="gloo", timeout=TRACE_GROUP_TIMEOUT)


def quantize_dummy_experts(model, moe_tp_size: int, role) -> None:
    """emulate with `--load-format dummy`: the routed experts SGLang filled with random values (no weight loader
    ran) are quantize-dequantized as a load would have, so the served model is the recipe's from the first request.
    Refused under MoE TP > 1, where no rank holds a whole expert matrix to take its global scale from."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    if moe_tp_size > 1:
        raise ValueError(
            f"--trace-mode emulate with --load-format dummy at MoE TP {moe_tp_size}: the experts' global scales need "
            "whole matrices; load a checkpoint, or serve the dummy model at TP = 1"
        )
    EXPERT_WEIGHTS.role = role
    EXPERT_WEIGHTS.quantize_resident([m for m in model.modules() if isinstance(m, FusedMoE)])


def check_static_kv_scales(model, role) -> None:
    """ValueError naming the layers whose checkpoint brings KV scales (`k_scale` / `v_scale` other than 1) under
    a K/V role with a static global scale: TRACE's NVFP4 KV supports the unit scale only (both sides use S_enc = 1),
    and SGLang would divide K/V by the checkpoint's scale before quantizing."""
    from trace_core.numerics.recipe import Scale

    if role.scale is not Scale.STATIC:
        return
    from sglang.srt.layers.radix_attention import RadixAttention

    scaled = [
        f"layer {m.layer_id} ({name} = {float(getattr(m, name))})"
        for m in model.modules()
        if isinstance(m, RadixAttention)
        for name in ("k_scale", "v_scale")
        if getattr(m, name, None) is not None and float(getattr(m, name)) != 1.0
    ]
    if scaled:
        raise ValueError(
            f"NVFP4 KV with a static unit global scale: the checkpoint sets KV scales ({', '.join(scaled[:4])}); "
            "TRACE does not trace calibrated KV scales"
        )


def install_capturer(model_runner) -> bool:
    """Install a `TraceCapturer` as SGLang's global experts capturer when TRACE is on; True when installed (the
    caller then skips the built-in R3 capturer, whose role it takes over)."""
    server_args = model_runner.server_args
    args: TraceArgs = check_server_args(server_args)
    if not args.enabled:
        return False
    from sglang.srt.distributed.parallel_state import get_moe_tp_group, get_tp_group
    from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer

    from sglang_trace.capturer import TraceCapturer
    from sglang_trace.plugin import check_applied
    from sglang_trace.slot_fence import SlotFence

    check_applied()

    layout = model_layout(model_runner.model_config.hf_config)
    if check_moe_layers(model_runner.model, args.mode) != len(layout.moe_layers):
        raise ValueError(f"{layout.arch}: expected {len(layout.moe_layers)} FusedMoE layers in the built model")
    EXPERT_WEIGHTS.check_complete()
    check_static_kv_scales(model_runner.model, args.recipe.k)
    tp, moe_tp = get_tp_group(), get_moe_tp_group()
    if args.mode == "emulate" and server_args.load_format == "dummy":
        quantize_dummy_experts(model_runner.model, moe_tp.world_size, args.recipe.weights)
    if args.mode == "emulate" and EXPERT_WEIGHTS.stats.w13 == 0:
        raise RuntimeError("--trace-mode emulate: no routed-expert weight was quantized during load")
    max_tokens = forward_rows(server_args, model_runner.max_running_requests, model_runner.model_config.context_len)
    num_slots = model_runner.max_total_num_tokens + model_runner.page_size
    debug = None
    if args.debug_layer is not None:
        from sglang_trace.debug import DebugTap

        hf = model_runner.model_config.hf_config
        debug = DebugTap(
            args.debug_layer,
            hidden=layout.hidden,
            topk=layout.topk,
            intermediate=hf.moe_intermediate_size // moe_tp.world_size,
            max_tokens=max_tokens,
            num_slots=num_slots,
            device=model_runner.device,
            kv_pool=model_runner.token_to_kv_pool if args.kv_sites else None,
        )
    capturer = TraceCapturer(
        args,
        layout,
        kv_pool=model_runner.token_to_kv_pool if args.kv_sites else None,
        max_tokens=max_tokens,
        num_slots=num_slots,
        max_request_tokens=model_runner.model_config.context_len,
        device=model_runner.device,
        return_routes=server_args.enable_return_routed_experts,
        weights=EXPERT_WEIGHTS,
        tp_rank=tp.rank_in_group,
        tp_size=tp.world_size,
        trace_group=trace_group(tp),
        moe_tp_group=moe_tp if moe_tp.world_size > 1 else None,
        fence=SlotFence(model_runner.token_to_kv_pool_allocator) if args.records else None,
        debug=debug,
    )
    set_global_experts_capturer(capturer)
    if not args.records:
        logger.info(
            "TRACE %s: %s numerics, no records (--trace-sites none)%s",
            args.mode,
            args.recipe.name,
            "; routes kept for R3's answer only" if server_args.enable_return_routed_experts else "",
        )
        return True
    ring = capturer.ring
    logger.info(
        "TRACE %s: recording %d sites at %d bits (MoE layers %s, attention layers %s) into %s; host ring %.2f GiB "
        "(%d tokens of %d bytes, --trace-host-ring-gb)",
        args.mode,
        len(capturer.spec.sites()),
        args.bits,
        capturer.spec.moe_layers,
        capturer.spec.attn_layers,
        args.store,
        ring.capacity / 2**30 if ring is not None else 0.0,
        capturer.ring_tokens,
        capturer.token_bytes,
    )
    return True


def on_moe_input(layer, dispatch_output):
    """FusedMoE after dispatch: the MoE-input site. Returns the dispatch output the experts run on."""
    capturer = _capturer()
    if capturer is None:
        return dispatch_output
    if type(dispatch_output).__name__ != "StandardDispatchOutput" or dispatch_output.hidden_states_scale is not None:
        raise ValueError(
            f"TRACE MoE-input site needs the standard BF16 dispatcher, got {type(dispatch_output).__name__}"
        )
    x = capturer.moe_input(layer.layer_id, dispatch_output.hidden_states, getattr(layer, "w13_input_scale_quant", None))
    return dispatch_output._replace(hidden_states=x)


def _check_off() -> None:
    """RuntimeError when `--trace-mode` is on but no TRACE capturer is installed (its plugin hook did not run): the
    MoE sites would run unquantized and unrecorded."""
    try:
        args = _server_args()
    except (AttributeError, LookupError, RuntimeError):  # no server arguments in this process: not a server
        return
    if args is not None and getattr(args, "trace_mode", "off") != "off":
        raise RuntimeError(
            f"--trace-mode {args.trace_mode}: the MoE runs without TRACE's capturer (its SGLang plugin hooks are not "
            "applied in this process); records would be missing"
        )


def on_fc2_input(layer_id: int, h: torch.Tensor) -> torch.Tensor:
    """Expert path between the activation and the second GEMM: the FC2-input site. Returns what FC2 runs on."""
    capturer = _capturer()
    if capturer is None:
        _check_off()
        return h
    return capturer.fc2_input(layer_id, h)


def on_fc2_input_rows(h: torch.Tensor, rows: int, sorted_rows: bool) -> torch.Tensor:
    """The fused MoE kernel sequence between the activation and the second GEMM: the FC2-input site on its
    `[rows, intermediate]` cache in (token, top-k) order, of the layer whose MoE input was hooked last. Returns
    what FC2 runs on. Expert-sorted, padded rows (`down_moe_use_tma`) are refused: their order is not the
    records'."""
    capturer = _capturer()
    if capturer is None:
        _check_off()
        return h
    if sorted_rows or h.shape[0] != rows:
        raise ValueError(
            f"TRACE FC2-input site: the fused MoE runs a TMA down GEMM on {h.shape[0]} expert-sorted rows for "
            f"{rows} (token, expert) pairs; pass a down config without USE_TMA"
        )
    return capturer.fc2_input(capturer.fused_fc2_layer(), h, fused=True)


def on_request_finished(processor, req) -> None:
    """A request finished (before its KV is released): its records are queued for the store and the handle
    naming them rides SGLang's `customized_info` channel to `meta_info["trace"]`, a per-output-token list whose
    last entry is the handle (`sglang_trace.handle.from_meta_info`)."""
    capturer = _capturer()
    if capturer is None:
        return
    handle = capturer.finish_request(
        req.rid,
        req.req_pool_idx,
        req.seqlen,
        processor.req_to_token_pool,
        req.origin_input_ids,
        req.output_ids,
    )
    outputs = len(req.output_ids_through_stop)
    if handle is None or outputs == 0:
        return
    info = req.customized_info if req.customized_info is not None else {}
    info[TRACE_INFO_KEY] = [None] * (outputs - 1) + [handle]
    req.customized_info = info


def hybrid_full_kv_pool_class(dtype) -> type | None:
    """The KV pool class of a hybrid linear-attention model's full-attention layers for KV dtype `dtype`: SGLang's
    FP4 pool for FP4 (so its k/v sites exist), else None (SGLang's choice)."""
    if dtype is None or not hasattr(torch, "float4_e2m1fn_x2") or dtype != torch.float4_e2m1fn_x2:
        return None
    return _hybrid_fp4_pool_class()


@functools.cache
def _hybrid_fp4_pool_class() -> type:
    """SGLang's FP4 pool as the full-attention pool of a `HybridLinearKVPool`, whose `set_kv_buffer` passes a
    `dcp_kv_mask` keyword that `MHATokenToKVPoolFP4.set_kv_buffer` does not take (upstream never pairs the two)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolFP4

    class HybridFullKVPoolFP4(MHATokenToKVPoolFP4):
        """`MHATokenToKVPoolFP4` accepting the hybrid pool's `dcp_kv_mask=None` (decode context parallelism, the
        only source of a mask, is refused with TRACE on)."""

        def set_kv_buffer(self, *args, dcp_kv_mask: torch.Tensor | None = None, **kwargs) -> None:
            if dcp_kv_mask is not None:
                raise ValueError("SGLang's FP4 KV pool of a hybrid model takes no DCP KV mask (--dcp-size > 1)")
            return super().set_kv_buffer(*args, **kwargs)

    return HybridFullKVPoolFP4


def on_batch_done(scheduler) -> None:
    """The scheduler is about to stream a processed result batch: move the records of the requests that finished
    in it to the writer thread (one batched transfer)."""
    capturer = _capturer()
    if capturer is not None:
        capturer.on_batch_done()


def add_internal_state(state: dict) -> None:
    """`/server_info`'s internal state of a scheduler: TRACE's counters under "trace" (`TraceCapturer.counters`:
    requests, finish-path and writer seconds, host bytes, shards, failures, host-ring waits) when a capturer runs."""
    capturer = _capturer()
    if capturer is not None:
        state["trace"] = capturer.counters()


def refuse_weight_update(recv_req) -> str | None:
    """Before a tensor weight update: why TRACE refuses it (the update is then not applied), or None. A
    `load_format` of `direct` or a custom loader writes parameters without FusedMoE.weight_loader, where
    emulate quantizes the experts."""
    capturer = _capturer()
    if capturer is None:
        return None
    load_format = getattr(recv_req, "load_format", None)
    if load_format not in (None, "flattened_bucket"):
        return (
            f"TRACE is on: update_weights_from_tensor with load_format={load_format!r} writes parameters without "
            "FusedMoE.weight_loader (experts would not be quantized); use load_format None or 'flattened_bucket'"
        )
    return None


def on_weights_updated(scheduler, recv_req) -> None:
    """A weight update succeeded (from disk, tensor, distributed or IPC): its integer `weight_version` is the RL
    step of every later forward (chunked updates of one version keep one step). Without a usable version the
    step is unknown: every request finishing before the next versioned update is refused with an error in its
    handle, never filed under the old step. Expert completeness is checked by the next forward, not here: one
    update may send an expert's gate and up in different chunks."""
    capturer = _capturer()
    if capturer is None:
        return
    version: Any = getattr(recv_req, "weight_version", None)  # SGLang's request (untyped): any value
    try:
        step = int(version)
    except (TypeError, ValueError):
        step = None
    if step is None or step < 0 or step < (capturer.step if capturer.step is not None else -1):
        logger.error(
            "TRACE: weight update with weight_version=%r (need an integer RL step >= the current step %s); records "
            "are refused until an update carries one",
            version,
            capturer.step,
        )
        step = None
    capturer.set_step(step)
