"""The measured results of docs/results.md: build the model, run the RL modes, the same-batch analyses and the step
timing, then write the raw metrics (CSV / JSON) that `trace_rl.experiments.results_report` turns into plots and tables.

    python -m trace_rl.experiments.results run OUT [--preset small] [--steps 40] [--device cuda]

Stages, all under OUT: `model/` (warm-up, `warmup.json`); `rl/<run>/` for the runs of `RUNS` (each its own process,
`--parallel` of them at a time: their per-step metrics are valid side by side, their wall times are not);
`analysis/analysis.json` (`trace_rl.experiments.analysis` on the warmed-up policy, in this process); `timing/` (qat
and the default TRACE alternating, `TIMING_ROUNDS` times, alone on the device: the step-time overhead). `raw/`
collects the small files; `python -m trace_rl.experiments.results_report OUT/raw DOCS` makes the tables and plots.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trace_core.numerics.recipe import DEFAULT_RECIPE, recipe_names
from trace_rl.controller import METRICS
from trace_rl.experiments.analysis import analyze, relative_excess
from trace_rl.experiments.report import write_csv
from trace_rl.task import AdditionTask
from trace_rl.warmup import make_tiny_model

# name -> config overrides on top of the shared ones; `measure_all_sites` makes the rollout keep whole codes at
# every site so code flips compare like with like across runs (the trainer still guides with its own spec). Each
# spec is spelled out, so a name keeps its meaning across default changes (the raw files of earlier rounds).
RUNS = {
    "bf16": ["mode=bf16"],
    "qat": ["mode=qat", "measure_all_sites=true"],
    "trace_full": ["mode=trace", "record_bits=4", "record_all_layers=true"],
    "trace": ["mode=trace", "record_all_layers=false", "measure_all_sites=true"],  # the paper's: b = 1, latter half
    "trace_all": ["mode=trace", "record_all_layers=true", "measure_all_sites=true"],  # the default: b = 1, all layers
}
DEFAULT_RUNS = ("bf16", "qat", "trace_full", "trace", "trace_all")
TIMING = {"qat": ["mode=qat"], "trace": ["mode=trace", "record_all_layers=false"]}  # as measured in docs/results.md
TAG = re.compile(r"[a-z0-9]+")
TIMING_ROUNDS = 2  # qat, trace, qat, trace: drift over the session hits both modes alike


def run_names(
    runs: list[str], recipes: list[str], seeds: list[int], seed: int = 0, tag: str = "", extra: Sequence[str] = ()
) -> dict[str, list[str]]:
    """Run name -> its overrides: each of `runs` under each recipe and seed, plus `extra`. The first recipe and the
    seed `seed` keep the plain name; others append `-<recipe>` / `-s<seed>`; a `tag` (runs of another trainer
    layout, a repeat) appends `@<tag>`. `bf16` has no recipe and runs under the first only."""
    if tag and not TAG.fullmatch(tag):
        raise ValueError(f"--tag {tag!r}: use lowercase letters and digits")
    out = {}
    for recipe in recipes:
        for s in seeds:
            for name in runs:
                if name == "bf16" and recipe != recipes[0]:
                    continue
                full = name + (f"-{recipe}" if recipe != recipes[0] else "") + (f"-s{s}" if s != seed else "")
                out[full + (f"@{tag}" if tag else "")] = [*RUNS[name], f"recipe={recipe}", f"seed={s}", *extra]
    return out


def _launch(run_dir: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    mode = next(o.split("=", 1)[1] for o in overrides if o.startswith("mode="))
    cmd = [sys.executable, "-m", "trace_rl.launch", "--modes", mode, f"out_dir={run_dir}", *overrides]
    # This process's rendezvous port (set by its own trainer set-up) must not leak into the run's.
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _wait(procs: dict[str, tuple[subprocess.Popen, Path]], deadline: float | None = None) -> None:
    """Wait for every run; at `deadline` (`time.monotonic()`) stop the ones still running (their per-step metrics,
    written as each step ends, are kept) and say which."""
    failed, stopped = [], []
    for name, (proc, log) in procs.items():
        try:
            code = proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            stopped.append(name)
            continue
        if code != 0:
            failed.append(name)
            print(f"--- {name} failed (exit {code}); end of {log}:\n" + log.read_text()[-3000:])
    if stopped:
        print(f"--rl-time-limit: stopped runs {stopped}, still running at the deadline", flush=True)
    if failed:
        raise RuntimeError(f"runs {failed} failed")


def run_all(args: argparse.Namespace) -> None:
    out = Path(args.out)
    model = Path(args.model) if args.model else out / "model"
    task = AdditionTask(args.digits)
    if not (model / "warmup.json").exists():
        summary = make_tiny_model(
            model,
            digits=args.digits,
            steps=args.warmup_steps,
            batch=args.warmup_batch,
            seed=args.seed,
            preset=args.preset,
            lr=args.warmup_lr,
            target_accuracy=args.target_accuracy,
            time_limit_s=args.warmup_time_limit,
        )
        print(json.dumps(summary), flush=True)

    def shared(steps: int) -> list[str]:
        """Overrides every run shares; one checkpoint, at the end."""
        return [
            f"model_dir={model}",
            f"device={args.device}",
            f"steps={steps}",
            f"lr={args.lr}",
            f"max_new_tokens={task.answer_len + 1}",
            "rollout_workers=1",
            f"checkpoint_every={steps}",
        ]

    unknown = [n for n in args.runs.split(",") if n and n not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown runs {unknown}; use a subset of {list(RUNS)}")
    recipes = args.recipes.split(",")
    seeds = [int(s) for s in args.rl_seeds.split(",")] if args.rl_seeds else [args.seed]
    names = [n for n in RUNS if n in args.runs.split(",")]
    named = run_names(names, recipes, seeds, args.seed, args.tag, args.set)
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    deadline = None if args.rl_time_limit is None else time.monotonic() + args.rl_time_limit
    for name, overrides in named.items():
        if len(procs) >= args.parallel:
            _wait({k: procs.pop(k) for k in list(procs)[:1]}, deadline)
        (out / "rl").mkdir(parents=True, exist_ok=True)
        log = out / "rl" / f"{name}.log"
        procs[name] = (_launch(out / "rl" / name, shared(args.steps) + overrides, log), log)
    try:
        if args.analysis_batches:

            def save(results: list[dict]) -> None:  # after every batch: a run cut short keeps what it measured
                payload = {"results": results, "relative_excess": relative_excess(results)}
                (out / "analysis" / "analysis.json").write_text(json.dumps(payload, indent=1))

            analyze(
                model,
                out / "analysis",
                batches=args.analysis_batches,
                max_new_tokens=task.answer_len + 1,
                seed=args.seed,
                device=args.device,
                on_batch=save,
            )
    except BaseException:
        for proc, _ in procs.values():  # no RL run outlives a failed driver
            proc.kill()
        raise
    _wait(procs, deadline)
    if args.timing_steps:
        for r in range(1, TIMING_ROUNDS + 1):
            for name, extra in TIMING.items():
                log = out / "timing" / f"{name}_r{r}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                _wait(
                    {
                        name: (
                            _launch(
                                out / "timing" / f"{name}_r{r}",
                                shared(args.timing_steps) + extra + [f"seed={args.seed}"],
                                log,
                            ),
                            log,
                        )
                    }
                )
    collect(out, model)


def collect(out: Path, model: Path | None = None) -> Path:
    """Copy the small result files (analysis, warm-up) into `out/raw`, and each run's per-step metrics (its
    `metrics.jsonl`, written every step, so a run cut short keeps the steps it made) as `<kind>_<run>.csv`."""
    raw = out / "raw"
    raw.mkdir(exist_ok=True)
    model = model or out / "model"
    pairs = [(model / "warmup.json", "warmup.json"), (out / "analysis" / "analysis.json", "analysis.json")]
    for src, name in pairs:
        if src.exists():
            shutil.copy(src, raw / name)
    for kind in ("rl", "timing"):
        for run in sorted((out / kind).glob(f"*/*/{METRICS}")) if (out / kind).exists() else []:
            history = [json.loads(line) for line in run.read_text().splitlines() if line.strip()]
            if history:
                write_csv({run.parent.name: history}, raw / f"{kind}_{run.parent.parent.name}.csv")
    return raw


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run"])
    ap.add_argument("out", help="output directory")
    ap.add_argument("--preset", default="small", help="model size (trace_rl.warmup.PRESETS)")
    ap.add_argument("--model", help="a warmed-up model directory to use (default: OUT/model, built if missing)")
    ap.add_argument("--warmup-time-limit", type=float, help="warm-up stops at a check after this many seconds")
    ap.add_argument("--digits", type=int, default=2, help="operand digits of the addition task")
    ap.add_argument("--warmup-steps", type=int, default=600, help="supervised warm-up steps at most")
    ap.add_argument("--warmup-batch", type=int, default=256, help="problems per warm-up step")
    ap.add_argument("--warmup-lr", type=float, default=5e-4, help="peak warm-up learning rate")
    ap.add_argument("--target-accuracy", type=float, default=0.5, help="warm-up stops at this accuracy")
    ap.add_argument("--steps", type=int, default=40, help="RL steps per run")
    ap.add_argument("--lr", type=float, default=2e-5, help="RL learning rate")
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    ap.add_argument("--recipes", default=DEFAULT_RECIPE, help=f"comma-separated precision recipes of {recipe_names()}")
    ap.add_argument("--rl-seeds", help="comma-separated seeds of the RL runs (default: --seed)")
    ap.add_argument("--parallel", type=int, default=4, help="RL runs at a time")
    ap.add_argument(
        "--rl-time-limit",
        type=float,
        help="seconds after which RL runs still running are stopped (they keep the steps they made)",
    )
    ap.add_argument("--tag", default="", help="suffix `@TAG` of the run names (runs with --set, repeats)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an RLConfig override of every RL run, e.g. the trainer layout: --set ep=2 --set dp=2 (repeatable)",
    )
    ap.add_argument("--analysis-batches", type=int, default=4, help="0 skips the analyses")
    ap.add_argument("--timing-steps", type=int, default=12, help="0 skips the timing runs")
    ap.add_argument("--device", default="cuda", help="cpu or cuda")
    ap.add_argument("--seed", type=int, default=0, help="seed of warm-up, prompts and sampling")
    run_all(ap.parse_args(argv))


if __name__ == "__main__":
    main()
