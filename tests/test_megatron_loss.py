"""GRPO + PPO clip + token-level TIS against a hand-computed example, and the mismatch metric names."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_trace.loss import grpo_advantages, grpo_loss, tis_weights, token_logprobs


def test_grpo_advantages_by_hand():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 0.0]), group_size=2)
    s = 1 / math.sqrt(2)  # unbiased std of {1, 0}: sqrt(0.5)
    want = torch.tensor([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.0, 0.0, 1 / (2 * s + 1e-6), -1 / (2 * s + 1e-6)])
    torch.testing.assert_close(adv, want)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(5), group_size=2)


def test_grpo_loss_with_clip_and_tis_by_hand():
    # Two responses, three token slots; the last slot of response 1 is padding.
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.9], [0.15, 0.6, 0.1]])).requires_grad_()
    logp_old = torch.log(torch.tensor([[0.4, 0.3, 0.5], [0.25, 0.6, 0.1]]))
    logp_rollout = torch.log(torch.tensor([[0.4, 0.05, 0.5], [0.4, 0.6, 0.1]]))
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, m = grpo_loss(logp, logp_old, logp_rollout, adv, mask)

    # ratio = p / p_old: 1.25, 1.0, 1.8 | 0.6, 1.0
    # A = +1: max(-r, -clip(r, .8, 1.2)) = -1.2 (clipped), -1.0, -1.2 (clipped)
    # A = -2: max(2r, 2 clip(r)) = 2 * 0.8 = 1.6 (clipped), 2.0
    # TIS w = min(p_old / p_rollout, 5): 1, 6 -> 5, 1 | 0.625, 1
    want = (-1.2 * 1 + -1.0 * 5 + -1.2 * 1 + 1.6 * 0.625 + 2.0 * 1) / 5
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert m["actor/pg_clipfrac"] == pytest.approx(3 / 5)
    assert m["tis/clip_frac"] == pytest.approx(1 / 5)
    assert m["tis/weight_mean"] == pytest.approx((1 + 5 + 1 + 0.625 + 1) / 5, rel=1e-6)
    diffs = [0.0, math.log(6), 0.0, math.log(0.625), 0.0]
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(sum(map(abs, diffs)) / 5, rel=1e-6)
    assert m["train_rollout_logprob_diff_max"] == pytest.approx(math.log(6), rel=1e-6)
    assert m["train_rollout_logprob_diff_min"] == pytest.approx(math.log(0.625), rel=1e-6)
    assert m["train_rollout_k3_kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in diffs) / 5, rel=1e-6)
    assert m["train_rollout_extreme_token_frac_tau2"] == pytest.approx(1 / 5)

    loss.backward()
    # Only unclipped tokens get a gradient: d/dlogp of -A * w * r / n = -A * w * r / n.
    g = torch.zeros(2, 3)
    g[0, 1] = -1.0 * 5 * 1.0 / 5
    g[1, 1] = 2.0 * 1 * 1.0 / 5
    torch.testing.assert_close(logp.grad, g)


def test_tis_off_token_logprobs_and_bad_inputs():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(2.0), 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[1, 0]]))
    torch.testing.assert_close(lp, torch.log(torch.tensor([[0.75, 2 / 3]])))
    assert float(tis_weights(torch.tensor([0.0]), torch.tensor([-3.0]))[0]) == 5.0
    x = torch.zeros(1, 2)
    loss, m = grpo_loss(x, x, x - 1, torch.tensor([1.0]), torch.ones(1, 2), tis_cap=None)
    assert float(loss) == -1.0 and m["tis/weight_mean"] == 1.0 and "tis/clip_frac" not in m
    with pytest.raises(ValueError, match="no tokens"):
        grpo_loss(x, x, x, torch.tensor([1.0]), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="logp_rollout shape"):
        grpo_loss(x, x, torch.zeros(2, 2), torch.tensor([1.0]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="NaN"):
        grpo_loss(x, x, torch.full((1, 2), float("nan")), torch.tensor([1.0]), torch.ones(1, 2))
