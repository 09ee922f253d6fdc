"""Numerics demo: how much FP4 amplifies a small train-rollout difference, and how much TRACE removes.

Synthetic MoE-input-like activations (Gaussian rows with a few outlier channels) play the rollout; the training
side sees the same activations after an engine-like perturbation (Gaussian noise of a few BF16 ulps of the row's RMS,
then a BF16 round, as a different GEMM accumulation order would give). For each format the table compares RTN (the
trainer quantizes on its own, vanilla QAT) with TRACE guided rounding at full information (b = 4) and b = 1, 2, 3:
code-flip rate, quantized discrepancy (paper Eq. 1), relative excess discrepancy (Fig. 4b) and the share of
mismatches one codebook entry apart (Fig. 6).

Run: python -m trace_core.demo [--tokens T] [--hidden D] [--noise ULPS] [--seed S]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from trace_core import metrics
from trace_core.numerics.guided import guided_quantize
from trace_core.numerics.quant import Quantized, dequantize, quantize

FORMATS: tuple[tuple[str, dict[str, bool]], ...] = (("nvfp4", {"per_token": True}), ("mxfp4", {}), ("kv_fp4", {}))
METHODS = ("RTN", "TRACE full", "TRACE b=1", "TRACE b=2", "TRACE b=3")


@dataclass(frozen=True)
class Row:
    """One line of the demo table."""

    fmt: str
    method: str
    flip_rate: float
    discrepancy: float
    relative_excess: float
    adjacent_share: float


def synthetic_pair(tokens: int, hidden: int, noise_ulps: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rollout, train) BF16 activations that differ by an engine-like relative perturbation."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    outliers = torch.randperm(hidden, generator=gen)[: max(1, hidden // 128)]
    x[:, outliers] *= 20.0
    rollout = x.to(torch.bfloat16)
    # GEMM accumulation-order differences scale with the row's magnitude, not with each element.
    row_rms = rollout.float().pow(2).mean(dim=-1, keepdim=True).sqrt()
    noise = torch.randn(tokens, hidden, generator=gen) * (noise_ulps * 2.0**-8) * row_rms
    train = (rollout.float() + noise).to(torch.bfloat16)
    return rollout, train


def _row(fmt: str, method: str, train_q: Quantized, roll_q: Quantized, d_bf16: float) -> Row:
    train_v, roll_v = dequantize(train_q), dequantize(roll_q)
    hist = metrics.codebook_distance_histogram(train_q.codes, roll_q.codes)
    mismatches = int(hist.sum())
    d_fp4 = metrics.mse(train_v, roll_v)
    return Row(
        fmt=fmt,
        method=method,
        flip_rate=metrics.code_flip_rate(train_q.codes, roll_q.codes),
        discrepancy=metrics.quantized_discrepancy(train_v, roll_v),
        relative_excess=(d_fp4 - d_bf16) / d_bf16,
        adjacent_share=float(hist[1]) / mismatches if mismatches else float("nan"),
    )


def run(tokens: int = 2048, hidden: int = 2048, noise_ulps: float = 4.0, seed: int = 0) -> list[Row]:
    """Compute the demo table."""
    rollout, train = synthetic_pair(tokens, hidden, noise_ulps, seed)
    d_bf16 = metrics.mse(train, rollout)
    rows = []
    for fmt, kwargs in FORMATS:
        roll_q = quantize(rollout, fmt, **kwargs)
        rows.append(_row(fmt, "RTN", quantize(train, fmt, **kwargs), roll_q, d_bf16))
        for bits, method in zip((4, 1, 2, 3), METHODS[1:], strict=True):
            guided, _ = guided_quantize(train, roll_q, bits)
            rows.append(_row(fmt, method, guided, roll_q, d_bf16))
    return rows


def format_table(rows: list[Row]) -> str:
    """Rows as a fixed-width text table."""
    head = (
        f"{'format':<8} {'method':<11} {'code-flip rate':>14} {'discrepancy':>12} {'rel. excess':>12} {'adjacent':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        adjacent = "-" if r.adjacent_share != r.adjacent_share else f"{100 * r.adjacent_share:8.2f}%"
        lines.append(
            f"{r.fmt:<8} {r.method:<11} {100 * r.flip_rate:13.4f}% {r.discrepancy:12.4f} "
            f"{r.relative_excess:12.3f} {adjacent:>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--noise", type=float, default=4.0, help="perturbation size in BF16 ulps of the row RMS")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = run(args.tokens, args.hidden, args.noise, args.seed)
    print(
        f"TRACE numerics demo: {args.tokens} tokens x {args.hidden} channels, train = rollout + noise of "
        f"{args.noise} BF16 ulp of the row RMS\n(code-flip: FP4 code differs from the rollout's; discrepancy: "
        f"paper Eq. 1; rel. excess: Fig. 4b; adjacent: share of mismatches one codebook entry apart, Fig. 6)\n"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()
