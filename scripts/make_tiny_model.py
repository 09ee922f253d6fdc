"""Build the embedded default model: a tiny Qwen3-MoE warmed up on multi-digit addition (see trace_rl/warmup.py)."""

import argparse
import json

from trace_rl.warmup import make_tiny_model

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out/tiny-model", help="output directory")
    ap.add_argument("--digits", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60, help="supervised warm-up steps")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(make_tiny_model(args.out, digits=args.digits, steps=args.steps, seed=args.seed), indent=1))
