"""The policy a run starts from: the tiny addition model of `trace_rl.warmup` (a directory with `megatron.pt`), or
an HF Qwen3-MoE checkpoint directory (`config.json`, safetensors, tokenizer), imported by
`megatron_trace.hf_import`. Both give the trainer its dims and Megatron state, and the rollout engines the HF
directory they load, the tokenizer and the EOS ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_trace.hf_import import HFCheckpoint, megatron_state
from megatron_trace.model import MoEModelConfig
from trace_rl.data import AdditionTokenizer
from trace_rl.task import EOS
from trace_rl.warmup import HF_DIR, MEGATRON_STATE, load_megatron_state


@dataclass(frozen=True)
class RolloutTask:
    """What a rollout worker needs besides the config: the HF checkpoint it loads (absolute path), the longest
    sequence it serves (prompt + new tokens) and the token ids that end a response."""

    hf_dir: str
    max_len: int
    eos: tuple[int, ...]


@dataclass(frozen=True)
class Policy:
    dims: MoEModelConfig
    state: dict[str, torch.Tensor]
    hf_dir: Path
    tokenizer: Any  # AdditionTokenizer or a transformers tokenizer (`decode`, `eos_token_id`)
    eos: tuple[int, ...]
    digits: int | None  # the addition model's operand digits; None for an HF checkpoint


def _eos_ids(path: Path, tokenizer) -> tuple[int, ...]:
    """`generation_config.json`'s `eos_token_id` (an id or a list), else the tokenizer's EOS."""
    ids: list[int] = []
    gen = path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    if not ids:
        raise ValueError(f"{path}: neither generation_config.json nor the tokenizer names an EOS token")
    return tuple(ids)


def load_policy(model_dir: str | Path) -> Policy:
    path = Path(model_dir)
    if (path / MEGATRON_STATE).exists():
        dims, digits, state = load_megatron_state(path)
        return Policy(dims, state, (path / HF_DIR).resolve(), AdditionTokenizer(), (EOS,), digits)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model_dir={str(model_dir)!r} holds no tiny model ({MEGATRON_STATE}: `trace-rl make-model`) and no HF "
            "Qwen3-MoE checkpoint (config.json)"
        )
    from transformers import AutoTokenizer

    ckpt = HFCheckpoint(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    state = {k: v.to(torch.bfloat16) for k, v in megatron_state(ckpt).items()}
    return Policy(ckpt.dims, state, path.resolve(), tokenizer, _eos_ids(path, tokenizer), None)
