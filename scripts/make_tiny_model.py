"""Build a model of the RL loop (`--preset tiny`: the embedded default; `small`: the results model), warmed up on
multi-digit addition (see trace_rl/warmup.py)."""

import argparse
import json

from trace_rl.warmup import PRESETS, make_tiny_model

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out/tiny-model", help="output directory")
    ap.add_argument("--digits", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60, help="supervised warm-up steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size")
    ap.add_argument("--batch", type=int, default=128, help="problems per warm-up step")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak warm-up learning rate")
    ap.add_argument("--target-accuracy", type=float, default=None, help="stop once teacher-forced accuracy reaches it")
    args = ap.parse_args()
    summary = make_tiny_model(
        args.out,
        digits=args.digits,
        steps=args.steps,
        seed=args.seed,
        preset=args.preset,
        batch=args.batch,
        lr=args.lr,
        target_accuracy=args.target_accuracy,
    )
    print(json.dumps(summary, indent=1))
