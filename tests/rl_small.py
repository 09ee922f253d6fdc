"""The small RL run the trainer tests compare trainers on: two `trace` steps of the tiny addition model (two prompts,
groups of four, four new tokens, the embedded rollout), rewarded by `varied_reward`; and what the tests of a refused
step use on either trainer (`trainer_state`, `overflow_gradient`)."""

from __future__ import annotations

import torch

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


def trainer_state(trainer) -> list[torch.Tensor]:
    """Copies of a trainer rank's parameters, FP32 masters, AdamW moments and Adam step, in a fixed order (from
    either optimizer, `megatron_trace.checkpoint.adam_state`: collective for Megatron's distributed optimizer)."""
    from megatron_trace.checkpoint import adam_state  # not at the top: reward workers import this module

    master, moments, step = adam_state(trainer.params, trainer.opt)
    tensors = (*trainer.params, *master, *(m for ms in moments.values() for m in ms))
    return [t.detach().clone() for t in tensors] + [torch.tensor(step)]


def overflow_gradient(p: torch.Tensor) -> None:
    """A post-accumulate-grad hook that turns the first element of `p`'s accumulated gradient into inf, as an
    overflow in the backward would."""
    p.grad.view(-1)[0] = torch.inf
