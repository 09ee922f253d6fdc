"""TRACE as an SGLang general plugin (entry point group `sglang.srt.plugins`, name `trace`).

SGLang 0.5.15 loads general plugins in its main process and in every scheduler process before the model is built
(`sglang.srt.plugins.load_plugins`); `register` puts TRACE's hooks on the seams listed in `HOOKS` through
SGLang's `HookRegistry`. Every hook calls `sglang_trace.hooks`, whose functions are no-ops while `--trace-mode` is
off. Where no seam exists (the server-argument fields, the FC2 input inside the fused MoE kernel sequence, the
FP4-KV attention call), a file patch calls the same module (`patches/sglang/v0.5.15.post1/`).

SGLang logs and swallows a plugin or hook that fails to apply, so TRACE checks: the server arguments refuse
`--trace-mode` on unless every hook is registered (`check_registered`), the capturer refuses to start unless every
hook is applied in the scheduler process (`check_applied`), and the file-patched FC2-input site refuses to run
while TRACE is on without a capturer (`hooks.on_fc2_input_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sglang_trace import hooks

_SCHED = "sglang.srt.managers.scheduler_components"


@dataclass(frozen=True)
class Hook:
    """One TRACE hook: SGLang's dotted target, the hook type (`HookType` member name) and the function."""

    target: str
    kind: str
    fn: Callable


def _moe_input(layer, dispatch_output):
    """BEFORE `FusedMoE.run_moe_core`: the MoE-input site rewrites the dispatched input."""
    return (layer,), {"dispatch_output": hooks.on_moe_input(layer, dispatch_output)}


def _weight_loaded(result, layer, param, loaded_weight, weight_name, shard_id, expert_id):
    """AFTER `FusedMoE.weight_loader`: emulate quantizes the expert matrix just written."""
    hooks.on_expert_weight_loaded(layer, param, loaded_weight, shard_id, expert_id)


def _install_capturer(original, model_runner):
    """AROUND `ModelRunner.init_routed_experts_capturer`: the TRACE capturer takes the R3 seam when TRACE is on."""
    if model_runner.is_draft_worker or not hooks.install_capturer(model_runner):
        return original(model_runner)
    return None


def _request_finished(processor, req):
    """BEFORE `SchedulerBatchResultProcessor._maybe_collect_routed_experts`: every finished request, before its
    KV is released (R3's own collection returns early unless the request asked for routes)."""
    hooks.on_request_finished(processor, req)


def _batch_done(streamer, *args, **kwargs):
    """BEFORE `SchedulerOutputStreamer.stream_output`: a result batch was processed."""
    hooks.on_batch_done(streamer)


def _weights_updated(result, manager, recv_req):
    """AFTER a scheduler weight update: a successful one sets the RL step of later forwards."""
    if getattr(result, "success", False):
        hooks.on_weights_updated(manager, recv_req)


def _tensor_update(original, manager, recv_req):
    """AROUND `update_weights_from_tensor`: refuse load formats that bypass `FusedMoE.weight_loader` (every TP
    rank refuses alike, so the update's TP barrier is skipped on all of them)."""
    reason = hooks.refuse_weight_update(recv_req)
    if reason is None:
        result = original(manager, recv_req)
        _weights_updated(result, manager, recv_req)
        return result
    from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqOutput

    return UpdateWeightsFromTensorReqOutput(success=False, message=reason)


def _internal_state(result, scheduler, recv_req):
    """AFTER `Scheduler.get_internal_state`: TRACE's counters join the state `/server_info` reports."""
    hooks.add_internal_state(result.internal_state)


def _cell_size(result, configurator, model_runner, num_layers):
    """AFTER `DefaultPoolConfigurator._compute_cell_size`: the record store's bytes per KV slot join the KV cell
    size, so the pool shrinks to make room and `--mem-fraction-static` still holds."""
    return result + hooks.record_bytes_per_token(model_runner)


def _available_bytes(result, model_runner, pre_model_load_memory):
    """AFTER `ModelRunnerKVCacheMixin._profile_available_bytes`: the finish path's device buffers come off the KV
    budget, so the pool leaves room for them."""
    return hooks.finish_device_bytes(model_runner, result)


def _hybrid_pool(pool, *args, **kwargs):
    """BEFORE `HybridLinearKVPool.__init__`: its full-attention layers get the FP4 pool class for an FP4 dtype
    (upstream builds a plain MHA pool there)."""
    dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
    cls = hooks.hybrid_full_kv_pool_class(dtype)
    if cls is not None:
        kwargs["full_kv_pool_class"] = cls
    return (pool, *args), kwargs


def _kv_quantize(original, tensor):
    """AROUND `BlockFP4KVQuantizeUtil.batched_quantize`: the FP4 KV pool's quantizer follows the recipe."""
    return hooks.kv_pool_quantize(original, tensor)


def _kv_dequantize(original, *args, **kwargs):
    """AROUND `BlockFP4KVQuantizeUtil.batched_dequantize`: the FP4 KV pool's dequantizer follows the recipe."""
    return hooks.kv_pool_dequantize(original, *args, **kwargs)


