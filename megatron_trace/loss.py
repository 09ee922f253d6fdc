"""GRPO policy loss with PPO clipping and token-level truncated importance sampling (TIS), plus the training /
rollout mismatch metrics under verl / slime names.

- Advantages: GRPO, per group of responses to one prompt, `(r - mean) / (std + eps)` with the unbiased std (as
  verl's `compute_grpo_outcome_advantage`), broadcast to every response token.
- PPO: `ratio = exp(logp - logp_old)`, per-token loss `max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))`.
- TIS: the rollout sampled from its own policy, so each token is reweighted by
  `w = min(exp(logp_old - logp_rollout), C)` (C = 5), detached.
- GSPO (`policy_loss = "gspo"`, Zheng et al. 2025, verl's `loss_mode = "gspo"`): the ratio is the sequence's,
  `s_i = exp(mean_t (logp - logp_old))` (log clamped at 10 as verl), carried to each token as
  `sg[s_i] * exp(logp_t - sg[logp_t])`, then clipped as PPO's.
- KL to a reference policy (`kl_coef`, verl's `use_kl_loss` / `kl_loss_coef` / `kl_loss_type`): per token `k1 =
  logp - logp_ref`, `k2 = (logp - logp_ref)^2 / 2` or `k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1` (clamped
  to [-10, 10] as verl's `low_var_kl`), added with `kl_coef`; entropy (`entropy_coef`, `token_entropy`) subtracted
  with `entropy_coef`. Both are aggregated like the policy term and neither is computed at coefficient 0.
- Aggregation (`agg`, verl's `loss_agg_mode`): `token-mean` (the default) over every response token of the step;
  `seq-mean-token-sum` and `seq-mean-token-mean`, the mean over the step's sequences of each sequence's token sum /
  token mean. `grpo_loss_terms` returns the micro-batch's loss *sum* and its count of units (tokens, or sequences
  with a response token), which Megatron's schedule (`calculate_per_token_loss`) turns into the mean over the whole
  step, across micro-batches and DP ranks, so gradient accumulation and DP do not change the weighting;
  `grpo_loss` is that mean for one micro-batch.
- Log-probs: `token_logprobs` works on vocab-parallel logits `[B, S, V / TP]` (max, sum of exponentials and the
  target logit all-reduced over the tensor-parallel group) in row chunks, so no `[B, S, V]` FP32 tensor exists, and
  recomputes the softmax chunk by chunk in the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

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


_CHUNK_ELEMENTS = 1 << 24  # FP32 elements per row chunk of the log-prob computation (64 MiB)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprob(torch.autograd.Function):
    """log p(target) from logits rows `[N, V_local]` sharded over `group` by vocabulary (rank r holds ids
    `[vocab_start, vocab_start + V_local)`); FP32 math one row chunk at a time."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int) -> torch.Tensor:
        n, v = logits.shape
        step = max(1, _CHUNK_ELEMENTS // v)
        local = target - vocab_start
        inside = (local >= 0) & (local < v)
        local = torch.where(inside, local, torch.zeros_like(local))
        row_max = torch.cat([logits[i : i + step].float().amax(-1) for i in range(0, n, step)])
        row_max = _all_reduce(row_max, torch.distributed.ReduceOp.MAX, group)
        sum_exp = torch.cat(
            [(logits[i : i + step].float() - row_max[i : i + step, None]).exp().sum(-1) for i in range(0, n, step)]
        )
        sum_exp = _all_reduce(sum_exp, torch.distributed.ReduceOp.SUM, group)
        picked = torch.where(inside, logits.gather(1, local[:, None]).squeeze(1).float(), 0.0)
        picked = _all_reduce(picked, torch.distributed.ReduceOp.SUM, group)
        lse = row_max + sum_exp.log()
        ctx.save_for_backward(logits, local, inside, lse)
        ctx.step = step
        return picked - lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, local, inside, lse = ctx.saved_tensors
        out = torch.empty_like(logits)
        g = grad.float()
        for i in range(0, logits.shape[0], ctx.step):
            j = i + ctx.step
            chunk = -(logits[i:j].float() - lse[i:j, None]).exp() * g[i:j, None]
            chunk.scatter_add_(1, local[i:j, None], torch.where(inside[i:j], g[i:j], 0.0)[:, None])
            out[i:j] = chunk.to(out.dtype)
        return out, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group=None) -> torch.Tensor:
    """log p(target) per position (FP32) from logits `[B, S, V]` and targets `[B, S]`. With `tp_group` the logits
    are Megatron's vocab-parallel output `[B, S, V / TP]` (this rank's contiguous vocabulary slice)."""
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} must be [B, S, V], [B, S]")
    v = logits.shape[-1]
    start = v * torch.distributed.get_rank(tp_group) if tp_group is not None else 0
    flat = _VocabParallelLogprob.apply(logits.reshape(-1, v), targets.reshape(-1).long(), tp_group, start)
    return flat.view(targets.shape)


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


AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
POLICY_LOSSES = ("ppo", "gspo")
KL_ESTIMATORS = ("k1", "k2", "k3")
GSPO_MAX_LOG_RATIO = 10.0  # verl's clamp of the sequence log-ratio


@dataclass(frozen=True)
class LossConfig:
    """The policy loss's settings (`grpo_loss_terms`' keywords), defaults the loss of TRACE before they were
    settable: PPO with symmetric clipping at 0.2, TIS capped at 5, token-mean, no KL, no entropy."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    tis_cap: float | None = 5.0
    agg: str = "token-mean"
    policy_loss: str = "ppo"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.agg not in AGG_MODES:
            raise ValueError(f"loss aggregation {self.agg!r} is not one of {AGG_MODES}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy loss {self.policy_loss!r} is not one of {POLICY_LOSSES}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"KL estimator {self.kl_estimator!r} is not one of {KL_ESTIMATORS}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"clip ratios low={self.clip_low} (in [0, 1)) and high={self.clip_high} (>= 0)")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss reads a reference policy's log-probs (a KL term)."""
        return self.kl_coef != 0

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0


def kl_penalty(logp: torch.Tensor, logp_ref: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate of the policy against the reference (Schulman's k1 / k2 / k3; k3 clamped as verl's
    `low_var_kl`); the gradient flows through `logp`."""
    d = logp.float() - logp_ref.detach().float()
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return (torch.exp(-d) + d - 1).clamp(-10.0, 10.0)
    raise ValueError(f"KL estimator {estimator!r} is not one of {KL_ESTIMATORS}")


def token_entropy(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Entropy (FP32, differentiable) of the softmax at each position of logits `[B, S, V]` (vocab-parallel
    `[B, S, V / TP]` with `tp_group`): `log Z - E_p[logit]`. It holds an FP32 copy of the logits, so it is
    computed only with a non-zero `entropy_coef`."""
    x = logits.float()
    row_max = _all_reduce(x.detach().amax(-1, keepdim=True), torch.distributed.ReduceOp.MAX, tp_group)
    e = torch.exp(x - row_max)
    z, ez = e.sum(-1), (e * x).sum(-1)
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        z, ez = _ReduceToReplicated.apply(z, tp_group), _ReduceToReplicated.apply(ez, tp_group)
    return torch.log(z) + row_max.squeeze(-1) - ez / z


class _ReduceToReplicated(torch.autograd.Function):
    """Sum over `group` in the forward, identity in the backward: every rank computes the same loss from the
    reduced value, so each rank's gradient of it is already the whole gradient of its own part (Megatron's
    `reduce_from_tensor_model_parallel_region`; torch.distributed.nn's all_reduce would sum the copies)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        return _all_reduce(t.clone(), torch.distributed.ReduceOp.SUM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _aggregate(x: torch.Tensor, m: torch.Tensor, agg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum over this micro-batch's units of `x [B, S]` under `mask` `m` and the unit count (`AGG_MODES`)."""
    if agg == "token-mean":
        return x[m].sum(), m.sum()
    lengths = m.sum(1)
    has = lengths > 0
    per_seq = torch.where(m, x, 0.0).sum(1)
    if agg == "seq-mean-token-mean":
        per_seq = per_seq / lengths.clamp_min(1)
    return per_seq[has].sum(), has.sum()


def grpo_loss_terms(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    tis_cap: float | None = 5.0,
    agg: str = "token-mean",
    policy_loss: str = "ppo",
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    logp_ref: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """GRPO/PPO (or GSPO) loss with TIS, plus the KL and entropy terms, summed over the units of `agg` (tokens, or
    sequences) of the `mask`ed response tokens of one micro-batch, their count (int64 tensor) and the metrics (token
    means over this micro-batch, the loss terms per unit).

    `logp [B, S]` carries the gradient; `logp_old` (the trainer's log-probs before the update) and `logp_rollout`
    (the rollout engine's) are constants; `advantages` is `[B]` (one per response) or `[B, S]`. `tis_cap=None`
    turns TIS off. `logp_ref` (the reference policy's log-probs) is needed with `kl_coef`, `entropy` (per token,
    `token_entropy`, with its gradient) with `entropy_coef`. A micro-batch without response tokens gives a zero sum
    and count.
    """
    LossConfig(clip_low, clip_high, tis_cap, agg, policy_loss, kl_coef, kl_estimator, entropy_coef)  # validates
    shape = logp.shape
    for name, t in (("logp_old", logp_old), ("logp_rollout", logp_rollout), ("mask", mask)):
        _check(name, t, shape)
    if advantages.shape == shape[:1]:
        advantages = advantages[:, None].expand(shape)
    _check("advantages", advantages, shape)
    if kl_coef:
        if logp_ref is None:
            raise ValueError("kl_coef is set but no logp_ref (the reference policy's log-probs) was given")
        _check("logp_ref", logp_ref, shape)
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef is set but no per-token entropy was given")
        _check("entropy", entropy, shape)
    m = mask.bool()
    old = logp_old.detach().float()
    adv = advantages.detach().float()
    if policy_loss == "gspo":
        lengths = m.sum(1, keepdim=True).clamp_min(1)
        seq_log_ratio = torch.where(m, logp.float() - old, 0.0).sum(1, keepdim=True) / lengths
        seq_log_ratio = seq_log_ratio.clamp(max=GSPO_MAX_LOG_RATIO)
        ratio = torch.exp(logp.float() - logp.float().detach() + seq_log_ratio.detach())
    else:
        ratio = torch.exp(logp.float() - old)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    weights = tis_weights(old, logp_rollout, tis_cap) if tis_cap is not None else torch.ones_like(per_token)
    pg_total, n = _aggregate(per_token * weights, m, agg)
    total = pg_total
    extra: dict[str, torch.Tensor] = {}
    if kl_coef:
        ref = cast(torch.Tensor, logp_ref)  # checked above with kl_coef
        extra["actor/kl_loss"], _ = _aggregate(kl_penalty(logp, ref, kl_estimator), m, agg)
        total = total + kl_coef * extra["actor/kl_loss"]
    if entropy_coef:
        extra["actor/entropy"], _ = _aggregate(cast(torch.Tensor, entropy).float(), m, agg)  # checked above
        total = total - entropy_coef * extra["actor/entropy"]
    out: dict[str, float] = {}
    tokens = int(m.sum())
    if tokens:
        with torch.no_grad():
            out = {
                "actor/pg_loss": float(pg_total / n),
                "actor/pg_clipfrac": float((clipped > unclipped)[m].float().mean()),
                "actor/ppo_kl": float((old - logp.float())[m].mean()),
                "tis/weight_mean": float(weights[m].mean()),
            }
            out |= {k: float(v / n) for k, v in extra.items()}
            if tis_cap is not None:
                raw = torch.exp(old - logp_rollout.float())
                out["tis/clip_frac"] = float((raw > tis_cap)[m].float().mean())
            out.update(mismatch_metrics(old, logp_rollout, m))
    return total, n, out


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_rollout: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO/PPO loss with TIS of one micro-batch's `mask`ed response tokens, and its metrics (`grpo_loss_terms`
    divided by its unit count: the token mean by default; keyword arguments as there)."""
    total, n, out = grpo_loss_terms(logp, logp_old, logp_rollout, advantages, mask, **kwargs)
    if int(n) == 0:
        raise ValueError("grpo_loss: the mask selects no tokens")
    return total / n, out
