"""The walk-through's reward (docs/rl.md, "Bring your own model and data"): `reward = "configs/byo_reward.py:score"`.

A shaped math reward: 1 for a correct boxed answer (Math-Verify, `trace_rl.rewards.math`), else partial credit for
the share of the response's characters that are digits. A random or barely trained model never boxes a correct
answer, so the math reward alone gives every sample of a group 0: zero variance, zero advantages, nothing trained.
The partial credit differs between samples, so GRPO has a signal from the first step."""

from __future__ import annotations

from trace_rl.rewards import math


def score(response: str, answer: str | None, metadata: dict) -> float:
    if math(response, answer, metadata):
        return 1.0
    return 0.5 * sum(c.isdigit() for c in response) / max(1, len(response))
