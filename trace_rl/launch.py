"""Run the RL loop on the embedded default for each mode and compare them (what `make demo` runs).

    python -m trace_rl.launch [--config FILE] [--modes bf16,qat,trace] [key=value ...]

Builds the tiny model first if `model_dir` holds none. Writes, under `out_dir`: one run directory per mode
(metrics.jsonl, checkpoint, record store), metrics.csv, PNG plots and summary.txt / summary.json. With
`rollout_backend = "sglang"` one mode runs (the config's, or `--modes`) on the servers of `sglang_urls`, whose
`--trace-store` must be `<out_dir>/<mode>/records` (docs/deploy.md); with `sglang_launch = "local"` the launcher
starts those servers itself (`trace_rl.servers.ServerGroup`, logs in `<out_dir>/<mode>/servers/`; `"ray"`: as Ray
actors in a placement group, `trace_rl.ray_servers.RayServerGroup`), restarts one that dies (`sglang_max_restarts`)
and stops them at the end. With `fp4_attention = "decode"` the FP4 modes run (qat, trace): the BF16 baseline has no
FP4 KV cache.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trace_core.modes import FP4_MODES
from trace_rl.config import MODES, ConfigError, load_config
from trace_rl.controller import Controller
from trace_rl.experiments.report import plot, print_table, summary, write_csv
from trace_rl.servers import ServerGroup
from trace_rl.warmup import MEGATRON_STATE, make_tiny_model


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="JSON, TOML or YAML file of trace_rl.config.RLConfig fields")
    ap.add_argument(
        "--modes",
        help=f"comma-separated modes to run side by side (default {','.join(MODES)}; the config's mode with sglang; "
        f"{','.join(FP4_MODES)} with fp4_attention)",
    )
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)
    base = load_config(args.config, args.overrides)
    sglang = base.rollout_backend == "sglang"
    fp4_attention = base.fp4_attention != "off"
    default = base.mode if sglang else ",".join(FP4_MODES if fp4_attention else MODES)
    spec = args.modes if args.modes is not None else default
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"--modes {spec!r}: use a comma-separated subset of {MODES}")
    if sglang and len(modes) != 1:
        raise ConfigError(
            f"--modes {spec!r}: rollout_backend='sglang' runs one mode (the servers' --trace-store is that run's "
            "record store); run the modes one after another"
        )
    if fp4_attention and "bf16" in modes:
        raise ConfigError(
            f"--modes {spec!r}: fp4_attention={base.fp4_attention!r} is for the FP4 modes, and bf16 is the BF16 "
            f"baseline (its KV cache is not FP4); run --modes {','.join(FP4_MODES)}"
        )
    if not any((Path(base.model_dir) / name).exists() for name in (MEGATRON_STATE, "config.json")):
        print(f"building the tiny model in {base.model_dir}")
        print(json.dumps(make_tiny_model(base.model_dir, seed=base.seed), indent=1))
    out = Path(base.out_dir)
    runs = {}
    for mode in modes:
        cfg = base.replace(mode=mode, out_dir=str(out / mode))
        if cfg.sglang_launch != "off":  # start the servers, run on them, tear them down (also on error / signal)
            if cfg.sglang_launch == "ray" and cfg.sglang_url_list():
                raise ConfigError(f"sglang_urls={cfg.sglang_urls!r} with sglang_launch='ray': the launcher sets them")
            group: ServerGroup
            if cfg.sglang_launch == "ray":
                from trace_rl.ray_servers import RayServerGroup

                group = RayServerGroup(cfg)
            else:
                group = ServerGroup(cfg)
            with group:
                print(f"SGLang servers up: {', '.join(group.urls)} (logs in {Path(cfg.out_dir) / 'servers'})")
                with Controller(cfg.replace(sglang_urls=",".join(group.urls)), servers=group) as ctrl:
                    runs[mode] = ctrl.run(desc=mode)
            continue
        with Controller(cfg) as ctrl:
            runs[mode] = ctrl.run(desc=mode)
    write_csv(runs, out / "metrics.csv")
    table = summary(runs)
    (out / "summary.json").write_text(json.dumps(table, indent=1))
    note = ", decode attention from the FP4 KV pool" if fp4_attention else ""
    (out / "summary.txt").write_text(print_table(table, note=note))
    for path in plot(runs, out):
        print(f"wrote {path}")
    return table


if __name__ == "__main__":
    main()
