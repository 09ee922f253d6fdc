"""A Qwen3-MoE-shaped GPTModel of any size (local spec with SP-capable norms, SequentialMLP): the model CPU tests, the
GPU smoke test, the step benchmark and the RL trainer build, for any TP / EP / PP layout (the tiny presets are in
`trace_rl.warmup`). Qwen3-MoE architecture:
RMSNorm, QK-norm, SwiGLU experts, softmax top-k renormalised over the
chosen experts (`norm_topk_prob`), no biases, untied embeddings, RoPE."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoEModelConfig:
    """Dimensions of the model (the defaults, a tiny one, keep a CPU forward + backward well under a second)."""

    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    experts: int = 4
    topk: int = 2
    expert_ffn: int = 32
    max_seq: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6


def transformer_config(
    cfg: MoEModelConfig, *, dtype: torch.dtype = torch.float32, routing_replay: bool = True, **overrides
):
    """Megatron TransformerConfig for `cfg` with the settings TRACE needs (no fusions, no aux loss, replay on);
    `overrides` set further TransformerConfig fields (recomputation, parallelism)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        num_layers=cfg.layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        num_query_groups=cfg.kv_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.expert_ffn,
        moe_ffn_hidden_size=cfg.expert_ffn,
        num_moe_experts=cfg.experts,
        moe_router_topk=cfg.topk,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=routing_replay,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
    )
    return TransformerConfig(**(fields | overrides))


def build_moe_model(
    cfg: MoEModelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    routing_replay: bool = True,
    vp_stage: int | None = None,
    grouped: bool = False,
    **overrides,
):
    """A GPTModel with MoE in every layer (this pipeline stage's layers, virtual stage `vp_stage`), deterministic in
    `seed` for a given layout. Needs `megatron_trace.cpu.init_megatron()` first; `grouped` builds the TRACE grouped
    experts (`megatron_trace.grouped`) instead of SequentialMLP; `overrides` go to `transformer_config` (parallel
    sizes, sequence parallelism, recomputation)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel

    from megatron_trace.specs import block_spec

    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    config = transformer_config(cfg, dtype=dtype, routing_replay=routing_replay, **overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, cfg.experts, vp_stage, grouped=grouped),
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
        vocab_size=cfg.vocab,
        max_sequence_length=cfg.max_seq,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        share_embeddings_and_output_weights=False,
    )
    return model.to(device="cuda" if torch.cuda.is_available() else "cpu", dtype=dtype)
