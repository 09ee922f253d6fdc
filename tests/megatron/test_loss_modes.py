"""The policy-loss settings of `megatron_trace.loss` against losses and gradients computed by hand on one small batch:
clip-higher, the three aggregation modes (and their sums over micro-batches), GSPO's sequence ratio, the KL
estimators k1 / k2 / k3 to a reference policy, the entropy bonus (and `token_entropy`), and their refusals."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_trace.loss import LossConfig, grpo_loss, grpo_loss_terms, kl_penalty, token_entropy

# Two responses, three token slots; the last slot of response 1 is padding (the batch of
# tests/megatron/test_megatron_loss.py).
P = [[0.5, 0.3, 0.9], [0.15, 0.6, 0.1]]
P_OLD = [[0.4, 0.3, 0.5], [0.25, 0.6, 0.1]]
P_ROLLOUT = [[0.4, 0.05, 0.5], [0.4, 0.6, 0.1]]
ADV = [1.0, -2.0]
MASK = [[1, 1, 1], [1, 1, 0]]
# PPO at clip 0.2 / 0.2 with TIS (cap 5): ratios 1.25, 1.0, 1.8 | 0.6, 1.0; per-token losses -1.2 (clipped), -1.0,
# -1.2 (clipped) | 1.6 (clipped), 2.0; TIS weights 1, 5 (6 capped), 1 | 0.625, 1.
PER_TOKEN = [[-1.2 * 1, -1.0 * 5, -1.2 * 1], [1.6 * 0.625, 2.0 * 1]]


def _inputs():
    logp = torch.log(torch.tensor(P)).requires_grad_()
    return logp, torch.log(torch.tensor(P_OLD)), torch.log(torch.tensor(P_ROLLOUT)), torch.tensor(ADV)


def _loss(**kw):
    logp, old, rollout, adv = _inputs()
    loss, metrics = grpo_loss(logp, old, rollout, adv, torch.tensor(MASK), **kw)
    loss.backward()
    return float(loss), metrics, logp.grad


@pytest.mark.parametrize(
    "agg, want",
    [
        ("token-mean", (sum(PER_TOKEN[0]) + sum(PER_TOKEN[1])) / 5),
        ("seq-mean-token-sum", (sum(PER_TOKEN[0]) + sum(PER_TOKEN[1])) / 2),
        ("seq-mean-token-mean", (sum(PER_TOKEN[0]) / 3 + sum(PER_TOKEN[1]) / 2) / 2),
    ],
)
def test_aggregation_modes_by_hand(agg, want):
    loss, metrics, grad = _loss(agg=agg)
    assert loss == pytest.approx(want, rel=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(want, rel=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(3 / 5)  # token metrics stay token means
    # Only the unclipped tokens (0, 1) and (1, 1) get a gradient, -A * w * r divided by the mode's normalizer.
    scale = {"token-mean": (5, 5), "seq-mean-token-sum": (2, 2), "seq-mean-token-mean": (3 * 2, 2 * 2)}[agg]
    g = torch.zeros(2, 3)
    g[0, 1] = -1.0 * 5 * 1.0 / scale[0]
    g[1, 1] = 2.0 * 1 * 1.0 / scale[1]
    torch.testing.assert_close(grad, g)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_sums_give_the_whole_batch_loss(agg):
    """What Megatron's schedule does with the terms (sum of sums over the sum of counts) is the one-batch loss."""
    g = torch.Generator().manual_seed(3)
    logp, old, rollout = (-torch.rand(6, 5, generator=g) for _ in range(3))
    adv, mask = torch.randn(6, generator=g), torch.rand(6, 5, generator=g) > 0.3
    mask[4] = False  # a sequence without response tokens counts in no mode
    whole, _ = grpo_loss(logp, old, rollout, adv, mask, agg=agg)
    parts = [
        grpo_loss_terms(logp[i : i + 2], old[i : i + 2], rollout[i : i + 2], adv[i : i + 2], mask[i : i + 2], agg=agg)
        for i in (0, 2, 4)
    ]
    assert float(sum(p[0] for p in parts) / sum(p[1] for p in parts)) == pytest.approx(float(whole), rel=1e-6)
    units = sum(int(p[1]) for p in parts)
    assert units == (int(mask.sum()) if agg == "token-mean" else 5)


