"""Per precision recipe: SGLang's emulated expert path and the trainer's site code give bit-identical FP4 / FP8
operands to both expert GEMMs, and SGLang's MoE-input records hold the trainer's codes.

The SGLang side is the real `FusedMoE` of sglang 0.5.15.post1 with TRACE's plugin hooks (weight loader,
`--trace-mode emulate --trace-recipe NAME`, the MoE-input hook and the CPU expert path with its FC2-input hook),
driven as tests/sglang/test_sglang_fc2.py drives it; the trainer side is `megatron_trace.sites.SiteNumerics` under the
same recipe.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from tests.sglang_cpu import load_trace_plugin

load_trace_plugin()

from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer  # noqa: E402

from megatron_trace.config import TraceConfig  # noqa: E402
from megatron_trace.sites import SiteNumerics  # noqa: E402
from tests.sglang.test_sglang_fc2 import LAYER, E, checkpoint, installed_layer, routed_input, run_sglang  # noqa: E402
from tests.sglang_cpu import trace_server_args  # noqa: E402
from trace_core.numerics.recipe import get_recipe, recipe_names  # noqa: E402
from trace_core.numerics.role_quant import quantize_role  # noqa: E402
from trace_core.records.spec import RecordSpec, pack_low_bits  # noqa: E402


@pytest.mark.parametrize("name", recipe_names())
def test_sglang_emulate_and_trainer_agree_per_recipe(name, tmp_path):
    # a recipe that does not record the MoE input records K and V only (the FP4 KV pool itself is not built here)
    sites = "moe_in" if get_recipe(name).recorded("moe_in") else "k,v"
    server_args = dict(attention_layers=(), trace_recipe=name, kv_cache_dtype="fp4_e2m1", trace_sites=sites)
    with installed_layer(str(tmp_path), **server_args) as layer:
        sglang, _ = run_sglang(layer)
        cap, w13 = get_global_experts_capturer(), layer.w13_weight.detach().clone()
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
    with pytest.raises(ValueError, match="--trace-recipe mxfp4-w4a8-kv4 does not record moe_in"):
        trace_server_args("/r", trace_recipe="mxfp4-w4a8-kv4")
    with pytest.raises(ValueError, match="--trace-mode native with --trace-recipe mxfp4-w4a4-kv4: SGLang 0.5.15.post1"):
        trace_server_args(
            "/r",
            trace_mode="native",
            trace_recipe="mxfp4-w4a4-kv4",
            trace_sites="moe_in",
            quantization="modelopt_fp4",
            moe_runner_backend="flashinfer_cutlass",
        )
    with pytest.raises(ValueError, match="unknown precision recipe 'mxfp4'"):
        trace_server_args("/r", trace_recipe="mxfp4")


@pytest.mark.parametrize("kv", ["mxfp4", "nvfp4-per-token"])
def test_sglang_refuses_a_recipe_whose_kv_format_its_pool_does_not_store(kv):
    from sglang_trace.config import check_server_args
    from trace_core.numerics.formats import MXFP4, NVFP4
    from trace_core.numerics.recipe import MXFP4_W4A4_KV4, PrecisionRecipe, Role, Scale

    role = Role(MXFP4, Scale.PER_BLOCK, recorded=True) if kv == "mxfp4" else Role(NVFP4, Scale.PER_TOKEN, True)
    fields = {f: getattr(MXFP4_W4A4_KV4, f) for f in ("weights", "moe_in", "fc2_in")}
    recipe = PrecisionRecipe(name=f"w4a4-{kv}-kv", summary="a KV format the pool cannot hold", k=role, v=role, **fields)
    sa = trace_server_args("/r", kv_cache_dtype="fp4_e2m1")
    sa.trace_recipe = recipe
    with pytest.raises(ValueError, match=f"quantizes K / V as {role.fmt.name} \\({role.scale.value} scale\\); the "
                       "fp4_e2m1 KV pool holds kv_fp4 or NVFP4 with a static unit global scale"):  # fmt: skip
        check_server_args(sa)
