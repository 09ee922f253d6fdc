"""Metrics files, plots and the side-by-side summary table of the modes."""

from __future__ import annotations

import csv
import io
import re
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

FLIP = re.compile(r"trace/L(\d+)\.(moe_in|k|v)/code_flip_rate")
MODE_LABELS = {"bf16": "BF16", "qat": "FP4 + QAT", "trace": "FP4 + TRACE"}


def mean_or_nan(values: list[float]) -> float:
    """Mean of a metric's values (NaN when it was never logged); shared with `trace_rl.experiments.results_report`."""
    return statistics.fmean(values) if values else float("nan")


def _sum(values: list[float]) -> float:
    return sum(values) if values else float("nan")


def write_csv(runs: dict[str, list[dict]], path: Path) -> None:
    """One row per (mode, step), the union of metric names as columns."""
    keys = sorted({k for hist in runs.values() for m in hist for k in m})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for hist in runs.values():
            w.writerows(hist)


def flip_rates(history: list[dict]) -> dict[str, float]:
    """Mean code-flip rate per site over the run."""
    sites: dict[str, list[float]] = {}
    for m in history:
        for k, v in m.items():
            hit = FLIP.fullmatch(k)
            if hit:
                sites.setdefault(f"L{hit[1]}.{hit[2]}", []).append(v)
    return {s: mean_or_nan(v) for s, v in sorted(sites.items())}


def summary(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per mode: means over all steps (reward over the last half too)."""
    out = {}
    for mode, hist in runs.items():

        def col(k: str, hist: list[dict] = hist) -> list[float]:
            return [m[k] for m in hist if k in m]

        flips = flip_rates(hist)
        out[mode] = {
            "reward (first step)": hist[0]["reward/mean"],
            "reward (last half)": mean_or_nan(col("reward/mean")[len(hist) // 2 :]),
            "|Δ logp| mean": mean_or_nan(col("train_rollout_logprob_abs_diff")),
            "Δ logp max": max(col("train_rollout_logprob_diff_max")),
            "Δ logp min": min(col("train_rollout_logprob_diff_min")),
            "k3 KL": mean_or_nan(col("train_rollout_k3_kl")),
            "F(τ=2)": mean_or_nan(col("train_rollout_extreme_token_frac_tau2")),
            "code flips moe_in": mean_or_nan([v for s, v in flips.items() if s.endswith("moe_in")]),
            "code flips k/v": mean_or_nan([v for s, v in flips.items() if not s.endswith("moe_in")]),
            "RTN fallback (real tokens)": _sum(col("trace/rtn_fallback_real_tokens")),
            "worker restarts": _sum(col("rollout/restarts")),
            "step time s": mean_or_nan(col("time/step_s")),
        }
    return out


def print_table(
    table: dict[str, dict[str, float]], console: Console | None = None, note: str = "", title: str | None = None
) -> str:
    """Print the summary (modes as columns, titled by them and `note`, after `title`, by default the embedded
    default's) and return it as plain text."""
    modes = list(table)
    head = "TRACE embedded default" if title is None else title
    t = Table(title=f"{head}: " + " vs ".join(MODE_LABELS.get(m, m) for m in modes) + note)
    t.add_column("metric")
    for mode in modes:
        t.add_column(mode, justify="right")
    for metric in table[modes[0]]:
        t.add_row(metric, *(_fmt(table[m][metric]) for m in modes))
    (console or Console()).print(t)
    plain = Console(width=120, record=True, file=io.StringIO())
    plain.print(t)
    return plain.export_text()


def _fmt(v: float) -> str:
    if v != v:
        return "—"
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def plot(runs: dict[str, list[dict]], out: Path) -> list[Path]:
    """PNG plots: log-prob diff max/min, reward, |Δ logp| mean per step; code-flip rate per layer and site."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for mode, hist in runs.items():
        steps = [m["step"] for m in hist]
        (line,) = axes[0].plot(steps, [m["train_rollout_logprob_diff_max"] for m in hist], label=f"{mode} max")
        axes[0].plot(steps, [m["train_rollout_logprob_diff_min"] for m in hist], "--", color=line.get_color())
        axes[1].plot(steps, [m["reward/mean"] for m in hist], label=mode)
        axes[2].plot(steps, [m["train_rollout_logprob_abs_diff"] for m in hist], label=mode)
    for ax, title in zip(axes, ("log-prob diff max (solid) / min (dashed)", "reward", "|Δ logp| mean"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    paths.append(out / "mismatch_reward.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    modes = [m for m in runs if flip_rates(runs[m])]
    sites = sorted({s for m in modes for s in flip_rates(runs[m])})
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        rates = flip_rates(runs[mode])
        ax.bar([j + i * width for j in range(len(sites))], [rates.get(s, 0.0) for s in sites], width, label=mode)
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(sites))], sites)
    ax.set_ylabel("code-flip rate (recorded bits)")
    ax.set_title("code-flip rate per layer and site")
    if modes:
        ax.legend()
    fig.tight_layout()
    paths.append(out / "code_flip_per_layer.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
