"""HF Qwen3-MoE checkpoint (safetensors) → Megatron GPTModel (Qwen3-MoE layout, local spec), the inverse of
`megatron_trace.export`, unsharded or sharded for the calling rank's TP / EP / PP position.

`HFCheckpoint` reads `config.json` and the safetensors files (one file or a `model.safetensors.index.json` shard
set) lazily, one tensor at a time. `model_dims` turns the config into the trainer's `MoEModelConfig` and refuses, by
name, every setting the trainer's Megatron spec does not build (Qwen3-Next / Qwen3.5 hybrid attention, dense MLP
layers, shared experts, tied embeddings, biases, RoPE scaling, sliding windows, `norm_topk_prob = false`).

Megatron names and layouts (what `export_hf` reads back): the fused QKV rows are grouped per KV head
`[q heads of the group, k, v] × groups`; expert FC1 is `[gate; up]`. `load_hf_into` gives each rank of a TP / EP /
PP layout its shard by the rules of `megatron_trace.parallel` (`load_full_state`), reading only the tensors it needs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from megatron_trace.model import MoEModelConfig

HYBRID_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text")
HYBRID_KEYS = ("layer_types", "full_attention_interval", "linear_num_value_heads")  # linear-attention layer configs
LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight")


class UnsupportedCheckpoint(ValueError):
    """The HF checkpoint is not a Qwen3-MoE layout the trainer's Megatron spec builds."""


def model_dims(config: dict) -> MoEModelConfig:
    """The trainer's model dimensions of an HF Qwen3-MoE `config.json`; refuses unsupported settings by name."""
    kind = config.get("model_type")
    if kind in HYBRID_TYPES or any(k in config for k in HYBRID_KEYS):
        raise UnsupportedCheckpoint(
            f"model_type={kind!r}: the Qwen3-Next / Qwen3.5 hybrid (Gated DeltaNet linear-attention layers, gated "
            "attention, shared experts) is not supported; the trainer builds Qwen3-MoE (full attention) only"
        )
    if kind != "qwen3_moe":
        raise UnsupportedCheckpoint(f"model_type={kind!r}: only qwen3_moe (Qwen3MoeForCausalLM) checkpoints import")
    errors = []
    checks = {
        "mlp_only_layers": ([], "dense MLP layers"),
        "decoder_sparse_step": (1, "MoE in every layer"),
        "tie_word_embeddings": (False, "untied embeddings"),
        "attention_bias": (False, "no attention biases"),
        "norm_topk_prob": (True, "top-k probabilities renormalised"),
        "hidden_act": ("silu", "SwiGLU experts"),
        "use_sliding_window": (False, "full attention"),
    }
    for key, (want, what) in checks.items():
        if key in config and config[key] != want:
            errors.append(f"{key}={config[key]!r} (the trainer needs {want!r}: {what})")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        errors.append(f"rope scaling {rope!r} (the trainer builds plain RoPE)")
    if config.get("shared_expert_intermediate_size"):
        errors.append("shared_expert_intermediate_size (Qwen3-MoE has no shared experts)")
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts is None:
        errors.append("no num_experts (nor num_local_experts): not an MoE config")
    if errors or experts is None:
        raise UnsupportedCheckpoint("unsupported Qwen3-MoE config: " + "; ".join(errors))
    heads = config["num_attention_heads"]
    return MoEModelConfig(
        vocab=config["vocab_size"],
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        experts=experts,
        topk=config["num_experts_per_tok"],
        expert_ffn=config["moe_intermediate_size"],
        max_seq=config["max_position_embeddings"],
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        norm_eps=config["rms_norm_eps"],
    )


class HFCheckpoint:
    """An HF checkpoint directory: `config.json` and its safetensors, read one tensor at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "config.json").exists():
            raise FileNotFoundError(f"{self.path} holds no config.json (not an HF checkpoint directory)")
        self.config = json.loads((self.path / "config.json").read_text())
        self.dims = model_dims(self.config)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").exists():
            with safe_open(self.path / "model.safetensors", "pt") as f:
                weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{self.path} holds neither model.safetensors nor model.safetensors.index.json")
        self.files = weight_map
        self._open: dict[str, safe_open] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        if name not in self.files:
            raise KeyError(f"{self.path}: checkpoint has no tensor {name}")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(self.path / file, "pt")
        return self._open[file].get_tensor(name)

    def expert(self, layer: int, e: int, proj: str) -> torch.Tensor:
        """Expert `e`'s `gate_proj` / `up_proj` / `down_proj` `[out, in]`: per-expert checkpoint names, or
        transformers' fused `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`."""
        p = f"model.layers.{layer}.mlp.experts"
        if f"{p}.{e}.{proj}.weight" in self:
            return self.get(f"{p}.{e}.{proj}.weight")
        if proj == "down_proj":
            return self.get(f"{p}.down_proj")[e]
        return self.get(f"{p}.gate_up_proj")[e].chunk(2)[0 if proj == "gate_proj" else 1]


