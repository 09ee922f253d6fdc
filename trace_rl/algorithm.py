"""The RL algorithm's config keys (`RLConfig`: clipping, TIS, loss aggregation, GSPO, KL, entropy, optimizer and
learning-rate schedule, sampling filters, sample logging): their validation, and the trainers' `LossConfig`,
`LRSchedule` and keyword arguments built from them. Peer names of each key are in docs/rl.md, "Algorithm settings".
"""

from __future__ import annotations

from typing import Any

from megatron_trace.loss import AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES, LossConfig
from trace_rl.optim import LR_SCHEDULES, LRSchedule


def algorithm_errors(cfg: Any) -> list[str]:
    """One message per bad algorithm key of the `RLConfig` `cfg`, each naming the key and what it takes."""
    errors = []
    for key, allowed in (
        ("loss_agg_mode", AGG_MODES),
        ("policy_loss", POLICY_LOSSES),
        ("kl_estimator", KL_ESTIMATORS),
        ("lr_schedule", LR_SCHEDULES),
    ):
        if getattr(cfg, key) not in allowed:
            errors.append(f"{key}={getattr(cfg, key)!r} is not one of {allowed}")
    if not 0 <= cfg.clip_ratio_low < 1:
        errors.append(f"clip_ratio_low={cfg.clip_ratio_low} must be in [0, 1) (the ratio is clipped at 1 - it)")
    nonnegative = ("clip_ratio_high", "tis_cap", "kl_coef", "entropy_coef", "weight_decay", "lr_warmup_steps")
    errors += [f"{k}={getattr(cfg, k)} must be >= 0" for k in nonnegative if getattr(cfg, k) < 0]
    if cfg.grad_clip <= 0:
        errors.append(f"grad_clip={cfg.grad_clip} must be > 0 (the global gradient norm is clipped to it)")
    if not 0 <= cfg.min_lr_ratio <= 1:
        errors.append(f"min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1]")
    if not 0 < cfg.top_p <= 1:
        errors.append(f"top_p={cfg.top_p} must be in (0, 1] (1 keeps every token)")
    if cfg.top_k == 0 or cfg.top_k < -1:
        errors.append(f"top_k={cfg.top_k} must be -1 (off) or >= 1")
    if (cfg.top_p != 1 or cfg.top_k != -1) and cfg.rollout_backend != "embedded":
        errors.append(
            f"top_p={cfg.top_p} / top_k={cfg.top_k} need rollout_backend='embedded' (the SGLang worker does not send "
            "them yet); leave them at 1.0 / -1"
        )
    if cfg.eval_before_train and not cfg.eval_data:
        errors.append("eval_before_train=true needs eval_data (and eval_every)")
    if cfg.samples_every < 0 or cfg.samples_per_step < 1:
        errors.append(
            f"samples_every={cfg.samples_every} must be >= 0 (0: no sample log) and "
            f"samples_per_step={cfg.samples_per_step} >= 1"
        )
    return errors


def loss_config(cfg: Any) -> LossConfig:
    """The trainers' loss settings of `cfg` (`tis_cap = 0` turns TIS off)."""
    return LossConfig(
        clip_low=cfg.clip_ratio_low,
        clip_high=cfg.clip_ratio_high,
        tis_cap=cfg.tis_cap or None,
        agg=cfg.loss_agg_mode,
        policy_loss=cfg.policy_loss,
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        entropy_coef=cfg.entropy_coef,
    )


def trainer_kwargs(cfg: Any, steps: int) -> dict:
    """The algorithm keyword arguments of either trainer for a run of `steps` updates."""
    schedule = LRSchedule(cfg.lr_warmup_steps, cfg.lr_schedule, max(1, steps), cfg.min_lr_ratio)
    return dict(loss=loss_config(cfg), clip_grad=cfg.grad_clip, weight_decay=cfg.weight_decay, lr_schedule=schedule)
