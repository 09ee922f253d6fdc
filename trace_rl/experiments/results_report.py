"""Tables and plots of docs/results.md from the raw files `trace_rl.experiments.results` collects (OUT/raw).

    python -m trace_rl.experiments.results_report RAW_DIR DOCS_DIR

Writes DOCS_DIR/tables.md (every table of the page) and the PNG figures; numbers are computed here from the raw
per-step CSVs and analysis.json, never typed in.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from trace_rl.experiments.analysis import BITS, LAYER_SETS, ablation_specs, record_bytes
from trace_rl.experiments.report import FLIP, mean_or_nan
from trace_rl.warmup import PRESETS

RUN_LABELS = {
    "bf16": "BF16",
    "qat": "FP4 + QAT",
    "trace": "FP4 + TRACE (b=1, latter half)",
    "trace_full": "FP4 + TRACE (full information)",
    "trace_all": "FP4 + TRACE (b=1, all layers: the default)",
}
RUN_NAME = re.compile(
    r"(?P<run>[a-z_0-9]+?)(?:-(?P<recipe>[a-z0-9]+-[a-z0-9]+-[a-z0-9]+))?(?:-s(?P<seed>\d+))?(?:@(?P<tag>[a-z0-9]+))?"
)


def _match(name: str) -> re.Match:
    m = RUN_NAME.fullmatch(name)
    if m is None or m["run"] not in RUN_LABELS:
        raise ValueError(f"run {name!r} is not a run name of trace_rl.experiments.results")
    return m


def run_label(name: str) -> str:
    """`qat-mxfp4-w4a8-kv4-s1@ep2` -> `FP4 + QAT, mxfp4-w4a8-kv4, seed 1, ep2`
    (`trace_rl.experiments.results.run_names`)."""
    m = _match(name)
    parts = [RUN_LABELS[m["run"]]] + [m["recipe"]] * bool(m["recipe"]) + [f"seed {m['seed']}"] * bool(m["seed"])
    return ", ".join(parts + [m["tag"]] * bool(m["tag"]))


def _unseeded(name: str) -> str:
    """The run name without its seed: the name of its group over seeds."""
    m = _match(name)
    return m["run"] + f"-{m['recipe']}" * bool(m["recipe"]) + f"@{m['tag']}" * bool(m["tag"])


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


def _run_order(name: str) -> tuple:
    """Untagged runs of the default recipe first, then by tag and recipe; within one, by seed and then in
    `RUN_LABELS` order."""
    m = _match(name)
    return (m["tag"] or "", m["recipe"] or "", int(m["seed"] or 0), list(RUN_LABELS).index(m["run"]))


def rl_section(raw: Path, docs: Path) -> str:
    runs = {f.stem[3:]: _csv(f) for f in sorted(raw.glob("rl_*.csv"))}
    runs = dict(sorted(runs.items(), key=lambda kv: _run_order(kv[0])))
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
                run_label(name),
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
            ax.plot([m["step"] for m in hist], ys, label=run_label(name), lw=1)
        ax.set_title(title)
        ax.set_xlabel("RL step")
        if log:
            ax.set_yscale("log")
    axes[0, 0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(docs / "rl_mismatch.png", dpi=110)
    plt.close(fig)
    return "### RL runs\n\n" + _table(header, rows) + seeds_section(runs, docs) + layout_section(runs, docs)


SEED_COLUMNS = (  # (metric, its steps: None = all, k > 0 = the last k, 0 = the second half), label
    ("reward/mean", 10, "reward (last 10)"),
    ("reward/mean", 0, "reward (second half)"),
    ("train_rollout_logprob_abs_diff", None, "mean abs Δ logp"),
    ("train_rollout_k3_kl", None, "k3 KL"),
)


def _steps(values: list[float], tail: int | None) -> list[float]:
    return values if tail is None else values[-tail:] if tail else values[len(values) // 2 :]


def _mean_t95(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of its two-sided 95 % Student t-interval."""
    return mean_or_nan(values), _t95(len(values)) * statistics.stdev(values) / len(values) ** 0.5


