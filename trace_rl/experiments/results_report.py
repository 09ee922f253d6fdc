"""Tables and plots of docs/results.md from the raw files `trace_rl.experiments.results` collects (OUT/raw).

    python -m trace_rl.experiments.results_report RAW_DIR DOCS_DIR

Writes DOCS_DIR/tables.md (every table of the page) and the PNG figures; numbers are computed here from the raw
per-step CSVs and analysis.json, never typed in.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from trace_rl.experiments.analysis import BITS, LAYERS
from trace_rl.experiments.report import FLIP, mean_or_nan

RUN_LABELS = {
    "bf16": "BF16",
    "qat": "FP4 + QAT",
    "trace": "FP4 + TRACE (b=1, latter half)",
    "trace_full": "FP4 + TRACE (full information)",
}
COLORS = {name: f"C{i}" for i, name in enumerate(RUN_LABELS)}  # one color per run in every panel
POLICY = [
    ("train_rollout_logprob_abs_diff", "mean abs Δ logp", "{:.5f}"),
    ("train_rollout_logprob_diff_max", "Δ logp max", "{:.3f}"),
    ("train_rollout_logprob_diff_min", "Δ logp min", "{:.3f}"),
    ("train_rollout_k3_kl", "k3 KL", "{:.2e}"),
    ("train_rollout_extreme_token_frac_tau2", "F(τ=2)", "{:.2e}"),
]


def _csv(path: Path) -> list[dict[str, float | str]]:
    with open(path) as f:
        return [{k: _num(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def _num(v: str) -> float | str:
    try:
        return float(v)
    except ValueError:
        return v


def _flipmean_or_nan(row: dict, kinds: tuple[str, ...]) -> float | None:
    rates = [v for k, v in row.items() if (m := FLIP.fullmatch(k)) and m[2] in kinds]
    return mean_or_nan(rates) if rates else None


def _over_steps(key: str, values: list[float]) -> float:
    """A run's value of a per-step metric: the extreme for max / min, else the mean."""
    return max(values) if key.endswith("_max") else min(values) if key.endswith("_min") else mean_or_nan(values)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def rl_section(raw: Path, docs: Path) -> str:
    runs = {name: _csv(raw / f"rl_{name}.csv") for name in RUN_LABELS if (raw / f"rl_{name}.csv").exists()}
    rows = []
    for name, hist in runs.items():

        def col(key: str, hist: list[dict] = hist) -> list[float]:
            return [m[key] for m in hist if key in m]

        flips = [f for m in hist if (f := _flipmean_or_nan(m, ("moe_in",))) is not None]
        kv = [f for m in hist if (f := _flipmean_or_nan(m, ("k", "v"))) is not None]
        reward = col("reward/mean")
        policy = [fmt.format(_over_steps(key, col(key))) for key, _, fmt in POLICY]
        rows.append(
            [
                RUN_LABELS[name],
                f"{len(hist)}",
                f"{mean_or_nan(reward[:5]):.3f}",
                f"{mean_or_nan(reward[-10:]):.3f}",
                *policy,
            ]
            + [f"{mean_or_nan(flips):.4f}" if flips else "—", f"{mean_or_nan(kv):.4f}" if kv else "—"]
            + [f"{statistics.median(col('time/train_s')):.3f}"]
        )
    header = ["run", "steps", "reward (first 5)", "reward (last 10)"] + [label for _, label, _ in POLICY]
    header += ["code flips moe_in", "code flips k/v", "train s (median)"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    panels = [
        ("train_rollout_logprob_abs_diff", "mean abs Δ logp", True),
        ("train_rollout_k3_kl", "k3 KL", True),
        ("reward/mean", "reward", False),
        (None, "code-flip rate, moe_in (all layers)", False),
    ]
    for ax, (key, title, log) in zip(axes.flat, panels, strict=True):
        for name, hist in runs.items():
            if key is None:
                ys = [_flipmean_or_nan(m, ("moe_in",)) for m in hist]
                if all(y is None for y in ys):
                    continue
            else:
                ys = [m.get(key) for m in hist]
            ax.plot([m["step"] for m in hist], ys, label=RUN_LABELS[name], color=COLORS[name])
        ax.set_title(title)
        ax.set_xlabel("RL step")
        if log:
            ax.set_yscale("log")
    axes[0, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(docs / "rl_mismatch.png", dpi=110)
    plt.close(fig)
    return "### RL runs\n\n" + _table(header, rows)


def analysis_section(raw: Path, docs: Path) -> str:
    payload = json.loads((raw / "analysis.json").read_text())
    results, excess = payload["results"], payload["relative_excess"]
    configs = list(dict.fromkeys(r["config"] for r in results))
    rows = []
    for c in configs:
        rs = [r for r in results if r["config"] == c]
        per_row = [_flipmean_or_nan(r, ("moe_in", "k", "v")) for r in rs]
        flips = [f for f in per_row if f is not None]
        rows.append(
            [c, f"{len(rs)}"]
            + [fmt.format(mean_or_nan([r[key] for r in rs])) for key, _, fmt in POLICY]
            + [f"{mean_or_nan(flips):.4f}" if flips else "—"]
        )
    out = ["### Same-batch ablation (bits x captured layers)\n", _table(
        ["config", "batches"] + [label for _, label, _ in POLICY] + ["code flips (all sites)"], rows)]  # fmt: skip
    # Table 5 as a grid: |Δ logp| by bits x layers
    grid = []
    for which in LAYERS:
        cells = []
        for b in BITS:
            rs = [r["train_rollout_logprob_abs_diff"] for r in results if r["config"] == f"b{b}/{which}"]
            cells.append(f"{mean_or_nan(rs):.5f}")
        grid.append([which] + cells)
    qat = mean_or_nan([r["train_rollout_logprob_abs_diff"] for r in results if r["config"] == "qat"])
    bf16 = mean_or_nan([r["train_rollout_logprob_abs_diff"] for r in results if r["config"] == "bf16"])
    out += [
        f"\nMean abs Δ logp by bits x captured layers (FP4 + QAT: {qat:.5f}, BF16: {bf16:.5f}):\n",
        _table(["captured layers"] + [f"b = {b}" for b in BITS], grid),
    ]
    # Fig. 4b: relative excess discrepancy per layer
    shown = [c for c in ("qat", "b1/half", "b1/all", "b4/all") if c in excess]
    layers = sorted({int(s[1 : s.index(".")]) for s in excess["qat"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    table = []
    for ax, kinds, title in ((axes[0], ("moe_in",), "MoE input"), (axes[1], ("k", "v"), "K and V")):
        for c in shown:
            ys = [mean_or_nan([excess[c][f"L{i}.{k}"] for k in kinds]) for i in layers]
            ax.plot(layers, ys, marker="o", label=c)
        ax.set_yscale("symlog", linthresh=1)
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_title(f"relative excess discrepancy, {title}")
        ax.set_xlabel("layer")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(docs / "relative_excess.png", dpi=110)
    plt.close(fig)
    for i in layers:
        table.append([f"{i}"] + [f"{excess[c][f'L{i}.moe_in']:+.2f}" for c in shown])
    out += ["\nRelative excess discrepancy of the MoE input per layer, (D_FP4 - D_BF16) / D_BF16:\n",
            _table(["layer"] + shown, table)]  # fmt: skip
    # Fig. 6: codebook distance of mismatches
    fig, ax = plt.subplots(figsize=(6, 3.5))
    dist_rows = []
    for c in shown:
        rs = [r for r in results if r["config"] == c]
        counts = [sum(r.get(f"trace/flip_distance/{d}", 0.0) for r in rs) for d in range(1, 15)]
        total = sum(counts)
        if not total:
            continue
        frac = [x / total for x in counts]
        ax.plot(range(1, 15), frac, marker="o", label=c)
        dist_rows.append([c, f"{total:.0f}", *(f"{f:.3f}" for f in frac[:3]), f"{sum(frac[3:]):.3f}"])
    ax.set_yscale("log")
    ax.set_xlabel("distance on the signed E2M1 grid")
    ax.set_ylabel("fraction of code flips")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(docs / "flip_distance.png", dpi=110)
    plt.close(fig)
    out += ["\nCodebook distance of code flips (all sites):\n",
            _table(["config", "flips", "d = 1", "d = 2", "d = 3", "d ≥ 4"], dist_rows)]  # fmt: skip
    return "\n".join(out)


def timing_section(raw: Path) -> str:
    rows, medians = [], {}
    for name in ("qat", "trace"):
        files = sorted(raw.glob(f"timing_{name}*.csv"))
        hist = [m for f in files for m in _csv(f)[2:]]  # the first two steps warm up
        if not hist:
            continue
        medians[name] = {k: statistics.median(m[k] for m in hist) for k in ("time/step_s", "time/train_s")}
        m = medians[name]
        rows.append([name, f"{len(hist)}", f"{m['time/step_s']:.3f}", f"{m['time/train_s']:.3f}"])
    if len(medians) == 2:
        step = medians["trace"]["time/step_s"] / medians["qat"]["time/step_s"] - 1
        train = medians["trace"]["time/train_s"] / medians["qat"]["time/train_s"] - 1
        rows.append(["TRACE over QAT", "", f"{100 * step:+.1f} %", f"{100 * train:+.1f} %"])
    return "### Step time\n\n" + _table(["mode", "steps timed", "step s (median)", "train s (median)"], rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", type=Path, help="the raw/ directory `trace_rl.experiments.results run` wrote")
    ap.add_argument("docs", type=Path, help="where tables.md and the plots go")
    args = ap.parse_args(argv)
    missing = [name for name in ("warmup.json", "analysis.json") if not (args.raw / name).exists()]
    if missing:  # checked before anything is written
        raise FileNotFoundError(
            f"{args.raw} lacks {missing}: run `python -m trace_rl.experiments.results run` to completion"
        )
    args.docs.mkdir(parents=True, exist_ok=True)
    warmup = json.loads((args.raw / "warmup.json").read_text())
    parts = [
        f"Model: preset `{warmup['preset']}`, {warmup['parameters'] / 1e6:.1f} M parameters, {warmup['digits']}-digit "
        f"addition, {warmup['steps']} warm-up steps, teacher-forced accuracy {warmup['teacher_forced_accuracy']:.3f}.",
        rl_section(args.raw, args.docs),
        analysis_section(args.raw, args.docs),
        timing_section(args.raw),
    ]
    (args.docs / "tables.md").write_text("\n\n".join(parts) + "\n")
    print((args.docs / "tables.md").read_text())


if __name__ == "__main__":
    main()
