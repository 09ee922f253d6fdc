"""Mismatch metrics on hand-checked inputs."""

import math

import pytest
import torch

from trace_core import metrics


def test_code_flips_ignore_the_sign_of_zero():
    train = torch.tensor([0, 8, 1, 9, 7], dtype=torch.uint8)
    roll = torch.tensor([8, 0, 2, 1, 7], dtype=torch.uint8)
    assert metrics.code_flips(train, roll).tolist() == [False, False, True, True, False]
    assert metrics.code_flip_rate(train, roll) == 0.4


def test_codebook_distance_histogram_counts_signed_grid_steps():
    train = torch.tensor([1, 9, 3, 7, 4], dtype=torch.uint8)  # 0.5, -0.5, 1.5, 6, 2
    roll = torch.tensor([2, 1, 3, 15, 4], dtype=torch.uint8)  # 1, 0.5, 1.5, -6, 2
    hist = metrics.codebook_distance_histogram(train, roll)
    assert hist.shape == (15,)
    assert hist[1] == 1 and hist[2] == 1 and hist[14] == 1 and int(hist.sum()) == 3


def test_discrepancies():
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    assert metrics.quantized_discrepancy(a, b) == 5.0
    assert metrics.relative_excess_discrepancy(a, b, torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])) == 11.5
    with pytest.raises(ValueError, match="BF16 activations are identical"):
        metrics.relative_excess_discrepancy(a, b, a, a)
    with pytest.raises(ValueError, match="shapes"):
        metrics.mse(a, torch.zeros(3))


def test_logprob_metrics_by_hand():
    train = torch.tensor([[-1.0, -2.0, -0.5]])
    roll = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[True, True, False]])
    stats = metrics.logprob_diff_stats(train, roll, mask)
    assert stats == {
        "train_rollout_logprob_diff_max": 0.5,
        "train_rollout_logprob_diff_min": -1.0,
        "train_rollout_logprob_abs_diff": 0.75,
    }
    expected_k3 = ((math.exp(0.5) - 1 - 0.5) + (math.exp(-1.0) - 1 + 1.0)) / 2
    assert metrics.k3_kl(train, roll, mask) == pytest.approx(expected_k3, rel=1e-12)
    # ratios e^0.5 = 1.65 and e^-1 = 0.37 (1/r = 2.72 > 2): one extreme token of two.
    assert metrics.extreme_token_fraction(train, roll, 2.0, mask) == 0.5
    assert metrics.extreme_token_fraction(train, roll, 3.0, mask) == 0.0
    with pytest.raises(ValueError, match="no valid tokens"):
        metrics.k3_kl(train, roll, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="tau > 1"):
        metrics.extreme_token_fraction(train, roll, 1.0)
