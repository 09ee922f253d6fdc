"""Precision recipes: what every quantized tensor role of a routed-expert MoE model is rounded to.

A recipe names, for each role (routed-expert weights, MoE input, FC2 input, K, V), its format, the granularity of
its scale, and whether the rollout records it so the trainer can guide it. It is the one definition every side
reads: the record spec (`RecordSpec.recipe`), the trainer (`megatron_trace.config.TraceConfig.recipe`), the SGLang
server (`--trace-recipe`), the embedded engine and the RL config (`recipe`). The sites quantize through
`trace_core.numerics.role_quant` with a role of the recipe and never name a format themselves, so a recipe that combines
existing formats and scale granularities is added here alone (docs/design.md, "Precision recipes").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from trace_core.numerics.formats import KV_FP4, MXFP4, NVFP4, FP4Format, ScaleKind
from trace_core.numerics.mxfp8 import MXFP8, FP8Format


class Scale(enum.Enum):
    """Granularity of the FP32 scale above the block scales.

    STATIC is one FP32 global scale fixed before any data is seen, S_enc = 1: a KV pool cannot rescale the tokens it
    already holds (SGLang's `NVFP4KVMethod` without checkpoint `k_scale` / `v_scale`)."""

    PER_TENSOR = "per_tensor"  # one S_enc per tensor: an expert matrix (gate and up as one FC1 matrix)
    PER_TOKEN = "per_token"  # one S_enc per row: a token, or a (token, expert) pair at the FC2 input
    PER_BLOCK = "per_block"  # none: the E8M0 block scales alone (MX formats, the FP4 KV cache)
    STATIC = "static"  # one S_enc = 1 fixed before any data: the NVFP4 KV pool


@dataclass(frozen=True)
class Role:
    """How one tensor role is quantized.

    Attributes:
        fmt: FP4 format, or the FP8 format of W4A8 activations.
        scale: granularity of the scale above the block scales.
        recorded: the rollout may record this role's codes and the trainer guide it; otherwise both sides round
            to nearest (and must be bit-identical).
    """

    fmt: FP4Format | FP8Format
    scale: Scale
    recorded: bool = False

    def __post_init__(self) -> None:
        # per tensor, per token and static scales sit above the blocks: formats with a global scale only
        block_only = self.fmt.scale is ScaleKind.E8M0
        if block_only != (self.scale is Scale.PER_BLOCK):
            kind = "only E8M0 block scales" if block_only else "a global scale above its blocks"
            raise ValueError(f"{self.fmt.name} has {kind}; got scale {self.scale.value}")
        if self.recorded and not isinstance(self.fmt, FP4Format):
            raise ValueError(f"{self.fmt.name} is not an FP4 format; records hold FP4 codes only")


ROLES = ("weights", "moe_in", "fc2_in", "k", "v")
"""The roles of a recipe: expert weights, the three activation site kinds of records and the FC2 input."""


@dataclass(frozen=True)
class PrecisionRecipe:
    """Formats, scale granularities and recording of every role; looked up by `name` (`get_recipe`)."""

    name: str
    summary: str
    weights: Role
    moe_in: Role
    fc2_in: Role
    k: Role
    v: Role

    def __post_init__(self) -> None:
        for name in ("weights", "fc2_in"):
            if getattr(self, name).recorded:
                raise ValueError(f"recipe {self.name}: {name} have no record site")
        if self.k != self.v:
            raise ValueError(f"recipe {self.name}: K and V share the KV pool's format (one RecordSpec.kv_format)")

    def role(self, name: str) -> Role:
        """The role `name` (one of `ROLES`); ValueError for any other name."""
        if name not in ROLES:
            raise ValueError(f"unknown role {name!r}; roles: {ROLES}")
        return getattr(self, name)

    def recorded(self, kind: str) -> bool:
        """Whether site kind `kind` (moe_in, k, v) can be recorded under this recipe."""
        return self.role(kind).recorded


NVFP4_W4A4_KV4 = PrecisionRecipe(
    name="nvfp4-w4a4-kv4",
    summary="NVFP4 expert weights and MoE / FC2 inputs, FP4 KV cache; MoE input, K and V recorded",
    weights=Role(NVFP4, Scale.PER_TENSOR),
    moe_in=Role(NVFP4, Scale.PER_TOKEN, recorded=True),
    fc2_in=Role(NVFP4, Scale.PER_TOKEN),
    k=Role(KV_FP4, Scale.PER_BLOCK, recorded=True),
    v=Role(KV_FP4, Scale.PER_BLOCK, recorded=True),
)
MXFP4_W4A4_KV4 = PrecisionRecipe(
    name="mxfp4-w4a4-kv4",
    summary="MXFP4 expert weights and MoE / FC2 inputs, FP4 KV cache; MoE input, K and V recorded",
    weights=Role(MXFP4, Scale.PER_BLOCK),
    moe_in=Role(MXFP4, Scale.PER_BLOCK, recorded=True),
    fc2_in=Role(MXFP4, Scale.PER_BLOCK),
    k=Role(KV_FP4, Scale.PER_BLOCK, recorded=True),
    v=Role(KV_FP4, Scale.PER_BLOCK, recorded=True),
)
MXFP4_W4A8_KV4 = PrecisionRecipe(
    name="mxfp4-w4a8-kv4",
    summary="MXFP4 expert weights, MXFP8 (FP8 E4M3) MoE / FC2 inputs (not recorded), FP4 KV cache; K and V recorded",
    weights=Role(MXFP4, Scale.PER_BLOCK),
    moe_in=Role(MXFP8, Scale.PER_BLOCK),
    fc2_in=Role(MXFP8, Scale.PER_BLOCK),
    k=Role(KV_FP4, Scale.PER_BLOCK, recorded=True),
    v=Role(KV_FP4, Scale.PER_BLOCK, recorded=True),
)
NVFP4_W4A4_NVFP4KV = PrecisionRecipe(
    name="nvfp4-w4a4-nvfp4kv",
    summary="NVFP4 expert weights, MoE / FC2 inputs and KV cache (static unit global scale); MoE input, K and V "
    "recorded",
    weights=NVFP4_W4A4_KV4.weights,
    moe_in=NVFP4_W4A4_KV4.moe_in,
    fc2_in=NVFP4_W4A4_KV4.fc2_in,
    k=Role(NVFP4, Scale.STATIC, recorded=True),
    v=Role(NVFP4, Scale.STATIC, recorded=True),
)

DEFAULT_RECIPE = NVFP4_W4A4_KV4.name
_RECIPES = {r.name: r for r in (NVFP4_W4A4_KV4, MXFP4_W4A4_KV4, MXFP4_W4A8_KV4, NVFP4_W4A4_NVFP4KV)}


def get_recipe(name: str | PrecisionRecipe) -> PrecisionRecipe:
    """The recipe registered under `name` (a recipe is returned unchanged); ValueError naming the known ones."""
    if isinstance(name, PrecisionRecipe):
        return name
    try:
        return _RECIPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown precision recipe {name!r}; known recipes: {list(_RECIPES)}") from None


def recipe_names() -> tuple[str, ...]:
    """Names of all shipped recipes."""
    return tuple(_RECIPES)
