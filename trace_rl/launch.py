"""Run the RL loop on the embedded default for each mode and compare them (what `make demo` runs).

    python -m trace_rl.launch [--config FILE] [--modes bf16,qat,trace] [key=value ...]

Builds the tiny model first if `model_dir` holds none. Writes, under `out_dir`: one run directory per mode
(metrics.jsonl, checkpoint, record store), metrics.csv, PNG plots and summary.txt / summary.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trace_rl.config import MODES, ConfigError, load_config
from trace_rl.controller import Controller
from trace_rl.report import plot, print_table, summary, write_csv
from trace_rl.warmup import MEGATRON_STATE, make_tiny_model


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="JSON or TOML file of trace_rl.config.RLConfig fields")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run side by side")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    base = load_config(args.config, args.overrides)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"--modes {args.modes!r}: use a comma-separated subset of {MODES}")
    if not (Path(base.model_dir) / MEGATRON_STATE).exists():
        print(f"building the tiny model in {base.model_dir}")
        print(json.dumps(make_tiny_model(base.model_dir, seed=base.seed), indent=1))
    out = Path(base.out_dir)
    runs = {}
    for mode in modes:
        cfg = base.replace(mode=mode, out_dir=str(out / mode))
        runs[mode] = Controller(cfg).run(desc=mode)
    write_csv(runs, out / "metrics.csv")
    table = summary(runs)
    (out / "summary.json").write_text(json.dumps(table, indent=1))
    (out / "summary.txt").write_text(print_table(table))
    for path in plot(runs, out):
        print(f"wrote {path}")
    return table


if __name__ == "__main__":
    main()
