"""Megatron GPTModel (Qwen3-MoE layout, local spec) → HF Qwen3-MoE checkpoint tensors, BF16 or with NVFP4 routed
experts.

Names are the checkpoint's (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight`, ...): what HF checkpoints hold,
what `from_pretrained` converts to transformers' fused `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`, and what
SGLang's weight loader and `update_weights_from_tensor` take. NVFP4 experts follow the ModelOpt checkpoint
convention: `weight` uint8 `[out, in/2]` (two E2M1 codes per byte, element 2i in the low nibble), `weight_scale`
float8_e4m3fn `[out, in/16]`, `weight_scale_2` FP32 global decode scale `1/S_enc`; gate and up are quantized as one
FC1 matrix, so they share `weight_scale_2`, exactly as the trainer's fake-quant does. Single rank (TP = EP = PP = 1).
"""

from __future__ import annotations

import torch

from trace_core import e2m1
from trace_core.formats import NVFP4
from trace_core.quant import quantize


def _check_single_rank(model: torch.nn.Module) -> None:
    c = model.config
    sizes = {
        "tensor_model_parallel_size": c.tensor_model_parallel_size,
        "pipeline_model_parallel_size": c.pipeline_model_parallel_size,
        "expert_model_parallel_size": c.expert_model_parallel_size,
    }
    if any(v != 1 for v in sizes.values()):
        raise NotImplementedError(f"export gathers nothing across ranks yet: {sizes}")
    if not c.gated_linear_unit or c.add_bias_linear or not c.qk_layernorm or c.normalization != "RMSNorm":
        raise ValueError("not a Qwen3-MoE layout: needs SwiGLU experts, no biases, QK-norm and RMSNorm")


def hf_config(model: torch.nn.Module, *, rope_theta: float, max_position_embeddings: int) -> dict:
    """`config.json` fields of the equivalent transformers `Qwen3MoeConfig`."""
    c = model.config
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": model.embedding.word_embeddings.weight.shape[0],
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


def export_hf(
    model: torch.nn.Module, *, nvfp4_experts: bool = False, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE state dict of `model` in `dtype`; routed experts packed NVFP4 when `nvfp4_experts`."""
    _check_single_rank(model)
    c = model.config
    heads, groups = c.num_attention_heads, c.num_query_groups or c.num_attention_heads
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.embedding.word_embeddings.weight,
        "model.norm.weight": model.decoder.final_layernorm.weight,
        "lm_head.weight": model.output_layer.weight,
    }
    for layer in model.decoder.layers:
        p = f"model.layers.{layer.layer_number - 1}"
        attn, mlp = layer.self_attention, layer.mlp
        q, k, v = _split_qkv(attn.linear_qkv.weight, heads, groups, c.kv_channels)
        out |= {
            f"{p}.input_layernorm.weight": layer.input_layernorm.weight,
            f"{p}.post_attention_layernorm.weight": layer.pre_mlp_layernorm.weight,
            f"{p}.self_attn.q_proj.weight": q,
            f"{p}.self_attn.k_proj.weight": k,
            f"{p}.self_attn.v_proj.weight": v,
            f"{p}.self_attn.o_proj.weight": attn.linear_proj.weight,
            f"{p}.self_attn.q_norm.weight": attn.q_layernorm.weight,
            f"{p}.self_attn.k_norm.weight": attn.k_layernorm.weight,
            f"{p}.mlp.gate.weight": mlp.router.weight,
        }
        if mlp.shared_experts is not None:
            raise ValueError("Qwen3-MoE has no shared experts")
        for e, expert in enumerate(mlp.experts.local_experts):
            fc1, fc2 = expert.linear_fc1.weight.detach(), expert.linear_fc2.weight.detach()
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
            else:
                gate, up = fc1.chunk(2)
                out |= {f"{ep}.gate_proj.weight": gate, f"{ep}.up_proj.weight": up, f"{ep}.down_proj.weight": fc2}
    return {k: _cast(k, t, dtype) for k, t in out.items()}


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dense weights to `dtype`; packed codes, E4M3 scales and the FP32 global scale stay as they are."""
    keep = not t.is_floating_point() or t.dtype == torch.float8_e4m3fn or name.endswith("weight_scale_2")
    return (t.detach() if keep else t.detach().to(dtype)).contiguous()


def nvfp4_quant_config() -> dict:
    """`quantization_config` for config.json: ModelOpt NVFP4 on the routed experts only, dynamic activations."""
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": NVFP4.block,
        "exclude_modules": ["lm_head", "*self_attn*", "*mlp.gate"],
    }
