"""The small RL run the trainer tests compare trainers on: two `trace` steps of the tiny addition model (two prompts,
groups of four, four new tokens, the embedded rollout), rewarded by `varied_reward`."""

from __future__ import annotations

SMALL_RUN = dict(
    mode="trace",
    steps=2,
    prompts_per_step=2,
    group_size=4,
    max_new_tokens=4,
    rollout_workers=1,
    loggers="none",
    reward=f"{__name__}:varied_reward",
)


def varied_reward(response: str, answer: str | None, metadata: dict) -> float:
    """A reward that differs between the samples of a group (the barely trained model rarely gets an addition right,
    and equal rewards give zero advantages: no update to compare)."""
    return float(sum(map(ord, response)) % 3)
