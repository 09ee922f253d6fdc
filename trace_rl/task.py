"""Synthetic verifiable task: `a+b=` with `digits`-digit operands, answered least-significant digit first.

Token ids: digits 0-9, then `+`, `=`, EOS. Every prompt has the same length (operands are zero-padded), so a rollout
batch needs no padding. The reward is exact: 1 when the response is the reversed, zero-padded sum followed by EOS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLUS, EQUALS, EOS = 10, 11, 12
VOCAB = 16  # 13 used ids, rounded up


@dataclass(frozen=True)
class AdditionTask:
    digits: int = 2

    @property
    def prompt_len(self) -> int:
        return 2 * self.digits + 2

    @property
    def answer_len(self) -> int:
        """Answer digits plus EOS."""
        return self.digits + 2

    def sample(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` operand pairs `[n, 2]`."""
        return torch.randint(0, 10**self.digits, (n, 2), generator=generator)

    def _digits(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """Digits of `x [n]`, most significant first, `[n, width]`."""
        powers = 10 ** torch.arange(width - 1, -1, -1)
        return x[:, None] // powers % 10

    def prompts(self, operands: torch.Tensor) -> torch.Tensor:
        """Token ids `[n, prompt_len]` of `a+b=`."""
        n = operands.shape[0]
        a, b = self._digits(operands[:, 0], self.digits), self._digits(operands[:, 1], self.digits)
        return torch.cat([a, torch.full((n, 1), PLUS), b, torch.full((n, 1), EQUALS)], dim=1)

    def answers(self, operands: torch.Tensor) -> torch.Tensor:
        """Reference responses `[n, answer_len]`: the sum's digits reversed, then EOS."""
        total = self._digits(operands.sum(dim=1), self.digits + 1).flip(1)
        return torch.cat([total, torch.full((operands.shape[0], 1), EOS)], dim=1)

    def reward(self, operands: torch.Tensor, responses: list[torch.Tensor]) -> torch.Tensor:
        """1.0 for an exactly correct response (answer then EOS), else 0.0."""
        want = self.answers(operands)
        return torch.tensor([float(torch.equal(r.cpu(), w)) for r, w in zip(responses, want, strict=True)])
