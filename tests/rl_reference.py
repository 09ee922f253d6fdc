"""Today's numbers of the small RL run (`tests.rl_small.SMALL_RUN`, tiny model warmed up 10 steps) at the default
algorithm settings, on the single-rank trainer and on the trainer group (DP = 2, two micro-batches per rank), as a
reference of `tests/data/rl_defaults_reference.json`: every metric of every step but the times, and the SHA-256 of
the final policy's HF tensors. `tests/rl/test_rl_algorithm.py` requires the current code to reproduce them bit for
bit, so a new algorithm setting at its default changes nothing.

Bit-exact CPU numbers depend on more than the code: MKL picks its kernels by CPU vendor, oneDNN its bf16 matmuls by
instruction set (AVX512-BF16 on AMD Zen 4, AMX on recent Xeons), torch its own kernels by CPU capability, and
reductions split by thread count. The run therefore always happens in a process started with `REPRODUCIBLE_ENV`
(MKL's conditional numerical reproducibility on its vendor-neutral branch, oneDNN capped below its bf16 kernels so
the bf16 matmuls take torch's own, torch's kernels at AVX2, one thread), so the numbers hold across x86-64 CPUs with
AVX2 for the torch build a reference names, except that CPUs with native BF16 arithmetic (`BF16_EXTENSIONS`) give
other bits: each reference names the torch build, the settings and those extensions of the CPU that recorded it
(`cpu`), and the file holds one per kind. To record one for another torch build or CPU kind, run this at commit
8d649f8 (the code before the settings existed) with this file copied in, and add its output to the file's
`references`:

    git worktree add /tmp/rl-ref 8d649f8 && cp tests/rl_reference.py /tmp/rl-ref/tests/ \\
        && cd /tmp/rl-ref && python -m tests.rl_reference OUT.json --layouts single group
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tests.rl_small import SMALL_RUN

GROUP = dict(dp=2, train_micro_batch=2)
LAYOUTS = {"single": {}, "group": GROUP}
REPRODUCIBLE_ENV = {
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "OMP_NUM_THREADS": "1",
}

RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
# CPU extensions with native BF16 arithmetic: with them the same torch build, under `REPRODUCIBLE_ENV`, gives other
# bits (seen on a Sapphire Rapids VM, which has both), so a reference names the ones its CPU had
BF16_EXTENSIONS = ("avx512_bf16", "amx_bf16")


def cpu_kind() -> list[str]:
    """The `BF16_EXTENSIONS` this CPU has (Linux's /proc/cpuinfo flags; none where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return [ext for ext in BF16_EXTENSIONS if ext in flags]


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

    cfg = RLConfig(model_dir=model_dir, out_dir=str(out_dir), **SMALL_RUN, **layout)
    with Controller(cfg, resume=False) as ctrl:
        history = ctrl.run()
        digest = weights_digest(ctrl.trainer.hf_weights())
    metrics = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in history]
    return {"metrics": metrics, "weights_sha256": digest}


def reproduce(out: Path, layouts: list[str], timeout: float) -> dict:
    """Run this script in a fresh process under `REPRODUCIBLE_ENV` (the libraries read it at start-up) and return
    what it wrote to `out`."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "tests.rl_reference", str(out), "--layouts", *layouts]
    # a rank of its own: not the rendezvous (MASTER_PORT, ...) a process group of the caller left in its environment
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV} | REPRODUCIBLE_ENV
    subprocess.run(cmd, cwd=root, env=env, check=True, timeout=timeout)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument(
        "--layouts",
        nargs="+",
        choices=sorted(LAYOUTS),
        default=["single"],
        help="the single-rank trainer and/or the trainer group (Ray, two gloo ranks)",
    )
    args = ap.parse_args()
    if any(os.environ.get(k) != v for k, v in REPRODUCIBLE_ENV.items()):
        os.execve(
            sys.executable, [sys.executable, "-m", "tests.rl_reference", *sys.argv[1:]], os.environ | REPRODUCIBLE_ENV
        )
    from trace_rl.warmup import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_tiny_model(model, steps=10)
        ref: dict = {
            "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "torch": torch.__version__,
            "env": REPRODUCIBLE_ENV,
            "cpu": cpu_kind(),
        }
        for layout in args.layouts:
            if layout == "group":
                import ray

                root = str(Path(__file__).resolve().parents[1])
                os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
                ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
            try:
                ref[layout] = run(str(model), str(Path(tmp) / layout), **LAYOUTS[layout])
            finally:
                if layout == "group":
                    ray.shutdown()
    args.out.write_text(json.dumps(ref, indent=1) + "\n")


if __name__ == "__main__":
    main()