def megatron_tensor(ckpt: HFCheckpoint, name: str) -> torch.Tensor:
    """The full (unsharded) Megatron tensor `name` (global layer and expert numbers) from the checkpoint."""
    d = ckpt.dims
    top = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    if name in top:
        return ckpt.get(top[name])
    m = LAYER.fullmatch(name)
    if m is None:
        raise KeyError(f"no HF tensor for Megatron parameter {name}")
    i, rest = int(m[1]), m[2]
    p = f"model.layers.{i}"
    direct = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "mlp.router.weight": "mlp.gate.weight",
    }
    if rest in direct:
        return ckpt.get(f"{p}.{direct[rest]}")
    if rest == "self_attention.linear_qkv.weight":
        q, k, v = (ckpt.get(f"{p}.self_attn.{x}_proj.weight") for x in "qkv")
        per_group = d.heads // d.kv_heads
        qkv = torch.cat(
            [
                q.view(d.kv_heads, per_group * d.head_dim, -1),
                k.view(d.kv_heads, d.head_dim, -1),
                v.view(d.kv_heads, d.head_dim, -1),
            ],
            dim=1,
        )
        return qkv.reshape((d.heads + 2 * d.kv_heads) * d.head_dim, -1)
    e = EXPERT.fullmatch(rest)
    if e is not None:
        expert = int(e[1])
        if e[2] == "linear_fc2":
            return ckpt.expert(i, expert, "down_proj")
        return torch.cat([ckpt.expert(i, expert, "gate_proj"), ckpt.expert(i, expert, "up_proj")])
    raise KeyError(f"no HF tensor for Megatron parameter {name}")


def megatron_names(d: MoEModelConfig) -> list[str]:
    """Parameter names of the single-rank Megatron model of dims `d`."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    per_layer = [
        "input_layernorm.weight",
        "pre_mlp_layernorm.weight",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_proj.weight",
        "self_attention.q_layernorm.weight",
        "self_attention.k_layernorm.weight",
        "mlp.router.weight",
    ]
    per_layer += [f"mlp.experts.local_experts.{e}.linear_fc{j}.weight" for e in range(d.experts) for j in (1, 2)]
    return names + [f"decoder.layers.{i}.{n}" for i in range(d.layers) for n in per_layer]


def megatron_state(ckpt: HFCheckpoint) -> dict[str, torch.Tensor]:
    """The full single-rank Megatron state dict (TP = EP = PP = 1) of the checkpoint, in its stored dtype."""
    names = megatron_names(ckpt.dims)
    return {n: megatron_tensor(ckpt, n) for n in tqdm(names, desc=f"import {ckpt.path.name}", unit="tensor")}


class LazyMegatronState(Mapping[str, torch.Tensor]):
    """The full single-rank Megatron state of a checkpoint as a mapping that reads each tensor when asked for it,
    so a rank of a parallel layout reads only what it loads."""

    def __init__(self, ckpt: HFCheckpoint):
        self.ckpt = ckpt
        self.names = megatron_names(ckpt.dims)

    def __getitem__(self, name: str) -> torch.Tensor:
        return megatron_tensor(self.ckpt, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, ckpt: HFCheckpoint) -> None:
    """Copy the checkpoint into `model` (one chunk): this rank's shard of every parameter, by the shard rules of
    `megatron_trace.parallel` (`load_full_state`) under Megatron's parallel state."""
    from megatron_trace.parallel import load_full_state, unwrap

    c, d = unwrap(model).config, ckpt.dims
    built = (c.num_layers, c.hidden_size, c.num_moe_experts, c.moe_router_topk, c.moe_ffn_hidden_size)
    if built != (d.layers, d.hidden, d.experts, d.topk, d.expert_ffn):
        raise ValueError(f"model (layers, hidden, experts, topk, ffn) {built} is not the checkpoint's dims {d}")
    load_full_state(model, LazyMegatronState(ckpt))
