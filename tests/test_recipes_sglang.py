"""Per precision recipe: SGLang's emulated expert path and the trainer's site code give bit-identical FP4 / FP8
operands to both expert GEMMs, and SGLang's MoE-input records hold the trainer's codes.

The SGLang side is the real patched `FusedMoE` of sglang 0.5.10.post1 (weight loader, `--trace-mode emulate
--trace-recipe NAME`, the MoE-input hook and the CPU expert path with its FC2-input hook), driven as
tests/test_sglang_fc2.py drives it; the trainer side is `megatron_trace.sites.SiteNumerics` under the same recipe.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from tests.sglang_cpu import install_sgl_kernel_stand_in

install_sgl_kernel_stand_in()
pytest.importorskip("sglang.srt.layers.moe.fused_moe_triton.layer", reason="sglang CPU deps: make setup")

from megatron_trace.config import TraceConfig  # noqa: E402
from megatron_trace.sites import SiteNumerics  # noqa: E402
from tests.test_sglang_fc2 import (  # noqa: E402
    LAYER,
    TOPK,
    E,
    GemmInputs,
    checkpoint,
    layer_mod,
    routed_input,
    rows_by_expert,
    sglang_native_tokens,
)
from tests.test_sglang_moe import load  # noqa: E402
from trace_core.recipe import get_recipe, recipe_names  # noqa: E402
from trace_core.records import RecordSpec, pack_low_bits  # noqa: E402
from trace_core.role_quant import quantize_role  # noqa: E402

H = 64


def sglang_run(name: str, store: str) -> tuple[dict, object, torch.Tensor]:
    """FC1 / FC2 GEMM inputs of the patched FusedMoE under recipe `name`, its capturer and its w13 weights."""
    from sglang.srt.distributed.parallel_state import get_moe_tp_group
    from sglang.srt.layers.moe.routed_experts_capturer import set_global_experts_capturer
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sglang_trace import hooks
    from sglang_trace.capturer import TraceCapturer
    from sglang_trace.config import ModelLayout, check_server_args

    # a recipe that does not record the MoE input records K and V only (the FP4 KV pool itself is not built here)
    sites = {"trace_sites": "moe_in"} if get_recipe(name).recorded("moe_in") else {"trace_sites": "k,v"}
    args = ServerArgs(
        model_path="dummy",
        device="cpu",
        trace_mode="emulate",
        trace_recipe=name,
        trace_store=store,
        kv_cache_dtype="fp4_e2m1",
        **sites,
    )
    set_global_server_args_for_scheduler(args)
    layer = layer_mod.FusedMoE(
        num_experts=E, hidden_size=H, intermediate_size=64, layer_id=LAYER, top_k=TOPK, params_dtype=torch.bfloat16
    )
    ckpt = checkpoint()
    load(layer, ckpt, range(E))
    cap = TraceCapturer(
        check_server_args(args),
        ModelLayout("Qwen3MoeForCausalLM", 2, (0, LAYER), (), H, 1, 16, TOPK),
        kv_pool=None,
        max_tokens=16,
        num_slots=32,
        max_request_tokens=16,
        device="cpu",
        return_routes=False,
        weights=hooks.EXPERT_WEIGHTS,
        tp_rank=get_moe_tp_group().rank_in_group,
    )
    set_global_experts_capturer(cap)
    x, ids, weights = routed_input()
    with GemmInputs() as seen:
        layer.forward_impl(x, StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=None))
    w13 = [layer.w13_weight[e] for e in range(E)]
    w2 = [layer.w2_weight[e] for e in range(E)]
    return rows_by_expert(seen.calls, w13, w2, sglang_native_tokens(ids)), cap, layer.w13_weight.detach().clone()


@pytest.mark.parametrize("name", recipe_names())
def test_sglang_emulate_and_trainer_agree_per_recipe(name, tmp_path):
    from sglang.srt.layers.moe.routed_experts_capturer import (
        _RoutedExpertsCapturerNoop,
        set_global_experts_capturer,
    )

    from tests.sglang_cpu import init_cpu_parallel_state

    init_cpu_parallel_state()
    try:
        sglang, cap, w13 = sglang_run(name, str(tmp_path))
    finally:
        set_global_experts_capturer(_RoutedExpertsCapturerNoop())
    recipe = get_recipe(name)
    spec = RecordSpec.of_recipe(name, (LAYER,), (), 4)
    trainer = SiteNumerics(TraceConfig(mode="qat", spec=spec, recipe=name, replay_routes=False))
    x, ids, _ = routed_input()
    ckpt = checkpoint()
    xq = trainer.activation((LAYER, "moe_in"), x, None)
    rows: dict = defaultdict(dict)
    for e in range(E):
        fc1 = trainer.weight(torch.cat([ckpt[f"{e}.gate"], ckpt[f"{e}.up"]]))
        assert torch.equal(fc1, w13[e]), (name, e)  # expert weights: the loader hook = the trainer's site
        tokens = (ids == e).any(dim=1).nonzero().flatten()
        gate, up = F.linear(xq[tokens], fc1).chunk(2, dim=-1)
        h = trainer.fc2_input(F.silu(gate) * up)
        for i, t in enumerate(tokens.tolist()):
            rows[(e, "fc1")][t], rows[(e, "fc2")][t] = xq[t], h[i]
    for key, by_token in rows.items():
        for t, row in by_token.items():
            assert torch.equal(sglang[key][t], row), (name, key, t)
    if recipe.recorded("moe_in"):  # the staged record of the forward's rows: the trainer's codes
        staged = cap.records.staging_rows((LAYER, "moe_in"), x.shape[0])
        q = quantize_role(recipe.moe_in, x)
        assert torch.equal(staged.low_bits, pack_low_bits(q.codes, cap.spec.bits))
        assert torch.equal(staged.scales, q.scales)
        assert (staged.global_scale is None) == (q.global_scale is None)
        if q.global_scale is not None:
            assert torch.equal(staged.global_scale, q.global_scale)
    else:
        assert (LAYER, "moe_in") not in cap.records.layouts


def test_sglang_refuses_what_a_recipe_cannot_trace():
    from sglang.srt.server_args import ServerArgs

    with pytest.raises(ValueError, match="--trace-recipe mxfp4-w4a8-kv4 does not record moe_in"):
        ServerArgs(model_path="dummy", trace_mode="emulate", trace_recipe="mxfp4-w4a8-kv4", trace_store="/r")
    with pytest.raises(ValueError, match="--trace-mode native with --trace-recipe mxfp4-w4a4-kv4: SGLang 0.5.10.post1"):
        ServerArgs(
            model_path="dummy",
            trace_mode="native",
            trace_recipe="mxfp4-w4a4-kv4",
            trace_store="/r",
            trace_sites="moe_in",
            quantization="modelopt_fp4",
            moe_runner_backend="flashinfer_cutlass",
        )
    with pytest.raises(ValueError, match="unknown precision recipe 'mxfp4'"):
        ServerArgs(model_path="dummy", trace_mode="emulate", trace_recipe="mxfp4", trace_store="/r")


def test_sglang_refuses_a_recipe_whose_kv_format_its_pool_does_not_store():
    from sglang.srt.server_args import ServerArgs

    from sglang_trace.config import check_server_args
    from trace_core.formats import MXFP4
    from trace_core.recipe import MXFP4_W4A4_KV4, PrecisionRecipe, Role, Scale

    mx_kv = Role(MXFP4, Scale.PER_BLOCK, recorded=True)
    fields = {f: getattr(MXFP4_W4A4_KV4, f) for f in ("weights", "moe_in", "fc2_in")}
    recipe = PrecisionRecipe(name="mxfp4-w4a4-mxkv4", summary="32-element MXFP4 KV", k=mx_kv, v=mx_kv, **fields)
    sa = ServerArgs(model_path="dummy", trace_mode="emulate", trace_store="/r", kv_cache_dtype="fp4_e2m1")
    sa.trace_recipe = recipe
    with pytest.raises(ValueError, match="quantizes K / V as mxfp4; SGLang's fp4_e2m1 KV pool stores kv_fp4"):
        check_server_args(sa)
