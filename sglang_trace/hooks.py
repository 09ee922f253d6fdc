"""The functions the SGLang patch hunks call (`patches/sglang/v0.5.10.post1/`): one per hook point, each a no-op
when `--trace-mode` is off, so the patched engine behaves as upstream unless TRACE is switched on.

| hook | called from (patched SGLang) |
|---|---|
| `add_cli_args`, `check_server_args` | `ServerArgs.add_cli_args`, `ServerArgs.__post_init__` |
| `on_expert_weight_loaded` | `FusedMoE.weight_loader`, after every write (initial load and every weight update) |
| `install_capturer` | `ModelRunner.init_routed_experts_capturer` (after the KV pool exists, before CUDA graphs) |
| `on_moe_input` | `FusedMoE.forward_impl`, right after dispatch |
| `on_request_finished` | `SchedulerOutputProcessorMixin.maybe_collect_routed_experts` (before the KV is released) |
| `on_weights_updated` | the scheduler's `update_weights_from_{disk,tensor,distributed}` after success |
"""

from __future__ import annotations

import logging

import torch

from sglang_trace.config import TraceArgs, add_cli_args, check_server_args, model_layout
from sglang_trace.moe import ExpertWeights

__all__ = [
    "add_cli_args",
    "check_server_args",
    "install_capturer",
    "on_expert_weight_loaded",
    "on_moe_input",
    "on_request_finished",
    "on_weights_updated",
]

logger = logging.getLogger(__name__)

# Expert weights of this process (one model per scheduler/TP process).
EXPERT_WEIGHTS = ExpertWeights()


def _server_args():
    from sglang.srt.server_args import get_global_server_args

    return get_global_server_args()


def _capturer():
    from sglang.srt.layers.moe.routed_experts_capturer import get_global_experts_capturer

    from sglang_trace.capturer import TraceCapturer

    capturer = get_global_experts_capturer()
    return capturer if isinstance(capturer, TraceCapturer) else None


def on_expert_weight_loaded(layer, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str, expert_id) -> None:
    """emulate-nvfp4: quantize-dequantize the expert matrix the loader just wrote (see `ExpertWeights`)."""
    if _server_args().trace_mode != "emulate-nvfp4":
        return
    if type(layer.quant_method).__name__ != "UnquantizedFusedMoEMethod":
        raise ValueError(
            f"--trace-mode emulate-nvfp4 needs BF16 routed experts; layer {layer.layer_id} uses "
            f"{type(layer.quant_method).__name__}"
        )
    if expert_id is None:
        raise ValueError(f"--trace-mode emulate-nvfp4: layer {layer.layer_id} loads fused experts (no expert id)")
    EXPERT_WEIGHTS.on_loaded(layer, param, loaded_weight, shard_id, expert_id)


def forward_rows(server_args, max_running_requests: int) -> int:
    """Most token rows one forward can run: a prefill chunk (the whole prefill budget when chunking is off), a
    decode batch, or a padded CUDA-graph batch."""
    chunk = server_args.chunked_prefill_size
    prefill = chunk if chunk and chunk > 0 else server_args.max_prefill_tokens
    return max(prefill, max_running_requests, server_args.cuda_graph_max_bs or 0)


def install_capturer(model_runner) -> bool:
    """Install a `TraceCapturer` as SGLang's global experts capturer when TRACE is on; True when installed (the
    caller then skips the built-in R3 capturer, whose role it takes over)."""
    server_args = model_runner.server_args
    args: TraceArgs = check_server_args(server_args)
    if not args.enabled:
        return False
    from sglang.srt.distributed.parallel_state import get_tp_group
    from sglang.srt.layers.moe.routed_experts_capturer import set_global_experts_capturer

    from sglang_trace.capturer import TraceCapturer

    layout = model_layout(model_runner.model_config.hf_config)
    EXPERT_WEIGHTS.check_complete()
    if args.mode == "emulate-nvfp4" and EXPERT_WEIGHTS.stats.w13 == 0:
        if server_args.load_format != "dummy":
            raise RuntimeError("--trace-mode emulate-nvfp4: no routed-expert weight was quantized during load")
        logger.warning(
            "TRACE emulate-nvfp4 with --load-format dummy: routed experts stay unquantized until the first weight "
            "update writes them (records of earlier requests do not describe an NVFP4 model)"
        )
    tp = get_tp_group()
    capturer = TraceCapturer(
        args,
        layout,
        kv_pool=model_runner.token_to_kv_pool if args.kv_sites else None,
        max_tokens=forward_rows(server_args, model_runner.max_running_requests),
        num_slots=model_runner.max_total_num_tokens + model_runner.page_size,
        device=model_runner.device,
        return_routes=server_args.enable_return_routed_experts,
        weights=EXPERT_WEIGHTS,
        tp_rank=tp.rank_in_group,
        tp_group=tp.device_group if tp.world_size > 1 else None,
    )
    set_global_experts_capturer(capturer)
    logger.info(
        "TRACE %s: recording %d sites at %d bits (MoE layers %s, attention layers %s) into %s",
        args.mode,
        len(capturer.spec.sites()),
        args.bits,
        capturer.spec.moe_layers,
        capturer.spec.attn_layers,
        args.store,
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


def on_request_finished(scheduler, req) -> None:
    """A request finished: its records go to the store and `req.trace_handle` names them (before KV release)."""
    capturer = _capturer()
    if capturer is None:
        return
    tokens = [*req.origin_input_ids, *req.output_ids]
    req.trace_handle = capturer.finish_request(
        req.rid, req.req_pool_idx, req.seqlen, scheduler.req_to_token_pool, tokens
    )


def on_weights_updated(scheduler, recv_req) -> None:
    """A weight update succeeded: an integer `weight_version` selects the RL step later records are written under
    (chunked updates of one version keep one step). Expert completeness is checked by the next forward, not here:
    one update may send an expert's gate and up in different chunks."""
    capturer = _capturer()
    if capturer is None:
        return
    version = getattr(recv_req, "weight_version", None)
    if version is None:
        return
    try:
        step = int(version)
    except ValueError:
        raise ValueError(f"TRACE needs integer weight versions (the RL step of the records), got {version!r}") from None
    capturer.set_step(step)
