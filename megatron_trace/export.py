"""Megatron GPTModel (Qwen3-MoE layout, local spec) → HF Qwen3-MoE checkpoint tensors, BF16 or with NVFP4 routed
experts.

Names are the checkpoint's (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, ...): what HF checkpoints hold,
what `from_pretrained` converts to transformers' fused `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`, and what
SGLang's weight loader and `update_weights_from_tensor` take. NVFP4 experts follow the ModelOpt checkpoint
convention: `weight` uint8 `[out, in/2]` (two E2M1 codes per byte, element 2i in the low nibble), `weight_scale`
float8_e4m3fn `[out, in/16]`, `weight_scale_2` FP32 global decode scale `1/S_enc`; gate and up are quantized as one
FC1 matrix, so they share `weight_scale_2`, exactly as the trainer's fake-quant does; `input_scale` FP32 scalar
`amax / 2688` (`1 / S_enc`) of each projection's input (the static activation decode scale SGLang's ModelOpt MoE method
loads into `w13_input_scale` / `w2_input_scale`; its native NVFP4 kernels quantize with `1 / input_scale`), from an
activation calibration (`calibrate_input_amax`). Any TP / EP / PP layout: the shards are gathered first
(`megatron_trace.parallel.gather_full_state`).

Packed experts exist for the `nvfp4-w4a4-kv4` recipe only (`check_packed_export`): SGLang (read in 0.5.10.post1) has
no MXFP4 MoE method for Qwen3-MoE, so the MXFP4 recipes export BF16 experts, which `--trace-mode emulate` quantizes at
load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from trace_core.numerics import e2m1
from trace_core.numerics.formats import NVFP4
from trace_core.numerics.quant import nvfp4_global_scale, quantize
from trace_core.numerics.recipe import DEFAULT_RECIPE, NVFP4_W4A4_KV4, PrecisionRecipe, get_recipe


def _check_layout(config) -> None:
    if (
        not config.gated_linear_unit
        or config.add_bias_linear
        or not config.qk_layernorm
        or config.normalization != "RMSNorm"
    ):
        raise ValueError("not a Qwen3-MoE layout: needs SwiGLU experts, no biases, QK-norm and RMSNorm")


def hf_config(model: torch.nn.Module, *, rope_theta: float, max_position_embeddings: int) -> dict:
    """`config.json` fields of the equivalent transformers `Qwen3MoeConfig`."""
    gpt: Any = model  # a megatron-core GPTModel (untyped)
    c = gpt.config
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": gpt.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_query_groups or c.num_attention_heads,
        "head_dim": c.kv_channels,
        "intermediate_size": c.ffn_hidden_size,
        "moe_intermediate_size": c.moe_ffn_hidden_size,
        "num_experts": c.num_moe_experts,
        "num_experts_per_tok": c.moe_router_topk,
        "norm_topk_prob": not c.moe_router_pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": c.layernorm_epsilon,
        "rope_theta": rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }


def nvfp4_pack(w: torch.Tensor, *, global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 tensors of one weight `[out, in]` (per-tensor global scale unless given)."""
    q = quantize(w.detach(), NVFP4, global_scale=global_scale)
    if q.global_scale is None:
        raise RuntimeError("NVFP4 quantization returned no global scale")
    return {
        "weight": e2m1.pack_fp4(q.codes),
        "weight_scale": q.scales.view(torch.float8_e4m3fn),
        "weight_scale_2": (1.0 / q.global_scale).reshape(()),
    }


