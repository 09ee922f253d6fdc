"""GRPO + PPO clip + token-level TIS against a hand-computed example, and the mismatch metric names."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_trace.loss import grpo_advantages, grpo_loss, grpo_loss_terms, tis_weights, token_logprobs


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_and_grpo_tis_equal_the_full_fp32_log_softmax(dtype, monkeypatch):
    """`token_logprobs` (row chunks, no [B, S, V] FP32 tensor) against the former full FP32 log-softmax: log-probs,
    the GRPO + token-level TIS (C = 5) loss and its gradient agree to FP32 rounding."""
    import megatron_trace.loss as loss_mod

    monkeypatch.setattr(loss_mod, "_CHUNK_ELEMENTS", 3 * 50)  # three rows per chunk: several chunks
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 7, 50, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 50, (4, 7), generator=g)
    rollout = torch.log_softmax(logits.float() + 0.3 * torch.randn(4, 7, 50, generator=g), -1)
    logp_rollout = rollout.gather(-1, targets[..., None]).squeeze(-1)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    mask = torch.rand(4, 7, generator=g) > 0.2
    results = []
    for fn in (
        lambda x: torch.log_softmax(x.float(), -1).gather(-1, targets[..., None]).squeeze(-1),
        lambda x: token_logprobs(x, targets),
    ):
        x = logits.clone().requires_grad_()
        logp = fn(x)
        loss, metrics = grpo_loss(logp, logp.detach() - 0.05, logp_rollout, adv, mask, tis_cap=5.0)
        loss.backward()
        results.append((logp.detach(), float(loss), x.grad.float(), metrics["tis/weight_mean"]))
    (lp0, l0, g0, w0), (lp1, l1, g1, w1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-6, atol=2e-6)
    assert l1 == pytest.approx(l0, rel=1e-6, abs=1e-7) and w1 == pytest.approx(w0, rel=1e-6)
    atol = 1e-7 if dtype is torch.float32 else 1e-3  # the gradient is rounded to the logits' dtype
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=atol)


def test_grpo_loss_terms_sum_over_micro_batches_to_the_step_token_mean():
    """(sum, tokens) per micro-batch summed over the step and divided once: the token mean of the whole step, not
    the mean of micro-batch means (what Megatron's calculate_per_token_loss does over micro-batches and DP)."""
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(4, 6, generator=g) - 2
    old, rollout = logp + 0.1 * torch.randn(4, 6, generator=g), logp - 0.2
    adv, mask = torch.tensor([1.0, -1.0, 0.5, 2.0]), torch.rand(4, 6, generator=g) > 0.5
    mask[0, :5] = False  # micro-batch 0 is short
    whole, _ = grpo_loss(logp, old, rollout, adv, mask)
    parts = [
        grpo_loss_terms(logp[i : i + 2], old[i : i + 2], rollout[i : i + 2], adv[i : i + 2], mask[i : i + 2])
        for i in (0, 2)
    ]
    assert float(sum(p[0] for p in parts) / sum(p[1] for p in parts)) == pytest.approx(float(whole), rel=1e-6)
    means = [float(p[0] / p[1]) for p in parts]
    assert sum(means) / 2 != pytest.approx(float(whole), rel=1e-3)  # the per-micro-batch mean would bias by length
