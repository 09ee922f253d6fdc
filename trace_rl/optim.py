"""The trainers' learning-rate schedule: linear warm-up, then constant, linear or cosine decay to `min_lr_ratio` of
the peak (verl's `lr_warmup_steps`, `warmup_style` / `lr_scheduler_type` and `min_lr_ratio`; transformers'
`get_{constant,linear,cosine}_schedule_with_warmup` shapes). A pure function of the policy version (the number of
updates taken), so a resumed trainer is on the same schedule without saving any scheduler state."""

from __future__ import annotations

import math
from dataclasses import dataclass

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """`peak * factor(step)` is the learning rate of update `step` (0-based) of `total_steps`."""

    warmup_steps: int = 0
    style: str = "constant"
    total_steps: int = 1
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.style not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.style!r} is not one of {LR_SCHEDULES}")
        if self.warmup_steps < 0 or self.total_steps < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"lr schedule: warm-up {self.warmup_steps} must be >= 0, total steps {self.total_steps} >= 1, "
                f"min_lr_ratio {self.min_lr_ratio} in [0, 1]"
            )

    @property
    def is_constant(self) -> bool:
        """No warm-up and no decay: the optimizer's learning rate is never touched (today's trainer, exactly)."""
        return self.warmup_steps == 0 and self.style == "constant"

    def factor(self, step: int) -> float:
        """The multiple of the peak learning rate at update `step`: `(step + 1) / warmup_steps` during the warm-up
        (the first update already moves), then the decay over the remaining updates."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.style == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        shape = 1.0 - progress if self.style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape
