"""Export of the tiny Megatron Qwen3-MoE to HF checkpoint tensors: transformers' Qwen3MoeForCausalLM loads them and
produces the Megatron model's logits; NVFP4 experts decode to exactly the trainer's fake-quantized weights and carry
the `input_scale` of a calibration, under the names SGLang's Qwen3-MoE loader maps to its ModelOpt NVFP4 MoE
parameters."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_trace.export import (
    calibrate_input_amax,
    export_hf,
    hf_config,
    nvfp4_pack,
    nvfp4_quant_config,
    nvfp4_unpack,
)
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.rows import pack_microbatch
from trace_core.numerics.guided import rtn_fake_quant
from trace_core.numerics.quant import nvfp4_global_scale

CFG = MoEModelConfig()


pytestmark = pytest.mark.usefixtures("megatron_rank")


def test_bf16_export_loads_into_transformers_with_the_same_logits(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    model = build_moe_model(CFG, dtype=torch.float32, routing_replay=False)
    tensors = export_hf(model, dtype=torch.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    config = hf_config(model, rope_theta=CFG.rope_theta, max_position_embeddings=CFG.max_seq)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf, info = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert tuple(hf.model.layers[0].mlp.experts.gate_up_proj.shape) == (CFG.experts, 2 * CFG.expert_ffn, CFG.hidden)

    g = torch.Generator().manual_seed(0)
    mb = pack_microbatch([(0, torch.randint(0, CFG.vocab, (20,), generator=g)), (1, torch.randint(0, 128, (20,)))])
    with torch.no_grad():
        ours = model(mb.input_ids, mb.position_ids, mb.attention_mask)
        theirs = hf(input_ids=mb.input_ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_export_on_a_device_holds_the_cpu_exports_tensors_there(device):
    """`export_hf(device=...)`: the trainer's GPU for a colocated server's CUDA IPC sync; on CPU machines the meta
    device stands in for it (a device other than the parameters'): the same names, shapes and dtypes, each tensor
    on that device (values on the CPU: bit for bit)."""
    model = build_moe_model(CFG, dtype=torch.float32, routing_replay=False)
    want = export_hf(model)
    got = export_hf(model, device=device)
    assert list(got) == list(want)
    for name, t in got.items():
        assert t.device.type == device and t.shape == want[name].shape and t.dtype == want[name].dtype, name
        if device == "cpu":
            assert torch.equal(t, want[name]), name


def _calibrated(model) -> tuple[dict[str, float], dict[int, float]]:
    """`calibrate_input_amax` over one micro-batch, and each layer's MoE-input amax seen independently (the output
    of the pre-MLP norm, which the router dispatches unscaled to the experts' FC1)."""
    g = torch.Generator().manual_seed(1)
    mb = pack_microbatch([(i, torch.randint(0, CFG.vocab, (24,), generator=g)) for i in range(4)])
    norm_amax: dict[int, float] = {}
    hooks = [
        layer.pre_mlp_layernorm.register_forward_hook(
            lambda m, a, out, i=layer.layer_number - 1: norm_amax.__setitem__(i, float(out.abs().amax()))
        )
        for layer in model.decoder.layers
    ]
    with torch.no_grad():
        amax = calibrate_input_amax([model], lambda: model(mb.input_ids, mb.position_ids, mb.attention_mask))
    for h in hooks:
        h.remove()
    return amax, norm_amax


def test_nvfp4_experts_decode_to_the_trainer_fake_quant_weights():
    model = build_moe_model(CFG, dtype=torch.bfloat16, routing_replay=False)
    amax, norm_amax = _calibrated(model)
    tensors = export_hf(model, nvfp4_experts=True, input_amax=amax)
    for layer in model.decoder.layers:
        for e, expert in enumerate(layer.mlp.experts.local_experts):
            p = f"model.layers.{layer.layer_number - 1}.mlp.experts.{e}"
            fc1 = rtn_fake_quant(expert.linear_fc1.weight.detach().float(), "nvfp4")
            fc2 = rtn_fake_quant(expert.linear_fc2.weight.detach().float(), "nvfp4")
            parts = {
                n: {k: tensors[f"{p}.{n}.{k}"] for k in ("weight", "weight_scale", "weight_scale_2")}
                for n in ("gate_proj", "up_proj", "down_proj")
            }
            assert parts["gate_proj"]["weight"].dtype == torch.uint8
            assert tuple(parts["gate_proj"]["weight"].shape) == (CFG.expert_ffn, CFG.hidden // 2)
            assert parts["down_proj"]["weight_scale"].dtype == torch.float8_e4m3fn
            assert torch.equal(parts["gate_proj"]["weight_scale_2"], parts["up_proj"]["weight_scale_2"])
            decoded = torch.cat([nvfp4_unpack(parts["gate_proj"]), nvfp4_unpack(parts["up_proj"])])
            assert torch.equal(decoded, fc1)
            assert torch.equal(nvfp4_unpack(parts["down_proj"]), fc2)
            for n in ("gate_proj", "up_proj", "down_proj"):  # ModelOpt's static activation decode scale, FP32 scalar
                scale = tensors[f"{p}.{n}.input_scale"]
                assert scale.dtype == torch.float32 and scale.shape == ()
                assert torch.equal(scale, 1.0 / nvfp4_global_scale(torch.tensor(amax[f"{p}.{n}"])))
            assert torch.equal(tensors[f"{p}.gate_proj.input_scale"], tensors[f"{p}.up_proj.input_scale"])
    for layer, seen in norm_amax.items():  # every token reaches top-k experts: the largest FC1 input is the layer's
        fc1 = [amax[f"model.layers.{layer}.mlp.experts.{e}.gate_proj"] for e in range(CFG.experts)]
        assert max(fc1) == seen and min(fc1) > 0
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert nvfp4_quant_config()["quant_algo"] == "NVFP4"


def test_nvfp4_export_names_map_to_sglang_modelopt_moe_parameters():
    """Every exported routed-expert tensor name goes, through SGLang's own Qwen3-MoE expert mapping
    (`FusedMoE.make_expert_params_mapping`, as `Qwen3MoeForCausalLM.load_weights` applies it), to a parameter that
    SGLang's `ModelOptNvFp4FusedMoEMethod.create_weights` registers, and every such parameter gets a tensor. (The
    method itself cannot be built on a CPU: its weight setup moves block scales to CUDA.)"""
    import inspect
    import re

    from tests.sglang_cpu import install_sgl_kernel_stand_in

    install_sgl_kernel_stand_in()
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod

    registered = set(re.findall(r'register_parameter\(\s*"(\w+)"', inspect.getsource(ModelOptNvFp4FusedMoEMethod)))
    mapping = FusedMoE.make_expert_params_mapping(
        ckpt_gate_proj_name="gate_proj",
        ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj",
        num_experts=CFG.experts,
    )
    model = build_moe_model(CFG, dtype=torch.bfloat16, routing_replay=False)
    tensors = export_hf(model, nvfp4_experts=True, input_amax=_calibrated(model)[0])
    loaded = set()
    for name in (n for n in tensors if ".mlp.experts." in n):
        hits = [(param, w) for param, w, _, _ in mapping if w in name]
        assert len(hits) == 1, name
        param = name.replace(hits[0][1], hits[0][0]).split(".mlp.")[1]  # e.g. experts.w13_input_scale
        assert param.removeprefix("experts.") in registered, name
        loaded.add(param.removeprefix("experts."))
    # not checkpoint tensors: the swizzled block scales are built at load; SGLang 0.5.15 registers `*_weight_scale_inv`
    # only for online NVFP4 from an FP8 checkpoint (its loader consumes them)
    derived = {"w13_blockscale_swizzled", "w2_blockscale_swizzled", "w13_weight_scale_inv", "w2_weight_scale_inv"}
    assert loaded == registered - derived, registered - loaded


def test_nvfp4_export_refuses_an_uncalibrated_expert():
    model = build_moe_model(CFG, dtype=torch.bfloat16, routing_replay=False)
    amax = _calibrated(model)[0]
    del amax["model.layers.1.mlp.experts.3.down_proj"]
    with pytest.raises(ValueError, match=r"1 of 24 have none, first \['model.layers.1.mlp.experts.3.down_proj'\]"):
        export_hf(model, nvfp4_experts=True, input_amax=amax)


def test_nvfp4_pack_round_trip_and_bad_model():
    w = torch.randn(8, 32)
    t = nvfp4_pack(w)
    assert torch.equal(nvfp4_unpack(t), rtn_fake_quant(w, "nvfp4"))
    model = build_moe_model(CFG, routing_replay=False)
    model.config.qk_layernorm = False
    with pytest.raises(ValueError, match="Qwen3-MoE"):
        export_hf(model)