def seeds_section(runs: dict[str, list[dict]], docs: Path) -> str:
    """Runs repeated over seeds: mean over seeds with a 95 % t-interval of the per-run values (table), and per step
    (figure `rl_seeds.png`, 10-step moving averages: the mean over seeds with the 95 % t-interval as a band for the
    reward, the range over seeds for the mismatch, on a log scale)."""
    by_seed: dict[str, dict[str | None, list[dict]]] = {}
    for name, hist in runs.items():
        by_seed.setdefault(_unseeded(name), {})[_match(name)["seed"]] = hist
    seeded = {base: runs for base, runs in by_seed.items() if len(runs) >= 2}
    if not seeded:
        return ""
    # the steps every run over seeds made (runs cut short by a time limit end at slightly different steps)
    n = min(len(h) for runs in seeded.values() for h in runs.values())
    groups = {base: [h[:n] for h in runs.values()] for base, runs in seeded.items()}
    rows = []
    for base, hists in groups.items():
        cells = [run_label(base), f"{len(hists)}", f"{len(hists[0])}"]
        for key, tail, _ in SEED_COLUMNS:
            mean, half = _mean_t95([mean_or_nan(_steps([m[key] for m in h if key in m], tail)) for h in hists])
            cells.append(f"{mean:.4g} ± {half:.2g}")
        rows.append(cells)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in (
        (axes[0], "reward/mean", "reward: mean over seeds, 95 % t-interval"),
        (axes[1], "train_rollout_logprob_abs_diff", "mean abs Δ logp: mean and range over seeds"),
    ):
        for base, hists in groups.items():
            n = len(hists[0])
            smooth = [[mean_or_nan([m[key] for m in h[max(0, i - 9) : i + 1]]) for i in range(n)] for h in hists]
            at = [[run[i] for run in smooth] for i in range(n)]
            (line,) = ax.plot(range(n), [mean_or_nan(v) for v in at], lw=1, label=run_label(base))
            if key == "reward/mean":
                low, high = zip(*((m - h, m + h) for m, h in map(_mean_t95, at)), strict=True)
            else:
                low, high = [min(v) for v in at], [max(v) for v in at]
            ax.fill_between(range(n), low, high, color=line.get_color(), alpha=0.2)
        ax.set_title(f"{title} (10-step moving average)", fontsize=9)
        ax.set_xlabel("RL step")
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(docs / "rl_seeds.png", dpi=110)
    plt.close(fig)
    header = ["run", "seeds", "steps"] + [label for *_, label in SEED_COLUMNS]
    table = "\n\nOver seeds (mean ± half-width of the 95 % t-interval over the runs):\n\n" + _table(header, rows)
    return table + windows_section(by_seed, n)


