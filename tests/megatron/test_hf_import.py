"""HF Qwen3-MoE checkpoint → Megatron: the round trip HF → Megatron → HF (`export_hf`) is bit-identical in BF16, the
imported model computes transformers' logits, transformers' fused expert layout imports the same, unsupported
configs are refused by name, and TP = 2 / EP = 2 / PP = 2 ranks (torchrun, gloo) each get their shard."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_trace.cpu import init_single_rank
from megatron_trace.export import export_hf
from megatron_trace.hf_import import HFCheckpoint, UnsupportedCheckpoint, megatron_state, model_dims
from megatron_trace.model import build_moe_model
from megatron_trace.rows import pack_microbatch
from tests.hf_tiny import make_hf_checkpoint


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf"))


def _import(path: Path, dtype: torch.dtype = torch.bfloat16):
    init_single_rank()
    ckpt = HFCheckpoint(path)
    model = build_moe_model(ckpt.dims, dtype=dtype, routing_replay=False)
    missing, unexpected = model.load_state_dict(megatron_state(ckpt), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    return model.to(dtype)


def test_round_trip_hf_megatron_hf_is_bit_identical_in_bf16(ckpt_dir):
    exported = export_hf(_import(ckpt_dir))
    with safe_open(ckpt_dir / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(exported)
        for name in f.keys():
            original = f.get_tensor(name)
            assert original.dtype == torch.bfloat16
            assert torch.equal(exported[name], original), name


def test_imported_model_computes_the_transformers_logits(ckpt_dir):
    from transformers import Qwen3MoeForCausalLM

    model = _import(ckpt_dir, torch.float32)
    hf = Qwen3MoeForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32)
    ids = torch.randint(0, 98, (2, 24), generator=torch.Generator().manual_seed(0))
    mb = pack_microbatch(list(enumerate(ids)))
    with torch.no_grad():
        ours = model(mb.input_ids, mb.position_ids, mb.attention_mask)
        theirs = hf(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_fused_expert_layout_and_sharded_index_import_the_same(ckpt_dir, tmp_path):
    """transformers' in-memory layout (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) split over two files
    with a `model.safetensors.index.json`."""
    with safe_open(ckpt_dir / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fused: dict[str, torch.Tensor] = {}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{p}.{e}.{x}_proj.weight") for x in ("gate", "up")]) for e in range(4)]
        fused[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(4)])
    save_file(tensors, tmp_path / "a.safetensors")
    save_file(fused, tmp_path / "b.safetensors")
    weight_map = dict.fromkeys(tensors, "a.safetensors") | dict.fromkeys(fused, "b.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((ckpt_dir / "config.json").read_text())
    ours = megatron_state(HFCheckpoint(tmp_path))
    want = megatron_state(HFCheckpoint(ckpt_dir))
    assert set(ours) == set(want)
    assert all(torch.equal(ours[k], want[k]) for k in want)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "qwen3_next"}, "Qwen3-Next / Qwen3.5 hybrid"),
        ({"model_type": "qwen3_5_moe"}, "Qwen3-Next / Qwen3.5 hybrid"),
        ({"model_type": "llama"}, "only qwen3_moe"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings"),
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope scaling"),
    ],
)
def test_unsupported_configs_are_refused_by_name(ckpt_dir, tmp_path, change, match):
    config = json.loads((ckpt_dir / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedCheckpoint, match=match):
        HFCheckpoint(tmp_path)


QWEN3_30B_A3B = {  # config.json of Qwen/Qwen3-30B-A3B as published
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_qwen3_30b_a3b_config_maps_to_the_trainer_dims():
    d = model_dims(QWEN3_30B_A3B)
    assert (d.layers, d.hidden, d.heads, d.kv_heads, d.head_dim) == (48, 2048, 32, 4, 128)
    assert (d.experts, d.topk, d.expert_ffn, d.vocab, d.rope_theta) == (128, 8, 768, 151936, 1e6)
    with pytest.raises(UnsupportedCheckpoint, match="hybrid"):
        model_dims(QWEN3_30B_A3B | {"layer_types": ["linear_attention", "full_attention"] * 24})


def _worker(ckpt_dir: str, out: str) -> None:
    """On each of 2 ranks: TP = 2, then EP = 2, then PP = 2 (`megatron_trace.parallel`'s shard rules: experts are
    not TP-split); local parameters must equal the rank's block of the single-rank import (which the tests above tie
    to the checkpoint), and with TP / EP the logits the single rank's."""
    from megatron.core import parallel_state as ps

    from megatron_trace.cpu import init_megatron
    from megatron_trace.hf_import import load_hf_into

    init_megatron()
    rank = torch.distributed.get_rank()
    ckpt = HFCheckpoint(ckpt_dir)
    full = torch.load(Path(out) / "full.pt", weights_only=True)
    ids = torch.randint(0, 98, (2, 24), generator=torch.Generator().manual_seed(0))
    mb = pack_microbatch(list(enumerate(ids)))
    for layout in ({"tp": 2}, {"ep": 2}, {"pp": 2}):
        tp, pp, ep = layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
        kw = {
            "tensor_model_parallel_size": tp,
            "expert_model_parallel_size": ep,
            "pipeline_model_parallel_size": pp,
            "expert_tensor_parallel_size": 1,
        }
        model = build_moe_model(ckpt.dims, dtype=torch.float32, routing_replay=False, **kw)
        load_hf_into(model, ckpt)
        locals_ = dict(model.named_parameters())
        if "ep" in layout:
            assert len(model.decoder.layers[0].mlp.experts.local_experts) == 2
            want = full["decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight"] if rank else None
            if rank:
                got = locals_["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
                assert torch.equal(got, want.float())
        if "tp" in layout:
            qkv = locals_["decoder.layers.1.self_attention.linear_qkv.weight"]
            assert torch.equal(qkv, full["decoder.layers.1.self_attention.linear_qkv.weight"].float().chunk(2)[rank])
        if "pp" in layout:
            assert model.decoder.layers[0].layer_number == rank + 1
            got = locals_["decoder.layers.0.self_attention.linear_proj.weight"]
            assert torch.equal(got, full[f"decoder.layers.{rank}.self_attention.linear_proj.weight"].float())
            continue
        with torch.no_grad():  # eval: Megatron refuses MoE + TP without sequence parallelism in training
            logits = model.eval()(mb.input_ids, mb.position_ids, mb.attention_mask)
        torch.save(logits, Path(out) / f"{next(iter(layout))}_rank{rank}.pt")
    print(f"rank {rank} ok", flush=True)
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_tp_ep_pp_shards_with_torchrun_on_cpu(ckpt_dir, tmp_path):
    model = _import(ckpt_dir, torch.float32)
    torch.save({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}, tmp_path / "full.pt")
    ids = torch.randint(0, 98, (2, 24), generator=torch.Generator().manual_seed(0))
    mb = pack_microbatch(list(enumerate(ids)))
    with torch.no_grad():
        want = model(mb.input_ids, mb.position_ids, mb.attention_mask)
    root = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}", __file__]
    cmd += [str(ckpt_dir), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout
    for rank in range(2):
        tp = torch.load(tmp_path / f"tp_rank{rank}.pt")  # vocab-parallel logits: this rank's half of the vocabulary
        torch.testing.assert_close(tp, want.chunk(2, dim=-1)[rank], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.load(tmp_path / f"ep_rank{rank}.pt"), want, rtol=1e-4, atol=1e-4)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
