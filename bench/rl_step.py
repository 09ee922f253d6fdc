"""Where a step of the RL loop's CPU demo goes: `make demo`'s loop (embedded engine + Megatron trainer, tiny model)
timed per phase, for several code trees and OpenMP settings side by side in one run.

Each (variant, mode) runs in its own process: `--steps` steps of the loop (`trace_rl.controller.Controller`) with
the demo's config, the first `--skip` not counted. Reported per run: the median step time and its phases
(`time/rollout_s`, `time/train_s`, `time/sync_s` of the step's metrics), the process CPU time per step (every
thread: OpenMP workers spinning at a barrier count), and the mean |Δ logp| of the timed steps, which must be equal
across variants of one mode (the same seed gives the same numbers).

Usage: python bench/rl_step.py [--modes bf16,trace] [--steps 12] [--skip 2]
           [--code NAME=DIR ...]            a code tree per variant (default: this checkout)
           [--env NAME=VAR=VALUE,... ...]   environment per variant, e.g. passive=OMP_WAIT_POLICY=PASSIVE
           [--model out/tiny-model] [--out rl_step.json]
Variants are the product of `--code` and `--env` (with an unnamed default of each). Wall times on a shared machine
vary with its load; compare variants within one run (they alternate, `--rounds` times).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import write_json

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("time/step_s", "time/rollout_s", "time/train_s", "time/sync_s")
CHILD = (
    f"PHASES = {PHASES!r}\n"
    + """
import json, sys, time
from trace_rl.config import load_config
from trace_rl.controller import Controller
mode, steps, skip, model, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
cfg = load_config(None, [f"mode={mode}", f"model_dir={model}", f"out_dir={out}", f"steps={steps}",
                         f"checkpoint_every={steps}"])
ctrl = Controller(cfg, resume=False)
rows = []
for i in range(steps):
    cpu = time.process_time()
    m = ctrl.train_step()
    if i >= skip:
        dlogp = m["train_rollout_logprob_abs_diff"]
        rows.append({k: m.get(k, float("nan")) for k in PHASES} | {"cpu_s": time.process_time() - cpu, "dlogp": dlogp})
print("RESULT " + json.dumps(rows), flush=True)
getattr(ctrl, "close", lambda: None)()  # older trees have no close()
"""
)


def run_one(code: Path, env: dict[str, str], mode: str, args: argparse.Namespace) -> dict:
    """One (code tree, environment, mode) run in a fresh process; medians over its timed steps."""
    with tempfile.TemporaryDirectory() as tmp:
        child_env = {**os.environ, **env, "PYTHONPATH": str(code)}
        argv = [mode, str(args.steps), str(args.skip), str(Path(args.model).resolve()), tmp]
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, *argv], cwd=code, env=child_env, capture_output=True, text=True
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{mode} under {code} {env} failed:\n{proc.stderr[-3000:]}")
    rows = json.loads(lines[-1][len("RESULT ") :])
    out = {k: statistics.median(r[k] for r in rows) for k in (*PHASES, "cpu_s")}
    return out | {"dlogp": [r["dlogp"] for r in rows]}


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{what} {item!r}: use NAME=VALUE")
        out[name] = value
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="bf16,trace")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="first steps not timed (imports, first allocations)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the variants (alternating)")
    ap.add_argument("--code", action="append", default=[], metavar="NAME=DIR")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VAR=VALUE,...")
    ap.add_argument("--model", default="out/tiny-model", help="the demo's tiny model (`trace-rl make-model`)")
    ap.add_argument("--out", type=Path, help="JSON of every run")
    args = ap.parse_args(argv)
    if not (Path(args.model) / "megatron.pt").exists():
        raise SystemExit(f"{args.model} holds no tiny model; build it with `trace-rl make-model --out {args.model}`")
    codes = {k: Path(v).resolve() for k, v in _pairs(args.code, "--code").items()} or {"this": ROOT}
    envs = {"default": {}} | {
        name: dict(kv.split("=", 1) for kv in spec.split(",")) for name, spec in _pairs(args.env, "--env").items()
    }
    modes = args.modes.split(",")
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for mode in modes:
            for cname, code in codes.items():
                for ename, env in envs.items():
                    key = f"{mode} {cname} {ename}"
                    runs.setdefault(key, []).append(run_one(code, env, mode, args))
                    print(key, json.dumps(runs[key][-1]), flush=True)
    print(f"\n{'mode code env':32s} {'step s':>8s} {'rollout':>8s} {'train':>8s} {'sync':>8s} {'cpu s':>8s}  |Δ logp|")
    for key, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in (*PHASES, "cpu_s")}
        cells = " ".join(f"{med[k]:8.3f}" for k in (*PHASES, "cpu_s"))
        print(f"{key:32s} {cells}  {statistics.fmean(rs[0]['dlogp']):.6g}")
    write_json(args.out, runs)


if __name__ == "__main__":
    main()