def windows_section(by_seed: dict[str, dict[str | None, list[dict]]], n: int) -> str:
    """Mean reward in four windows of the first `n` steps (n windows when n < 4): per run over seeds (mean ± 95 %
    t-interval of the per-run window means), a single-seed untagged run of the default recipe that made `n` steps
    (its value), and each run's difference to FP4 + QAT of the same recipe and tag, paired by seed (the same prompts
    at every step)."""
    k = min(4, n)
    edges = [n * i // k for i in range(k + 1)]
    spans = list(zip(edges, edges[1:], strict=False))

    def window_means(hist: list[dict]) -> list[float]:
        return [mean_or_nan([m["reward/mean"] for m in hist[a:b]]) for a, b in spans]

    def cells(values: list[list[float]], sign: str = "") -> list[str]:
        if len(values) == 1:
            return [f"{v:{sign}.3f}" for v in values[0]]
        return [f"{m:{sign}.3f} ± {h:.3f}" for m, h in (_mean_t95(list(w)) for w in zip(*values, strict=True))]

    rows = []
    for base, runs in by_seed.items():
        m = _match(base)
        if len(runs) >= 2 or (not m["recipe"] and not m["tag"] and len(next(iter(runs.values()))) >= n):
            label = run_label(base) + ("" if len(runs) >= 2 else " (one seed)")
            rows.append([label, f"{len(runs)}", *cells([window_means(h[:n]) for h in runs.values()])])
    for base, runs in by_seed.items():
        ref = by_seed.get(base.replace(_match(base)["run"], "qat", 1), {})
        seeds = [s for s in runs if s in ref]
        if _match(base)["run"] != "qat" and len(runs) >= 2 and len(seeds) >= 2:
            diffs = [
                [a - b for a, b in zip(window_means(runs[s][:n]), window_means(ref[s][:n]), strict=True)] for s in seeds
            ]
            rows.append([f"{run_label(base)} − FP4 + QAT, paired by seed", f"{len(seeds)}", *cells(diffs, "+")])
    header = ["run", "seeds"] + [f"reward, steps {a}–{b - 1}" for a, b in spans]
    return "\n\nReward by window of steps (mean ± half-width of the 95 % t-interval over seeds):\n\n" + _table(
        header, rows
    )


def _t95(n: int) -> float:
    """Two-sided 95 % Student t quantile with n - 1 degrees of freedom (n = 2..6)."""
    return {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571}[n]


LAYOUT_COLUMNS = (("train_rollout_logprob_abs_diff", ".5f"), ("train_rollout_k3_kl", ".2e"), ("reward/mean", ".3f"))


def layout_section(runs: dict[str, list[dict]], docs: Path) -> str:
    """Tagged runs (another trainer layout, a repeat) against the untagged run of the same name and seed, over the
    steps all of them made: per-run means, step 0 (same weights and seed: whether its mean reward and response
    length equal the reference's, a check that the runs sampled alike, not a proof of identical tokens) and the
    mean per-step distance of |Δ logp| to the reference run. The reference's other seeds are the scale of
    run-to-run noise. Figure `rl_layouts_<run>.png`."""
    out = []
    for ref in sorted({n.split("@")[0] for n in runs if "@" in n and n.split("@")[0] in runs}):
        others = [n for n in runs if _unseeded(n) == _unseeded(ref) and n != ref]  # other seeds, same run
        rows = [ref] + [n for n in runs if n.split("@")[0] == ref and n != ref] + others
        n = min(len(runs[r]) for r in rows)
        dlogp = "train_rollout_logprob_abs_diff"
        base = [m[dlogp] for m in runs[ref][:n]]
        table = []
        fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
        for r in rows:
            hist = runs[r][:n]
            first = runs[r][0]
            same = all(first[k] == runs[ref][0][k] for k in ("reward/mean", "rollout/response_len"))
            dist = mean_or_nan([abs(m[dlogp] - b) for m, b in zip(hist, base, strict=True)])
            step0 = [f"{first[dlogp]:.5f}", f"{first['train_rollout_k3_kl']:.2e}"]
            means = [f"{mean_or_nan([m[k] for m in hist]):{f}}" for k, f in LAYOUT_COLUMNS]
            table.append([run_label(r), f"{n}", "yes" if same else "no", *step0, *means, f"{dist:.2e}"])
            for ax, key in zip(axes, (dlogp, "train_rollout_k3_kl", "reward/mean"), strict=True):
                ax.plot([m["step"] for m in hist], [m[key] for m in hist], lw=1, label=run_label(r))
        for ax, title in zip(axes, ("mean abs Δ logp", "k3 KL", "reward"), strict=True):
            ax.set_title(title)
            ax.set_xlabel("RL step")
        axes[0].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(docs / f"rl_layouts_{ref}.png", dpi=110)
        plt.close(fig)
        header = ["run", "steps", "step 0: reward, length = first row's", "step 0: mean abs Δ logp", "step 0: k3 KL"]
        header += ["mean abs Δ logp", "k3 KL", "reward", "mean per-step distance of abs Δ logp to the first row"]
        out.append(_table(header, table))
    if not out:
        return ""
    return "\n\n### Trainer layouts and repeats (against the untagged run of the same seed)\n\n" + "\n\n".join(out)


def _config_mean(rows: list[dict], key: str) -> float:
    return mean_or_nan([r[key] for r in rows if key in r])


def analysis_section(raw: Path, docs: Path) -> str:
    payload = json.loads((raw / "analysis.json").read_text())
    results = [r for r in payload["results"] if r["batch"] >= 0]  # batch -1: the calibration of `flips`
    preset = PRESETS[json.loads((raw / "warmup.json").read_text())["preset"]]
    specs = ablation_specs(preset.layers)
    for r in results:  # earlier analyses stored no bytes: a fixed layer set's follow from its spec
        if "record_bytes_per_token" not in r and (r["config"] in specs or "/" not in r["config"]):
            r["record_bytes_per_token"] = record_bytes(preset, specs[r["config"]]) if "/" in r["config"] else 0.0
    excess = payload["relative_excess"]
    by_config = {c: [r for r in results if r["config"] == c] for c in dict.fromkeys(r["config"] for r in results)}
    rows = []
    for c, rs in by_config.items():
        per_row = [_flipmean_or_nan(r, ("moe_in", "k", "v")) for r in rs]
        flips = [f for f in per_row if f is not None]
        rows.append(
            [c, f"{len(rs)}", f"{_config_mean(rs, 'record_bytes_per_token'):.0f}"]
            + [fmt.format(_config_mean(rs, key)) for key, _, fmt in POLICY]
            + [f"{mean_or_nan(flips):.4f}" if flips else "—"]
        )
    header = ["config", "batches", "record bytes / token"] + [label for _, label, _ in POLICY]
    out = ["### Same-batch ablation (bits x captured layers)\n", _table(header + ["code flips (all sites)"], rows)]
    calib = [r for r in payload["results"] if r["batch"] < 0]
    chosen = next((r for r in results if r["config"] == "b1/flips"), None)
    if chosen is not None:
        out.append(
            f"\nLayer set `flips` (chosen on {len(calib)} calibration batch(es) by FP4 + QAT code-flip rate): MoE "
            f"layers {chosen['moe_layers']}, attention layers {chosen['attn_layers']}."
        )
    qat, bf16 = (_config_mean(by_config.get(c, []), "train_rollout_logprob_abs_diff") for c in ("qat", "bf16"))
    grid = []
    for which in LAYER_SETS:
        cells = [_config_mean(by_config.get(f"b{b}/{which}", []), "train_rollout_logprob_abs_diff") for b in BITS]
        if all(v != v for v in cells):
            continue
        sizes = [_config_mean(by_config[f"b{b}/{which}"], "record_bytes_per_token") for b in BITS]
        grid.append([which] + [f"{v:.5f}" for v in cells] + [", ".join(f"{x:.0f}" for x in sizes)])
    out += [
        f"\nMean abs Δ logp by bits x captured layers (FP4 + QAT: {qat:.5f}, BF16: {bf16:.5f}):\n",
        _table(["captured layers"] + [f"b = {b}" for b in BITS] + ["record bytes / token (b = 1, 2, 4)"], grid),
        pareto(by_config, docs),
    ]
    # Fig. 4b: relative excess discrepancy per layer
    shown = [c for c in ("qat", "b1/half", "b1/flips", "b1/all", "b4/all") if c in excess]
    layers = sorted({int(s[1 : s.index(".")]) for s in excess["qat"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    table = []
    for ax, kinds, title in ((axes[0], ("moe_in",), "MoE input"), (axes[1], ("k", "v"), "K and V")):
        for c in shown:
            ys = [mean_or_nan([excess[c][f"L{i}.{k}"] for k in kinds]) for i in layers]
            ax.plot(layers, ys, marker="o", ms=3, label=c)
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
        rs = by_config[c]
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


def pareto(by_config: dict[str, list[dict]], docs: Path) -> str:
    """`pareto.png`: mean abs Δ logp and k3 KL against record bytes per token for every TRACE configuration (QAT
    and BF16 as lines), and the table of the configurations no other beats in both mismatch and bytes."""
    trace = {c: rs for c, rs in by_config.items() if "/" in c}
    metrics = (("train_rollout_logprob_abs_diff", "mean abs Δ logp"), ("train_rollout_k3_kl", "k3 KL"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    markers = {b: m for b, m in zip(BITS, "o^s", strict=True)}
    colors = {which: f"C{i}" for i, which in enumerate(LAYER_SETS)}
    for ax, (key, label) in zip(axes, metrics, strict=True):
        for c, rs in trace.items():
            bits, which = c[1 : c.index("/")], c[c.index("/") + 1 :]
            x, y = _config_mean(rs, "record_bytes_per_token"), _config_mean(rs, key)
            ax.scatter(x, y, marker=markers[int(bits)], color=colors[which], label=c if key == metrics[0][0] else None)
        for ref, style in (("qat", "--"), ("bf16", ":")):
            if ref in by_config:
                ax.axhline(_config_mean(by_config[ref], key), ls=style, color="gray", label=ref.upper())
        ax.set_xlabel("record bytes / token")
        ax.set_ylabel(label)
        ax.set_yscale("log")
    axes[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(docs / "pareto.png", dpi=110)
    plt.close(fig)
    point = {
        c: (_config_mean(rs, "record_bytes_per_token"), _config_mean(rs, metrics[0][0])) for c, rs in trace.items()
    }

    def dominated(x: float, y: float) -> bool:
        return any(x2 <= x and y2 <= y and (x2, y2) != (x, y) for x2, y2 in point.values())

    front = sorted((c for c, xy in point.items() if not dominated(*xy)), key=lambda c: point[c][0])
    rows = [
        [c, f"{point[c][0]:.0f}", f"{point[c][1]:.5f}", f"{_config_mean(trace[c], metrics[1][0]):.2e}"] for c in front
    ]
    intro = "Pareto front (mean abs Δ logp against record bytes / token: no other configuration has both fewer bytes"
    return f"\n{intro} and less mismatch):\n\n" + _table(
        ["config", "record bytes / token", "mean abs Δ logp", "k3 KL"], rows
    )


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
    if not (args.raw / "warmup.json").exists():  # checked before anything is written
        raise FileNotFoundError(f"{args.raw} lacks warmup.json: run `python -m trace_rl.experiments.results run`")
    args.docs.mkdir(parents=True, exist_ok=True)
    warmup = json.loads((args.raw / "warmup.json").read_text())
    parts = [
        f"Model: preset `{warmup['preset']}`, {warmup['parameters'] / 1e6:.1f} M parameters, {warmup['digits']}-digit "
        f"addition, {warmup['steps']} warm-up steps, teacher-forced accuracy {warmup['teacher_forced_accuracy']:.3f}.",
    ]
    if any(args.raw.glob("rl_*.csv")):
        parts.append(rl_section(args.raw, args.docs))
    if (args.raw / "analysis.json").exists():
        parts.append(analysis_section(args.raw, args.docs))
    if any(args.raw.glob("timing_*.csv")):
        parts.append(timing_section(args.raw))
    (args.docs / "tables.md").write_text("\n\n".join(parts) + "\n")
    print((args.docs / "tables.md").read_text())


if __name__ == "__main__":
    main()
