"""Layer specs the trainer builds: Megatron's local spec (SequentialMLP, local linears) with a norm that runs under
sequence parallelism.

The local spec's `WrappedTorchNorm` refuses `sequence_parallel`, and `MoELayer` refuses tensor parallelism without
it, so TP > 1 cannot train on the local spec. `SequenceParallelNorm` is torch's `RMSNorm` / `LayerNorm` with its
parameters tagged `sequence_parallel` (as TE's norms tag theirs): Megatron's `finalize_model_grads` then sums their
gradients over the tensor-parallel group, since each TP rank saw only its chunk of the sequence. With TE installed,
TE's own spec (`get_gpt_layer_with_transformer_engine_spec`) has SP-capable norms; its expert linears are not wired
to the weight site yet (`TraceSession` raises), so the trainer builds this spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class SequenceParallelNorm:
    """`RMSNorm` / `LayerNorm` for Megatron specs that accepts `sequence_parallel` (Megatron's norm signature).

    A class whose construction returns a torch norm (`torch.nn.RMSNorm` or `torch.nn.LayerNorm`), not an instance of
    itself, as Megatron's `WrappedTorchNorm`: a spec's `build_module` instantiates classes and returns functions
    uncalled. `__new__` is therefore typed `Any`, since a type checker requires it to return an instance."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> Any:
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("SequenceParallelNorm: zero-centered gamma / memory-efficient norm are not supported")
        kinds = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}
        if config.normalization not in kinds:
            raise ValueError(f"SequenceParallelNorm: normalization {config.normalization!r} not in {sorted(kinds)}")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _swap_norms(obj):
    """A copy of a spec tree with every `WrappedTorchNorm` replaced by `SequenceParallelNorm`."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if obj is WrappedTorchNorm:
        return SequenceParallelNorm
    if isinstance(obj, ModuleSpec):
        return dataclasses.replace(obj, submodules=_swap_norms(obj.submodules))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _swap_norms(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    return obj


def layer_spec(num_experts: int):
    """Megatron's local GPT layer spec (MoE with `SequentialMLP`, QK-norm, RMSNorm) with SP-capable norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return _swap_norms(get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=True, normalization="RMSNorm"))


def block_spec(config, num_experts: int, vp_stage: int | None = None, *, grouped: bool = False):
    """Transformer-block submodules of this pipeline stage (its share of the layers) with SP-capable norms,
    the final norm included; `grouped`: TRACE grouped experts (`megatron_trace.grouped`) instead of SequentialMLP."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megatron_trace.grouped import with_grouped_experts

    layer = layer_spec(num_experts)
    if grouped:
        layer = with_grouped_experts(layer)
    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=SequenceParallelNorm)