def _qwen3_moe_attention(result, attn, *args, **kwargs):
    """AFTER `Qwen3MoeAttention.__init__`: a head size whose RoPE takes SGLang's fallback kernel (on CUDA, any but
    64 / 128 / 256 / 512) cannot also write the KV cache in the RoPE call, so the layer writes it in the attention
    call instead (upstream asserts in the RoPE call on a BF16 KV pool). The cached K/V values are the same; on with
    every `--trace-mode`, since the BF16 policy is served with TRACE off."""
    if getattr(attn.rotary_emb, "use_fallback_kernel", False):
        attn.compatible_with_fused_kv_buffer = False


_KV_UTIL = "sglang.srt.layers.quantization.kvfp4_tensor.BlockFP4KVQuantizeUtil"

HOOKS = (
    Hook("sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.run_moe_core", "BEFORE", _moe_input),
    Hook("sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.weight_loader", "AFTER", _weight_loaded),
    Hook(
        "sglang.srt.model_executor.model_runner.ModelRunner.init_routed_experts_capturer", "AROUND", _install_capturer
    ),
    Hook(
        f"{_SCHED}.batch_result_processor.SchedulerBatchResultProcessor._maybe_collect_routed_experts",
        "BEFORE",
        _request_finished,
    ),
    Hook(f"{_SCHED}.output_streamer.SchedulerOutputStreamer.stream_output", "BEFORE", _batch_done),
    *(
        Hook(
            f"{_SCHED}.weight_updater.SchedulerWeightUpdaterManager.update_weights_from_{src}",
            "AFTER",
            _weights_updated,
        )
        for src in ("disk", "distributed", "ipc")
    ),
    Hook(f"{_SCHED}.weight_updater.SchedulerWeightUpdaterManager.update_weights_from_tensor", "AROUND", _tensor_update),
    Hook("sglang.srt.managers.scheduler.Scheduler.get_internal_state", "AFTER", _internal_state),
    Hook("sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size", "AFTER", _cell_size),
    Hook(
        "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin._profile_available_bytes",
        "AFTER",
        _available_bytes,
    ),
    Hook("sglang.srt.mem_cache.memory_pool.HybridLinearKVPool.__init__", "BEFORE", _hybrid_pool),
    Hook(f"{_KV_UTIL}.batched_quantize", "AROUND", _kv_quantize),
    Hook(f"{_KV_UTIL}.batched_dequantize", "AROUND", _kv_dequantize),
    Hook("sglang.srt.models.qwen3_moe.Qwen3MoeAttention.__init__", "AFTER", _qwen3_moe_attention),
)


def register() -> None:
    """The plugin entry point: register every TRACE hook with SGLang's `HookRegistry` (SGLang applies them)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in HOOKS:
        if not _registered(hook):
            HookRegistry.register(hook.target, hook.fn, HookType[hook.kind])


def _registered(hook: Hook) -> bool:
    """Whether `hook` is registered with SGLang's `HookRegistry` in this process."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    return any(fn is hook.fn for _, fn, _ in HookRegistry._hooks.get(hook.target, ()))


def _wraps(fn, hook: Callable) -> bool:
    """Whether `fn` is a HookRegistry wrapper chain containing `hook`."""
    while fn is not None:
        closure = getattr(fn, "__closure__", None) or ()
        if any(getattr(c, "cell_contents", None) is hook for c in closure):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def check_registered() -> None:
    """RuntimeError unless every TRACE hook is registered with SGLang's `HookRegistry` in this process (the plugin
    entry point was loaded: installed, and not filtered out by `SGLANG_PLUGINS`). Checked with the server
    arguments, before SGLang starts its scheduler processes."""
    missing = [h.target for h in HOOKS if not _registered(h)]
    if missing:
        raise RuntimeError(
            f"--trace-mode is on but TRACE's SGLang plugin hooks are not registered ({len(missing)} of {len(HOOKS)}, "
            f"e.g. {missing[0]}): install trace-rl in the server's environment (entry point sglang.srt.plugins: "
            "trace) and keep 'trace' in SGLANG_PLUGINS if it is set"
        )


def check_applied() -> None:
    """RuntimeError naming every TRACE hook that is not in place (the plugin not installed, filtered out by
    `SGLANG_PLUGINS`, or a target that failed to patch: SGLang only logs those)."""
    import pkgutil

    missing = []
    for hook in HOOKS:
        owner, _, attr = hook.target.rpartition(".")
        try:
            fn = getattr(pkgutil.resolve_name(owner), attr)
        except (ImportError, AttributeError) as e:
            missing.append(f"{hook.target} ({type(e).__name__}: {e})")
            continue
        if not _wraps(getattr(fn, "__func__", fn), hook.fn):
            missing.append(hook.target)
    if missing:
        raise RuntimeError(
            "TRACE's SGLang plugin hooks are not applied: "
            + ", ".join(missing)
            + " (install trace-rl in the server's environment and keep 'trace' in SGLANG_PLUGINS if it is set)"
        )
