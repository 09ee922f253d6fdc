"""Today's numbers of the small RL run (`tests.rl_small.SMALL_RUN`, tiny model warmed up 10 steps) at the default
algorithm settings, on the single-rank trainer and on the trainer group (DP = 2, two micro-batches per rank), as
`tests/data/rl_defaults_reference.json`: every metric of every step but the times, and the SHA-256 of the final
policy's HF tensors. `tests/rl/test_rl_algorithm.py` requires the current code to reproduce them bit for bit, so a new
algorithm setting at its default changes nothing. Bit-exact numbers hold for one torch build on one CPU kind: the
file records both (`torch`, `cpu_capability`) and the test is skipped, saying why, elsewhere. To record them for
another machine, run this at commit 8d649f8 (the code before the settings existed, plus this script):

    git worktree add /tmp/rl-ref 8d649f8 && cd /tmp/rl-ref && python -m tests.rl_reference OUT.json --group
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from tests.rl_small import SMALL_RUN

GROUP = dict(dp=2, train_micro_batch=2)


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors' names and bytes, in name order."""
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(k.encode())
        h.update(weights[k].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run(model_dir: str, out_dir: str, **layout) -> dict:
    """The run's metrics (times dropped) and final-policy digest."""
    from trace_rl.config import RLConfig
    from trace_rl.controller import Controller

    cfg = RLConfig(model_dir=model_dir, out_dir=out_dir, **SMALL_RUN, **layout)
    with Controller(cfg, resume=False) as ctrl:
        history = ctrl.run()
        digest = weights_digest(ctrl.trainer.hf_weights())
    metrics = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in history]
    return {"metrics": metrics, "weights_sha256": digest}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--group", action="store_true", help="also the trainer group (Ray, two gloo ranks)")
    args = ap.parse_args()
    from trace_rl.warmup import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_tiny_model(model, steps=10)
        ref = {
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "single": run(str(model), str(Path(tmp) / "single")),
        }
        if args.group:
            import ray

            root = str(Path(__file__).resolve().parents[1])
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
            ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
            try:
                ref["group"] = run(str(model), str(Path(tmp) / "group"), **GROUP)
            finally:
                ray.shutdown()
    args.out.write_text(json.dumps(ref, indent=1) + "\n")


if __name__ == "__main__":
    main()
