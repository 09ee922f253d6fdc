"""Quantization mode of the trainer and the Megatron settings TRACE requires (checked, never assumed)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trace_core.modes import MODES, Mode
from trace_core.numerics.recipe import PrecisionRecipe, Role
from trace_core.records.spec import RecordSpec


@dataclass(frozen=True)
class TraceConfig:
    """Trainer-side TRACE settings.

    Attributes:
        mode: `Mode` or its value.
        spec: which sites the rollout captured and with how many code bits (MoE-input and KV formats included).
        replay_routes: R3: replay the rollout's expert routes in every MoE router.
        measure: compute per-site code-flip rates against the records (one extra quantization per site).
        recipe: the precision recipe (`trace_core.numerics.recipe`) of every FP4 site, a name or the object; None takes
            the spec's recipe, else the default. A spec whose recipe or record layout disagrees is refused.
        expert_weights_in_place: TRACE grouped experts only: their BF16 weight parameters hold the fake-quantized
            values (`TraceSession.quantize_weights_in_place`, after every copy of the FP32 master weights into
            them) instead of a fake-quantized copy kept per step. Needs master weights outside the model.
    """

    mode: Mode | str = Mode.TRACE
    spec: RecordSpec = field(default_factory=RecordSpec)
    replay_routes: bool = True
    measure: bool = True
    recipe: PrecisionRecipe | str | None = None
    expert_weights_in_place: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", Mode(self.mode))
        except ValueError:
            raise ValueError(f"unknown mode {self.mode!r}; use one of {MODES}") from None
        if not isinstance(self.spec, RecordSpec):
            raise ValueError(f"spec must be a trace_core.records.spec.RecordSpec, got {type(self.spec).__name__}")
        object.__setattr__(self, "recipe", self.spec.resolve_recipe(self.recipe))

    @property
    def quantized(self) -> bool:
        return self.mode is not Mode.BF16

    def role(self, name: str) -> Role:
        """The recipe's role `name` (weights, moe_in, fc2_in, k, v)."""
        if not isinstance(self.recipe, PrecisionRecipe):  # __post_init__ resolves it
            raise RuntimeError(f"TraceConfig.recipe is not resolved: {self.recipe!r}")
        return self.recipe.role(name)


def check_megatron_config(config, cfg: TraceConfig) -> None:
    """Raise ValueError / NotImplementedError for Megatron settings under which the sites or R3 would be wrong.

    Router fusion computes top-k in a fused TE kernel that ignores `RouterReplay` (replay silently bypassed);
    TE FP8/FP4 autocast and the TE op fuser would re-quantize or hide the fake-quantized tensors; probabilities on
    the expert input, latent MoE and padding for quantization change what the expert input is.
    """
    errors = []
    if cfg.replay_routes:
        if config.moe_router_fusion:
            errors.append("moe_router_fusion=True bypasses RouterReplay (top-k runs in a fused TE kernel)")
        if not config.moe_enable_routing_replay:
            errors.append("R3 needs moe_enable_routing_replay=True when the model is built")
    if cfg.quantized:
        if config.fp8 or config.fp4:
            errors.append("TE fp8/fp4 autocast re-quantizes the fake-quantized tensors; build without --fp8/--fp4")
        if config.use_transformer_engine_op_fuser:
            errors.append("use_transformer_engine_op_fuser=True fuses away the FC1/FC2 inputs")
        if config.moe_apply_probs_on_input:
            errors.append("moe_apply_probs_on_input=True scales the expert input before FP4 quantization")
        if config.moe_latent_size:
            errors.append("moe_latent_size (latent MoE) projects the expert input after the MoE-input site")
        if config.moe_router_padding_for_quantization:
            errors.append("moe_router_padding_for_quantization adds routed pad rows that have no record")
        if config.gradient_accumulation_fusion:
            errors.append("gradient_accumulation_fusion needs the GEMM weight to be the parameter, not the STE weight")
    if config.cuda_graph_impl != "none":
        errors.append(f"cuda_graph_impl={config.cuda_graph_impl!r}: the sites read per-micro-batch records")
    if config.mlp_chunks_for_training != 1:
        errors.append("mlp_chunks_for_training > 1 reorders MoE rows")
    if config.moe_expert_capacity_factor is not None or config.moe_token_dropping:
        errors.append(
            "moe_expert_capacity_factor / moe_token_dropping drop tokens the rollout routed (no token dropping in R3)"
        )
    if errors:
        raise ValueError("Megatron config incompatible with TRACE: " + "; ".join(errors))
    if config.context_parallel_size > 1:
        raise NotImplementedError("context parallelism: token rows of a CP rank are not mapped yet (use CP = 1)")
    if config.overlap_moe_expert_parallel_comm:
        raise NotImplementedError(
            "overlap_moe_expert_parallel_comm (EP communication overlap) splits the MoE layer across schedule "
            "nodes; the sites are not wired for it"
        )
    if cfg.quantized and config.moe_shared_expert_overlap and config.moe_shared_expert_intermediate_size:
        raise NotImplementedError(
            "moe_shared_expert_overlap runs the shared experts inside the dispatcher, on the FP4 fake-quantized MoE "
            "input; shared experts must see BF16 (turn the overlap off)"
        )
    if cfg.quantized and (config.expert_tensor_parallel_size or 1) > 1:
        raise NotImplementedError("expert tensor parallelism: per-matrix weight scales need the full matrix amax")
