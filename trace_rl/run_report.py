"""`trace-rl report RUN_DIR [OUT]`: the side-by-side table (`summary.txt` / `summary.json`), `metrics.csv` and the
plots of any run directory, written to OUT (default RUN_DIR):

- a `trace-rl train` run (`RUN_DIR/metrics.jsonl`): that run, under its mode;
- a `trace-rl demo` directory (one `<mode>/metrics.jsonl` per mode): every mode side by side, as the demo printed;
- the raw directory of `trace-rl results run` (`warmup.json`): the tables and figures of docs/results.md
  (`trace_rl.experiments.results_report`; OUT default `RUN_DIR/../docs`)."""

from __future__ import annotations

import json
from pathlib import Path

from trace_rl.experiments.report import plot, print_table, summary, write_csv

METRICS = "metrics.jsonl"  # trace_rl.controller.METRICS (not imported: `trace-rl --help` stays light)


class ReportError(ValueError):
    """The directory is not a run directory, or its runs have no steps."""


def read_history(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def collect(run_dir: Path) -> dict[str, list[dict]]:
    """The runs of a train or demo directory by name (the mode of a train run, the subdirectory of a demo's)."""
    if (run_dir / METRICS).exists():
        history = read_history(run_dir / METRICS)
        return {history[0]["mode"] if history else run_dir.name: history}
    return {d.name: read_history(d / METRICS) for d in sorted(run_dir.iterdir()) if (d / METRICS).is_file()}


def report(run_dir: str | Path, out: str | Path | None = None) -> list[Path]:
    """Write the report of `run_dir` (see the module docstring) and return the files written."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory: give a run directory (the out_dir of train or demo)")
    if (run_dir / "warmup.json").exists():
        from trace_rl.experiments.results_report import main as results_report

        docs = Path(out) if out is not None else run_dir.parent / "docs"
        results_report([str(run_dir), str(docs)])
        return [docs / "tables.md"]
    runs = collect(run_dir)
    if not runs:
        raise ReportError(
            f"{run_dir} holds no {METRICS} (nor <mode>/{METRICS}, nor warmup.json): give a train or demo out_dir, or "
            "the raw/ directory of `trace-rl results run`"
        )
    empty = [name for name, history in runs.items() if not history]
    if empty:
        raise ReportError(f"{run_dir}: the runs {empty} have no step yet ({METRICS} is empty)")
    out = Path(out) if out is not None else run_dir
    out.mkdir(parents=True, exist_ok=True)
    write_csv(runs, out / "metrics.csv")
    table = summary(runs)
    (out / "summary.json").write_text(json.dumps(table, indent=1))
    (out / "summary.txt").write_text(print_table(table))
    return [out / "metrics.csv", out / "summary.json", out / "summary.txt", *plot(runs, out)]
