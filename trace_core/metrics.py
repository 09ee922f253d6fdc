"""Mismatch metrics between the training and rollout paths.

Activation-level: code-flip rate, quantized discrepancy (paper Eq. 1), relative excess discrepancy (Fig. 4b),
codebook distance of mismatches (Fig. 6). Policy-level, with verl / slime names: log-prob difference statistics,
the k3 KL estimator and the extreme-token fraction F(tau) of the R3 paper.
"""

from __future__ import annotations

import torch

from trace_core.numerics import e2m1
from trace_core.records.spec import low_bits_mask


def _same_shape(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")


def code_flips(train_codes: torch.Tensor, rollout_codes: torch.Tensor) -> torch.Tensor:
    """Bool mask of elements whose codes decode to different values (+0 and -0 count as equal)."""
    _same_shape(train_codes, rollout_codes, "code_flips")
    return e2m1.signed_index(train_codes) != e2m1.signed_index(rollout_codes)


def low_bit_flips(train_codes: torch.Tensor, recorded: torch.Tensor, bits: int) -> torch.Tensor:
    """Bool mask of elements whose training code differs from the record in the low `bits` code bits it keeps
    (`recorded`: `Record.code_bits()`); the guided kernel counts the same flips in its own pass."""
    _same_shape(train_codes, recorded, "low_bit_flips")
    return (train_codes & low_bits_mask(bits)) != recorded


def code_flip_rate(train_codes: torch.Tensor, rollout_codes: torch.Tensor) -> float:
    """Fraction of elements whose FP4 code differs between training and rollout."""
    flips = code_flips(train_codes, rollout_codes)
    return float(flips.double().mean()) if flips.numel() else 0.0


def quantized_discrepancy(train_values: torch.Tensor, rollout_values: torch.Tensor) -> float:
    """Paper Eq. 1: Frobenius norm of the difference of the two dequantized activations."""
    _same_shape(train_values, rollout_values, "quantized_discrepancy")
    return float(torch.linalg.vector_norm((train_values.float() - rollout_values.float()).flatten()))


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    _same_shape(a, b, "mse")
    return float(((a.float() - b.float()) ** 2).mean())


def relative_excess_discrepancy(
    train_fp4: torch.Tensor, rollout_fp4: torch.Tensor, train_bf16: torch.Tensor, rollout_bf16: torch.Tensor
) -> float:
    """Fig. 4b: (D_FP4 - D_BF16) / D_BF16 with D the train-rollout activation MSE."""
    d_bf16 = mse(train_bf16, rollout_bf16)
    if d_bf16 == 0:
        raise ValueError("relative excess discrepancy is undefined: the BF16 activations are identical")
    return (mse(train_fp4, rollout_fp4) - d_bf16) / d_bf16


def codebook_distance_histogram(
    train_codes: torch.Tensor, rollout_codes: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Fig. 6: counts of mismatched elements by distance on the signed E2M1 grid (index d = distance, 1..14;
    index 0 is always 0), over the elements where `mask` (bool, same shape) is True if given. A fixed-size
    scatter-add: nothing waits on the device."""
    _same_shape(train_codes, rollout_codes, "codebook_distance_histogram")
    dist = (e2m1.signed_index(train_codes) - e2m1.signed_index(rollout_codes)).abs()
    if mask is not None:
        _same_shape(dist, mask, "mask")
        dist = torch.where(mask, dist, 0)
    hist = torch.zeros(15, dtype=torch.int64, device=dist.device)
    hist.scatter_add_(0, dist.flatten(), torch.ones_like(dist.flatten()))
    hist[0] = 0
    return hist


def _masked(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.flatten()
    _same_shape(values, mask, "mask")
    return values[mask.bool()]


def logprob_diff_stats(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None = None
) -> dict[str, float]:
    """`train_rollout_logprob_diff_{max,min}` and `train_rollout_logprob_abs_diff` (mean) over valid tokens."""
    _same_shape(train_logp, rollout_logp, "logprob_diff_stats")
    diff = _masked(train_logp.float() - rollout_logp.float(), mask)
    if not diff.numel():
        raise ValueError("logprob_diff_stats: no valid tokens")
    return {
        "train_rollout_logprob_diff_max": float(diff.max()),
        "train_rollout_logprob_diff_min": float(diff.min()),
        "train_rollout_logprob_abs_diff": float(diff.abs().mean()),
    }


def k3_kl(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """k3 estimator of KL(pi_rollout || pi_train) on rollout samples: mean of r - 1 - log r, r = pi_train/pi_rollout."""
    _same_shape(train_logp, rollout_logp, "k3_kl")
    log_r = _masked(train_logp.double() - rollout_logp.double(), mask)
    if not log_r.numel():
        raise ValueError("k3_kl: no valid tokens")
    return float((torch.expm1(log_r) - log_r).mean())


def extreme_token_fraction(
    train_logp: torch.Tensor, rollout_logp: torch.Tensor, tau: float = 2.0, mask: torch.Tensor | None = None
) -> float:
    """R3's F(tau): fraction of tokens whose train/rollout probability ratio r has max(r, 1/r) > tau."""
    if tau <= 1:
        raise ValueError(f"extreme_token_fraction needs tau > 1, got {tau}")
    _same_shape(train_logp, rollout_logp, "extreme_token_fraction")
    log_r = _masked(train_logp.double() - rollout_logp.double(), mask)
    if not log_r.numel():
        raise ValueError("extreme_token_fraction: no valid tokens")
    return float((log_r.abs() > torch.log(torch.tensor(tau, dtype=torch.float64))).double().mean())
