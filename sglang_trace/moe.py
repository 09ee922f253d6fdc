"""The MoE-input site (`moe_in`) and emulated routed-expert weights, under the server's precision recipe.

emulate (Hopper, CPU): the routed experts run BF16 GEMMs on quantize-dequantized operands, so the rollout is
numerically the recipe's W4A4 / W4A8 (`--trace-recipe`, `trace_core.numerics.recipe`). Expert weights are
quantize-dequantized as they are loaded (`ExpertWeights`, called after every FusedMoE weight-loader write, so the
initial load and every `update_weights_from_*` path are covered); the MoE input is quantize-dequantized per token
row under the recipe's `moe_in` role (`trace_core.numerics.role_quant.rollout_rtn`), whose kernel writes the record into
the capturer's staging rows in the same pass (`emulate_moe_input`).

The FC2 input (`act(gate) * up`, before the down projection) is quantize-dequantized in the expert path itself
(`fc2_input`, called between the activation and the second GEMM of SGLang's triton runner and of its CPU path),
under the one convention of `trace_core.numerics.fc2`: per (token, expert) row; for NVFP4 its scale comes from the amax
over the full intermediate width, i.e. the max over the MoE-TP ranks' shards (one all-gather of `[rows]` FP32 amax per
layer); MX formats scale each 32-element block locally and exchange nothing.

native (Blackwell NVFP4 checkpoints): the MoE kernel quantizes the input itself with the layer's static input
scale; `native_moe_input` reproduces its codes with the exact-math quantizer and leaves the input untouched.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from trace_core.kernels import quantize_record
from trace_core.numerics.fc2 import fc2_input_fake_quant, needs_row_amax, row_amax
from trace_core.numerics.formats import FP4Format
from trace_core.numerics.recipe import DEFAULT_RECIPE, Role, get_recipe
from trace_core.numerics.role_quant import rollout_rtn, weight_rtn
from trace_core.records.capture import SiteBuffers

DEFAULT = get_recipe(DEFAULT_RECIPE)

GATE, UP, DOWN = "w1", "w3", "w2"  # FusedMoE weight-loader shard ids


def emulate_moe_input(
    x: torch.Tensor, bits: int, record: SiteBuffers | None, role: Role = DEFAULT.moe_in
) -> torch.Tensor:
    """Quantize-dequantize of the MoE input `[T, H]` under the recipe's `moe_in` role (NVFP4: per-token global
    scale); when `record` is given, its staging rows `[T, ...]` receive the record in the same pass. CUDA-graph
    safe (no host sync)."""
    return rollout_rtn(role, x, bits, record)


def fc2_input(h: torch.Tensor, tp_group=None, role: Role = DEFAULT.fc2_in) -> torch.Tensor:
    """emulate: the FC2 input `[rows, intermediate / tp]` of this MoE-TP rank, quantize-dequantized under
    `trace_core.numerics.fc2`'s convention and the recipe's `fc2_in` role. `tp_group`: SGLang's MoE-TP
    `GroupCoordinator` when the intermediate is sharded (every rank calls this in lockstep, as the forward does); its
    all-gather is SGLang's CUDA-graph-safe one. Block-scaled roles need no exchange."""
    if not needs_row_amax(role):
        return fc2_input_fake_quant(h, role)
    amax = row_amax(h)
    if tp_group is not None and tp_group.world_size > 1:
        amax = tp_group.all_gather(amax, dim=-1).amax(dim=-1, keepdim=True)
    return fc2_input_fake_quant(h, role, amax)


