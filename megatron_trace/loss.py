"""GRPO policy loss with PPO clipping and token-level truncated importance sampling (TIS), plus the training /
rollout mismatch metrics under verl / slime names.

- Advantages: GRPO, per group of responses to one prompt, `(r - mean) / (std + eps)` with the unbiased std (as
  verl's `compute_grpo_outcome_advantage`), broadcast to every response token.
- PPO: `ratio = exp(logp - logp_old)`, per-token loss `max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))`.
- TIS: the rollout sampled from its own policy, so each token is reweighted by
  `w = min(exp(logp_old - logp_rollout), C)` (C = 5), detached.
- Aggregation: mean over all valid response tokens of the micro-batch ("token-mean").
"""

from __future__ import annotations

import torch

from trace_core import metrics as tm


def _check(name: str, t: torch.Tensor, shape: torch.Size) -> None:
    if t.shape != shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} does not match {tuple(shape)}")
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or Inf")


def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Group-normalized advantages of `rewards [G * group_size]` (consecutive responses share a prompt)."""
    if rewards.dim() != 1 or group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} must be 1-D with a multiple of group_size={group_size} >= 2")
    _check("rewards", rewards, rewards.shape)
    r = rewards.double().view(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)
    return adv.view(-1).to(rewards.dtype)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position from logits `[B, S, V]` (FP32 log-softmax) and targets `[B, S]`."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must be [B, S, V], [B, S]")
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def tis_weights(logp_old: torch.Tensor, logp_rollout: torch.Tensor, cap: float = 5.0) -> torch.Tensor:
    """Token-level truncated importance weights `min(exp(logp_old - logp_rollout), cap)`, no gradient."""
    if cap <= 0:
        raise ValueError(f"TIS cap must be positive, got {cap}")
    _check("logp_rollout", logp_rollout, logp_old.shape)
    return torch.exp(logp_old.detach().float() - logp_rollout.float()).clamp(max=cap)


def mismatch_metrics(logp_train: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl / slime mismatch metrics between the trainer's and the rollout's log-probs on valid tokens."""
    m = mask.bool()
    out = tm.logprob_diff_stats(logp_train, logp_rollout, m)
    out["train_rollout_k3_kl"] = tm.k3_kl(logp_train, logp_rollout, m)
    out["train_rollout_extreme_token_frac_tau2"] = tm.extreme_token_fraction(logp_train, logp_rollout, 2.0, m)
    return out


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    tis_cap: float | None = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean GRPO/PPO loss with TIS over `mask`ed response tokens, and its metrics.

    `logp [B, S]` carries the gradient; `logp_old` (the trainer's log-probs before the update) and `logp_rollout`
    (the rollout engine's) are constants; `advantages` is `[B]` (one per response) or `[B, S]`. `tis_cap=None`
    turns TIS off.
    """
    shape = logp.shape
    for name, t in (("logp_old", logp_old), ("logp_rollout", logp_rollout), ("mask", mask)):
        _check(name, t, shape)
    if advantages.shape == shape[:1]:
        advantages = advantages[:, None].expand(shape)
    _check("advantages", advantages, shape)
    m = mask.bool()
    n = int(m.sum())
    if n == 0:
        raise ValueError("grpo_loss: the mask selects no tokens")
    old = logp_old.detach().float()
    adv = advantages.detach().float()
    ratio = torch.exp(logp.float() - old)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    weights = tis_weights(old, logp_rollout, tis_cap) if tis_cap is not None else torch.ones_like(per_token)
    loss = (per_token * weights)[m].sum() / n
    with torch.no_grad():
        out = {
            "actor/pg_loss": float(loss),
            "actor/pg_clipfrac": float((clipped > unclipped)[m].float().mean()),
            "actor/ppo_kl": float((old - logp.float())[m].mean()),
            "tis/weight_mean": float(weights[m].mean()),
        }
        if tis_cap is not None:
            raw = torch.exp(old - logp_rollout.float())
            out["tis/clip_frac"] = float((raw > tis_cap)[m].float().mean())
        out.update(mismatch_metrics(old, logp_rollout, m))
    return loss, out
