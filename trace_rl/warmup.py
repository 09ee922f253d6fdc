"""Models of the RL loop: a Qwen3-MoE (Megatron local spec) of a preset size, warmed up on the addition task.

Random init, then a short supervised warm-up (cross-entropy on the answer tokens, FP32) so that sampled answers
are sometimes right and RL has signal. Saved twice: the Megatron state (BF16) the trainer starts from, and the HF
Qwen3-MoE checkpoint (`megatron_trace.export`) the rollout engine loads.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from megatron_trace.cpu import init_single_rank
from megatron_trace.export import export_hf, hf_config
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.rows import pack_microbatch
from trace_rl.task import VOCAB, AdditionTask

MEGATRON_STATE = "megatron.pt"
HF_DIR = "hf"


PRESETS = {
    # the embedded default: a CPU forward + backward well under a second
    "tiny": MoEModelConfig(vocab=VOCAB, hidden=64, layers=2, experts=4, topk=2, expert_ffn=64, max_seq=32),
    # the results model (docs/results.md): 165 M parameters, Qwen3-MoE-shaped, one GPU
    "small": MoEModelConfig(
        vocab=VOCAB,
        hidden=768,
        layers=8,
        heads=12,
        kv_heads=4,
        head_dim=64,
        experts=16,
        topk=4,
        expert_ffn=512,
        max_seq=32,
    ),
    # the depth study (docs/results.md): the same family, 32 layers, narrower so it warms up and trains quickly
    "deep": MoEModelConfig(
        vocab=VOCAB,
        hidden=256,
        layers=32,
        heads=4,
        kv_heads=2,
        head_dim=64,
        experts=8,
        topk=2,
        expert_ffn=256,
        max_seq=32,
    ),
}


def _batch(task: AdditionTask, n: int, gen: torch.Generator, device: torch.device):
    ops = task.sample(n, gen)
    ids = torch.cat([task.prompts(ops), task.answers(ops)], dim=1)
    return ids.to(device), pack_microbatch(list(enumerate(ids))).to(device)


def _accuracy(model, task: AdditionTask, gen: torch.Generator, device: torch.device, n: int = 512) -> float:
    """Teacher-forced exact-answer accuracy (greedy per position) on `n` fresh problems."""
    p = task.prompt_len
    with torch.no_grad():
        ids, mb = _batch(task, n, gen, device)
        pred = model(mb.input_ids, mb.position_ids, mb.attention_mask)[:, p - 1 : -1].argmax(-1)
    return float((pred == ids[:, p:]).all(dim=1).float().mean())


def make_tiny_model(
    out: str | Path,
    *,
    digits: int = 1,
    steps: int = 60,
    batch: int = 128,
    seed: int = 0,
    preset: str = "tiny",
    lr: float = 3e-3,
    target_accuracy: float | None = None,
    time_limit_s: float | None = None,
) -> dict:
    """Build, warm up and save a model of `preset` under `out`; returns the warm-up summary.

    Warm-up runs `steps` steps, or stops early once the teacher-forced accuracy (checked every 10 steps) reaches
    `target_accuracy` (RL needs a policy that is sometimes, not always, right) or, at such a check, after
    `time_limit_s` seconds; the summary says which (`stopped`). On CUDA when available.
    """
    if steps < 4:
        raise ValueError(f"warm-up needs at least 4 steps, got {steps}")
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; use one of {sorted(PRESETS)}")
    init_single_rank(seed)
    task = AdditionTask(digits)
    cfg = PRESETS[preset]
    if task.prompt_len + task.answer_len > cfg.max_seq:
        raise ValueError(f"{digits}-digit addition needs {task.prompt_len + task.answer_len} positions > {cfg.max_seq}")
    model = build_moe_model(cfg, dtype=torch.float32, seed=seed, routing_replay=False)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.3)
    gen = torch.Generator().manual_seed(seed)
    p = task.prompt_len
    bar = tqdm(range(steps), desc="warm-up", unit="step")
    done, stopped, start = 0, "steps", time.monotonic()
    for i in bar:
        ids, mb = _batch(task, batch, gen, device)
        logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)
        loss = torch.nn.functional.cross_entropy(logits[:, p - 1 : -1].reshape(-1, VOCAB), ids[:, p:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        done = i + 1
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if done % 10:
            continue
        if target_accuracy is not None and _accuracy(model, task, gen, device) >= target_accuracy:
            stopped = "target_accuracy"
            break
        if time_limit_s is not None and time.monotonic() - start > time_limit_s:
            stopped = "time_limit"
            break
    accuracy = _accuracy(model, task, gen, device)
    model = model.to(torch.bfloat16)
    out = Path(out)
    (out / HF_DIR).mkdir(parents=True, exist_ok=True)
    save_file(export_hf(model), out / HF_DIR / "model.safetensors")
    config = hf_config(model, rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_seq)
    (out / HF_DIR / "config.json").write_text(json.dumps(config, indent=1))
    state = {k: v.cpu() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    torch.save({"tiny": dataclasses.asdict(cfg), "digits": digits, "state": state}, out / MEGATRON_STATE)
    summary = {
        "preset": preset,
        "parameters": sum(t.numel() for t in state.values()),
        "digits": digits,
        "steps": done,
        "stopped": stopped,
        "seconds": time.monotonic() - start,
        "final_loss": loss.item(),
        "teacher_forced_accuracy": accuracy,
    }
    (out / "warmup.json").write_text(json.dumps(summary, indent=1))
    return summary


def load_megatron_state(model_dir: str | Path) -> tuple[MoEModelConfig, int, dict[str, torch.Tensor]]:
    """(model dims, task digits, BF16 state dict) written by `make_tiny_model`."""
    path = Path(model_dir) / MEGATRON_STATE
    if not path.exists():
        raise FileNotFoundError(
            f"no tiny model at {model_dir} ({MEGATRON_STATE} missing); run scripts/make_tiny_model.py"
        )
    ckpt = torch.load(path, weights_only=True)
    return MoEModelConfig(**ckpt["tiny"]), int(ckpt["digits"]), ckpt["state"]
