"""Export of the tiny Megatron Qwen3-MoE to HF checkpoint tensors: transformers' Qwen3MoeForCausalLM loads them and
produces the Megatron model's logits; NVFP4 experts decode to exactly the trainer's fake-quantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from megatron_trace.export import export_hf, hf_config, nvfp4_pack, nvfp4_quant_config, nvfp4_unpack
from megatron_trace.rows import pack_microbatch
from megatron_trace.tiny import TinyMoEConfig, build_tiny_moe
from trace_core.guided import rtn_fake_quant

CFG = TinyMoEConfig()


pytestmark = pytest.mark.usefixtures("megatron_rank")


def test_bf16_export_loads_into_transformers_with_the_same_logits(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    model = build_tiny_moe(CFG, dtype=torch.float32, routing_replay=False)
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


def test_nvfp4_experts_decode_to_the_trainer_fake_quant_weights():
    model = build_tiny_moe(CFG, dtype=torch.bfloat16, routing_replay=False)
    tensors = export_hf(model, nvfp4_experts=True)
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
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert nvfp4_quant_config()["quant_algo"] == "NVFP4"


def test_nvfp4_pack_round_trip_and_bad_model():
    w = torch.randn(8, 32)
    t = nvfp4_pack(w)
    assert torch.equal(nvfp4_unpack(t), rtn_fake_quant(w, "nvfp4"))
    model = build_tiny_moe(CFG, routing_replay=False)
    model.config.qk_layernorm = False
    with pytest.raises(ValueError, match="Qwen3-MoE"):
        export_hf(model)