def native_moe_input(
    x: torch.Tensor, bits: int, input_scale: torch.Tensor, record: SiteBuffers, role: Role = DEFAULT.moe_in
) -> None:
    """Record the codes an NVFP4 MoE kernel produces for `x` `[T, H]` under its static global scale `input_scale`
    (`S_enc`, FP32 scalar) and the recipe's `moe_in` format, computed with the exact-math quantizer; `x` is not
    modified. Native mode runs only the NVFP4 recipe (`sglang_trace.config.check_server_args`)."""
    if not isinstance(role.fmt, FP4Format):
        raise ValueError(f"native MoE-input records need an FP4 format, got {role.fmt.name}")
    quantize_record(
        x, role.fmt, bits, global_scale=input_scale, low_bits=record.low_bits, scales=record.scales, token_scale=None
    )
    if record.global_scale is None:
        raise ValueError("native MoE-input records need a global-scale buffer (an NVFP4 site)")
    record.global_scale.copy_(input_scale.float().reshape(1, 1).expand_as(record.global_scale))


@dataclass
class WeightStats:
    """Expert matrices quantize-dequantized so far (gate+up counted once per expert)."""

    w13: int = 0
    w2: int = 0


@dataclass
class ExpertWeights:
    """Quantize-dequantize routed-expert weights under the recipe's `weights` role as the FusedMoE weight loader
    writes them.

    Granularity as the trainer's: blocks along the input dimension; NVFP4 adds one global scale per expert matrix,
    gate and up sharing one (the fused w13), taken from the full checkpoint tensor the loader receives, so every TP
    rank uses the same scale for its shard (MXFP4 blocks need no such scale). w13 of an expert is quantized once
    both its gate and up halves were written since the last quantization (a weight update may send them
    separately); a half waiting for its partner is reported by `pending` and refused by `check_complete`.
    """

    stats: WeightStats = field(default_factory=WeightStats)
    role: Role = DEFAULT.weights
    _halves: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    def on_loaded(self, layer, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str, expert_id: int) -> None:
        """Called after `FusedMoE.weight_loader(param, loaded_weight, name, shard_id, expert_id)` has written."""
        if param is not layer.w13_weight and param is not layer.w2_weight:
            return  # biases and scales are not FP4 sites
        local = layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local < 0:
            return  # another rank's expert
        amax = loaded_weight.detach().abs().amax().float().to(param.device)
        if shard_id == DOWN:
            self._qdq(param.data[local], amax)
            self.stats.w2 += 1
            return
        if shard_id not in (GATE, UP):
            raise ValueError(f"FusedMoE layer {layer.layer_id}: unexpected expert shard id {shard_id!r}")
        halves = self._halves.setdefault(layer, {}).setdefault(local, {})
        halves[shard_id] = amax
        if len(halves) == 2:
            self._qdq(param.data[local], torch.maximum(halves[GATE], halves[UP]))
            del self._halves[layer][local]
            self.stats.w13 += 1

    def _qdq(self, w: torch.Tensor, amax: torch.Tensor) -> None:
        w.copy_(weight_rtn(self.role, w, amax))

    def quantize_resident(self, layers) -> None:
        """Quantize-dequantize the expert matrices the FusedMoE `layers` already hold, each under its own global
        scale (FC1's gate and up as one matrix): what a load through the weight loader gives, for weights no loader
        wrote (`--load-format dummy`). Only for unsharded experts (MoE TP = 1): a shard's amax is not its matrix's."""
        for layer in layers:
            for w13, w2 in zip(layer.w13_weight.data, layer.w2_weight.data, strict=True):
                self._qdq(w13, w13.abs().amax().float())
                self._qdq(w2, w2.abs().amax().float())
                self.stats.w13 += 1
                self.stats.w2 += 1

    def pending(self) -> list[tuple[int, int]]:
        """(layer id, local expert) of w13 matrices with only one of gate/up written since their last quantization."""
        return [(layer.layer_id, e) for layer, experts in self._halves.items() for e in experts]

    def check_complete(self) -> None:
        """Raise RuntimeError if an expert's w13 is half-updated (it would run unquantized)."""
        if self.pending():
            raise RuntimeError(
                f"routed-expert weights half updated (gate or up missing) for (layer, expert) {self.pending()[:8]}; "
                "send gate_proj and up_proj of an expert in the same weight update"
            )
