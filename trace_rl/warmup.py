"""The embedded default model: a tiny Qwen3-MoE (Megatron local spec) warmed up on the addition task.

Random init, then a short supervised warm-up (cross-entropy on the answer tokens, FP32) so that sampled answers
are sometimes right and RL has signal. Saved twice: the Megatron state (BF16) the trainer starts from, and the HF
Qwen3-MoE checkpoint (`megatron_trace.export`) the rollout engine loads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from megatron_trace.cpu import init_single_rank
from megatron_trace.export import export_hf, hf_config
from megatron_trace.rows import pack_microbatch
from megatron_trace.tiny import TinyMoEConfig, build_tiny_moe
from trace_rl.task import VOCAB, AdditionTask

MEGATRON_STATE = "megatron.pt"
HF_DIR = "hf"


def tiny_config(task: AdditionTask) -> TinyMoEConfig:
    return TinyMoEConfig(vocab=VOCAB, hidden=64, layers=2, experts=4, topk=2, expert_ffn=64, max_seq=32)


def _batch(task: AdditionTask, n: int, gen: torch.Generator):
    ops = task.sample(n, gen)
    ids = torch.cat([task.prompts(ops), task.answers(ops)], dim=1)
    return ids, pack_microbatch(list(enumerate(ids)))


def make_tiny_model(out: str | Path, *, digits: int = 1, steps: int = 60, batch: int = 128, seed: int = 0) -> dict:
    """Build, warm up and save the tiny model under `out`; returns the warm-up summary."""
    if steps < 4:
        raise ValueError(f"warm-up needs at least 4 steps, got {steps}")
    init_single_rank(seed)
    task = AdditionTask(digits)
    cfg = tiny_config(task)
    model = build_tiny_moe(cfg, dtype=torch.float32, seed=seed, routing_replay=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.3)
    gen = torch.Generator().manual_seed(seed)
    p = task.prompt_len
    bar = tqdm(range(steps), desc="warm-up", unit="step")
    for _ in bar:
        ids, mb = _batch(task, batch, gen)
        logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)
        loss = torch.nn.functional.cross_entropy(logits[:, p - 1 : -1].reshape(-1, VOCAB), ids[:, p:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    with torch.no_grad():
        ids, mb = _batch(task, 512, gen)
        pred = model(mb.input_ids, mb.position_ids, mb.attention_mask)[:, p - 1 : -1].argmax(-1)
        accuracy = float((pred == ids[:, p:]).all(dim=1).float().mean())
    model = model.to(torch.bfloat16)
    out = Path(out)
    (out / HF_DIR).mkdir(parents=True, exist_ok=True)
    save_file(export_hf(model), out / HF_DIR / "model.safetensors")
    config = hf_config(model, rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_seq)
    (out / HF_DIR / "config.json").write_text(json.dumps(config, indent=1))
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save({"tiny": dataclasses.asdict(cfg), "digits": digits, "state": state}, out / MEGATRON_STATE)
    summary = {"digits": digits, "steps": steps, "final_loss": loss.item(), "teacher_forced_accuracy": accuracy}
    (out / "warmup.json").write_text(json.dumps(summary, indent=1))
    return summary


def load_megatron_state(model_dir: str | Path) -> tuple[TinyMoEConfig, int, dict[str, torch.Tensor]]:
    """(model dims, task digits, BF16 state dict) written by `make_tiny_model`."""
    path = Path(model_dir) / MEGATRON_STATE
    if not path.exists():
        raise FileNotFoundError(
            f"no tiny model at {model_dir} ({MEGATRON_STATE} missing); run scripts/make_tiny_model.py"
        )
    ckpt = torch.load(path, weights_only=True)
    return TinyMoEConfig(**ckpt["tiny"]), int(ckpt["digits"]), ckpt["state"]