def nvfp4_unpack(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """FP32 values of ModelOpt NVFP4 tensors: `code * weight_scale * weight_scale_2`."""
    values = e2m1.code_values(e2m1.unpack_fp4(t["weight"]))
    scale = t["weight_scale"].float() * t["weight_scale_2"]
    return (values.view(*scale.shape, NVFP4.block) * scale.unsqueeze(-1)).view(values.shape)


def _split_qkv(w: torch.Tensor, heads: int, groups: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Megatron's fused QKV rows are grouped per KV head: [q heads of the group, k, v] × groups."""
    per_group = heads // groups
    w = w.view(groups, per_group + 2, head_dim, -1)
    q = w[:, :per_group].reshape(heads * head_dim, -1)
    k = w[:, per_group].reshape(groups * head_dim, -1)
    v = w[:, per_group + 1].reshape(groups * head_dim, -1)
    return q, k, v


def check_packed_export(recipe: str | PrecisionRecipe) -> None:
    """Raise ValueError unless `recipe`'s routed-expert weights have a packed checkpoint format SGLang
    loads for Qwen3-MoE (read in 0.5.10.post1): ModelOpt NVFP4 (`nvfp4-w4a4-kv4`) only."""
    recipe = get_recipe(recipe)
    if recipe.weights != NVFP4_W4A4_KV4.weights:
        raise ValueError(
            f"packed routed-expert export for recipe {recipe.name} ({recipe.weights.fmt.name} weights) is refused: "
            "SGLang loads packed FP4 experts of Qwen3-MoE only as ModelOpt NVFP4; its mxfp4 MoE method "
            "is GPT-OSS's (W4A16 through the triton_kernels package, or MXFP8 activations with GPT-OSS's clamped "
            "SwiGLU on SM100). Export BF16 experts: --trace-mode emulate quantizes them at load"
        )


def export_hf(
    model: torch.nn.Module | list[torch.nn.Module],
    *,
    nvfp4_experts: bool = False,
    input_amax: Mapping[str, float] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    recipe: str | PrecisionRecipe = DEFAULT_RECIPE,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE state dict of the model in `dtype` on `device` (routed experts packed NVFP4 with their
    `input_scale` from `input_amax` when `nvfp4_experts`, for a recipe that allows it: `check_packed_export`),
    gathered across its TP / EP / PP shards (`megatron_trace.parallel.gather_full_state`: collective, every rank
    calls it with its chunks; ranks off the first pipeline stage get `{}`)."""
    from megatron_trace.parallel import gather_full_state, unwrap

    if nvfp4_experts:
        check_packed_export(recipe)
    chunks = model if isinstance(model, list) else [model]
    state = gather_full_state(chunks, device=device)
    if not state:
        return {}
    config = unwrap(chunks[0]).config
    return export_state(state, config, nvfp4_experts=nvfp4_experts, input_amax=input_amax, dtype=dtype, recipe=recipe)


def export_state(
    state: dict[str, torch.Tensor],
    config,
    *,
    nvfp4_experts: bool = False,
    input_amax: Mapping[str, float] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    recipe: str | PrecisionRecipe = DEFAULT_RECIPE,
) -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE state dict of a full single-rank Megatron state dict (`gather_full_state`'s names). With
    `nvfp4_experts`, `input_amax` (`calibrate_input_amax`) must name every routed expert projection."""
    _check_layout(config)
    if nvfp4_experts:
        check_packed_export(recipe)
        _check_input_amax(input_amax, config)
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    if any(".shared_experts." in k for k in state):
        raise ValueError("Qwen3-MoE has no shared experts")
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
        "model.norm.weight": state["decoder.final_layernorm.weight"],
        "lm_head.weight": state["output_layer.weight"],
    }
    for i in range(config.num_layers):
        p, m = f"model.layers.{i}", f"decoder.layers.{i}"
        q, k, v = _split_qkv(state[f"{m}.self_attention.linear_qkv.weight"], heads, groups, config.kv_channels)
        out |= {
            f"{p}.input_layernorm.weight": state[f"{m}.input_layernorm.weight"],
            f"{p}.post_attention_layernorm.weight": state[f"{m}.pre_mlp_layernorm.weight"],
            f"{p}.self_attn.q_proj.weight": q,
            f"{p}.self_attn.k_proj.weight": k,
            f"{p}.self_attn.v_proj.weight": v,
            f"{p}.self_attn.o_proj.weight": state[f"{m}.self_attention.linear_proj.weight"],
            f"{p}.self_attn.q_norm.weight": state[f"{m}.self_attention.q_layernorm.weight"],
            f"{p}.self_attn.k_norm.weight": state[f"{m}.self_attention.k_layernorm.weight"],
            f"{p}.mlp.gate.weight": state[f"{m}.mlp.router.weight"],
        }
        for e in range(config.num_moe_experts):
            fc1 = state[f"{m}.mlp.experts.local_experts.{e}.linear_fc1.weight"]
            fc2 = state[f"{m}.mlp.experts.local_experts.{e}.linear_fc2.weight"]
            ep = f"{p}.mlp.experts.{e}"
            if nvfp4_experts:
                w13 = nvfp4_pack(fc1)
                for name, half in (("gate_proj", 0), ("up_proj", 1)):
                    out |= {
                        f"{ep}.{name}.weight": w13["weight"].chunk(2)[half],
                        f"{ep}.{name}.weight_scale": w13["weight_scale"].chunk(2)[half],
                        f"{ep}.{name}.weight_scale_2": w13["weight_scale_2"],
                    }
                out |= {f"{ep}.down_proj.{k}": t for k, t in nvfp4_pack(fc2).items()}
                if input_amax is None:  # refused above by _check_input_amax
                    raise ValueError("NVFP4 export needs input_amax (calibrate_input_amax)")
                for name in ("gate_proj", "up_proj", "down_proj"):  # the decode scale 1 / S_enc
                    amax = torch.tensor(input_amax[f"{ep}.{name}"], dtype=torch.float32)
                    out[f"{ep}.{name}.input_scale"] = 1.0 / nvfp4_global_scale(amax)
            else:
                gate, up = fc1.chunk(2)
                out |= {f"{ep}.gate_proj.weight": gate, f"{ep}.up_proj.weight": up, f"{ep}.down_proj.weight": fc2}
    return {k: _cast(k, t, dtype) for k, t in out.items()}


def calibrate_input_amax(chunks: list[torch.nn.Module], forward: Callable[[], object]) -> dict[str, float]:
    """The largest |input| of every routed expert's FC1 and FC2 while `forward()` runs the model `chunks` (e.g. the
    trainer's forward of a rollout batch), keyed by the HF module name (`model.layers.{l}.mlp.experts.{e}.gate_proj`,
    `up_proj` (the same input), `down_proj`): the activation calibration of the NVFP4 export's `input_scale`.
    Maximum over all ranks (collective: every rank calls it; experts found by their global layer and expert id)."""
    from megatron.core import parallel_state

    from megatron_trace.parallel import unwrap

    amax: dict[tuple[int, int, str], torch.Tensor] = {}
    handles = []
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None or not hasattr(experts, "local_experts"):
                raise TypeError(f"calibrate_input_amax needs SequentialMLP experts, got {type(experts).__name__}")
            first = parallel_state.get_expert_model_parallel_rank() * len(experts.local_experts)
            for j, expert in enumerate(experts.local_experts):
                for fc, proj in (("linear_fc1", "gate_proj"), ("linear_fc2", "down_proj")):
                    key = (layer.layer_number - 1, first + j, proj)

                    def hook(module, args, key=key):
                        seen = args[0].detach().abs().amax().float()
                        amax[key] = torch.maximum(amax[key], seen) if key in amax else seen

                    handles.append(getattr(expert, fc).register_forward_pre_hook(hook))
    try:
        forward()
    finally:
        for h in handles:
            h.remove()
    everyone: list[dict] = [{}] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, {k: float(v) for k, v in amax.items()})
    out: dict[str, float] = {}
    for part in everyone:  # each expert's maximum over the ranks that ran it
        for (layer, expert, proj), v in part.items():
            names = ("gate_proj", "up_proj") if proj == "gate_proj" else (proj,)
            for name in names:
                hf_name = f"model.layers.{layer}.mlp.experts.{expert}.{name}"
                out[hf_name] = max(out.get(hf_name, 0.0), v)
    return out


def _check_input_amax(input_amax: Mapping[str, float] | None, config) -> None:
    """Every routed expert projection needs its calibrated input amax (an expert no token reached has none)."""
    names = [
        f"model.layers.{i}.mlp.experts.{e}.{proj}"
        for i in range(config.num_layers)
        for e in range(config.num_moe_experts)
        for proj in ("gate_proj", "up_proj", "down_proj")
    ]
    missing = [n for n in names if n not in (input_amax or {})]
    if missing:
        raise ValueError(
            f"NVFP4 export needs the input amax of every routed expert projection (input_scale); {len(missing)} of "
            f"{len(names)} have none, first {missing[:3]}: calibrate_input_amax over tokens that reach every expert"
        )


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dense weights to `dtype`; packed codes, E4M3 scales and the FP32 global and input scales stay as they are."""
    fp32_scale = name.endswith(("weight_scale_2", "input_scale"))
    keep = not t.is_floating_point() or t.dtype == torch.float8_e4m3fn or fp32_scale
    return (t.detach() if keep else t.detach().to(dtype)).contiguous()


def nvfp4_quant_config() -> dict:
    """`quantization_config` for config.json: ModelOpt NVFP4 on the routed experts only, dynamic activations."""
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": NVFP4.block,
        "exclude_modules": ["lm_head", "*self_attn*", "*mlp.gate"],
    }