def test_clip_higher_by_hand():
    """clip_high = 0.28 (DAPO's clip-higher): ratio 1.25 of a positive advantage is no longer clipped, 1.8 is clipped
    at 1.28; the negative advantage's low side is unchanged."""
    loss, metrics, grad = _loss(clip_high=0.28)
    want = (-1.25 * 1 + -1.0 * 5 + -1.28 * 1 + 1.6 * 0.625 + 2.0 * 1) / 5
    assert loss == pytest.approx(want, rel=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert float(grad[0, 0]) == pytest.approx(-1.0 * 1 * 1.25 / 5, rel=1e-6)  # now unclipped: -A * w * r / n
    assert float(grad[0, 2]) == 0.0


def test_gspo_sequence_ratio_by_hand():
    """GSPO: one ratio per sequence, the geometric mean of its token ratios: s0 = (1.25 * 1.0 * 1.8)^(1/3),
    s1 = (0.6 * 1.0)^(1/2). Clip 0.5 leaves both unclipped; TIS off. Each token's gradient is -A * s_i / n."""
    s0, s1 = 2.25 ** (1 / 3), 0.6**0.5
    loss, _, grad = _loss(policy_loss="gspo", clip_low=0.5, clip_high=0.5, tis_cap=None)
    assert loss == pytest.approx((3 * -s0 + 2 * 2 * s1) / 5, rel=1e-6)
    want = torch.tensor([[-s0 / 5] * 3, [2 * s1 / 5, 2 * s1 / 5, 0.0]])
    torch.testing.assert_close(grad, want)
    # verl's GSPO default aggregation: the mean of each sequence's token mean.
    loss, _, _ = _loss(policy_loss="gspo", clip_low=0.5, clip_high=0.5, tis_cap=None, agg="seq-mean-token-mean")
    assert loss == pytest.approx((-s0 + 2 * s1) / 2, rel=1e-6)
    # At clip 0.2 both sequences are clipped (s0 > 1.2 with A > 0, s1 < 0.8 with A < 0): no gradient, TIS weighted.
    loss, metrics, grad = _loss(policy_loss="gspo")
    assert loss == pytest.approx((-1.2 * (1 + 5 + 1) + 1.6 * (0.625 + 1)) / 5, rel=1e-6)
    assert metrics["actor/pg_clipfrac"] == 1.0
    assert not grad.any()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_to_the_reference_by_hand(estimator):
    """kl_coef = 0.1 to a reference at p = 0.5 everywhere, PPO clip 0.2 and TIS as above: the loss adds 0.1 times
    the token mean of the estimate, whose gradient per token is d/dlogp of the estimate / n."""
    ref = torch.log(torch.full((2, 3), 0.5))
    d = [[math.log(p / 0.5) for p in row] for row in P]  # logp - logp_ref
    est = {
        "k1": lambda x: x,
        "k2": lambda x: 0.5 * x * x,
        "k3": lambda x: math.exp(-x) + x - 1,
    }[estimator]
    dest = {"k1": lambda x: 1.0, "k2": lambda x: x, "k3": lambda x: 1 - math.exp(-x)}[estimator]
    kl = [[est(x) for x in row] for row in d]
    kl_mean = (sum(kl[0]) + kl[1][0] + kl[1][1]) / 5
    pg = (sum(PER_TOKEN[0]) + sum(PER_TOKEN[1])) / 5
    loss, metrics, grad = _loss(kl_coef=0.1, kl_estimator=estimator, logp_ref=ref)
    assert metrics["actor/kl_loss"] == pytest.approx(kl_mean, rel=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(pg, rel=1e-6)
    assert loss == pytest.approx(pg + 0.1 * kl_mean, rel=1e-6)
    g = torch.tensor([[0.1 * dest(x) / 5 for x in row] for row in d])
    g[0, 1] += -1.0 * 5 / 5  # the unclipped policy tokens, as above
    g[1, 1] += 2.0 / 5
    g[1, 2] = 0.0
    torch.testing.assert_close(grad, g)
    # k3 is non-negative, k1 may not be; the estimate of a policy equal to its reference is 0.
    assert float(kl_penalty(ref, ref, estimator).abs().max()) == 0.0


def test_entropy_bonus_by_hand():
    """token_entropy of logits [0, ln 3] (p = 1/4, 3/4) is -(1/4 ln 1/4 + 3/4 ln 3/4), and its gradient
    dH/dz_j = -p_j (z_j - E_p[z]); the loss subtracts entropy_coef times the token mean of the entropy."""
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0]]], requires_grad=True)
    h = token_entropy(logits)
    h0 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(h, torch.tensor([[h0, math.log(2.0)]]))
    h[0, 0].backward()
    ez = 0.75 * math.log(3.0)
    want = torch.tensor([[-0.25 * (0.0 - ez), -0.75 * (math.log(3.0) - ez)], [0.0, 0.0]])
    torch.testing.assert_close(logits.grad[0], want)

    entropy = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.25, 9.0]])
    loss, metrics, _ = _loss(entropy_coef=0.01, entropy=entropy)
    pg = (sum(PER_TOKEN[0]) + sum(PER_TOKEN[1])) / 5
    assert metrics["actor/entropy"] == pytest.approx((1 + 2 + 3 + 0.5 + 0.25) / 5)
    assert loss == pytest.approx(pg - 0.01 * (6.75 / 5), rel=1e-6)


def test_refusals_name_the_setting():
    logp, old, rollout, adv = _inputs()
    mask = torch.tensor(MASK)
    with pytest.raises(ValueError, match="no logp_ref"):
        grpo_loss(logp, old, rollout, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="no per-token entropy"):
        grpo_loss(logp, old, rollout, adv, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match="loss aggregation 'seq-sum'"):
        LossConfig(agg="seq-sum")
    with pytest.raises(ValueError, match="policy loss 'cispo'"):
        LossConfig(policy_loss="cispo")
    with pytest.raises(ValueError, match="KL estimator 'k4'"):
        LossConfig(kl_estimator="k4")
    assert not LossConfig().needs_reference and LossConfig(kl_coef=0.1).needs_reference
