"""A patched SGLang 0.5.15.post1 server on the CPU: `python tests/sglang_cpu_server.py <launch_server flags>` runs
`python -m sglang.launch_server` with SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`), the start-up shims of
`tests/sglang_cpu_site/sitecustomize.py` in every server process, and the CPU flags below unless the caller sets
them. It is the server command the launcher's `trace_rl.servers.ServerGroup` takes as `command=` for the CPU runs of
the live RL loop (`scripts/run_live_h200.sh --cpu`, tests/rl/test_rl_live_cpu.py): the real server (HTTP, tokenizer
manager, scheduler, detokenizer, SGLang's Qwen3-MoE with TRACE's emulate hooks and FP4 KV pool, its weight-update
routes), only on CPU. No CUDA graphs, torch-native attention, no overlap scheduler, no memory saver (CUDA only)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SITE = HERE / "sglang_cpu_site"
COMMAND = [sys.executable, str(Path(__file__).resolve())]  # ServerGroup(cfg, command=COMMAND)
CPU_FLAGS = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--sampling-backend": "pytorch",
    "--grammar-backend": "none",
    "--max-total-tokens": "8192",
    "--max-running-requests": "64",
    "--page-size": "1",
    "--skip-server-warmup": None,
    # SGLang's own R3 capture (--enable-return-routed-experts, the bf16 runs) under the overlap scheduler hands each
    # forward's routes to the host through `managers/utils.py:_async_d2h`, which on CUDA copies them but on CPU
    # returns the tensor itself (`t.to("cpu")`): a view of the capture buffer that the next forward overwrites
    # before it is read, so the returned routes were wrong (layer 1 of the prompt, decode positions a step late).
    # Without the overlap scheduler they equal the model's own top-k (the HF model on the same tokens).
    "--disable-overlap-schedule": None,
}


def argv(args: list[str]) -> list[str]:
    """The launch_server command line: `args` plus every CPU flag they do not set."""
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    extra: list[str] = []
    for flag, value in CPU_FLAGS.items():
        if flag not in given:
            extra += [flag] if value is None else [flag, value]
    return [sys.executable, "-m", "sglang.launch_server", *args, *extra]


def main() -> None:
    path = os.pathsep.join([str(SITE), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": path}
    cmd = argv(sys.argv[1:])
    os.execve(cmd[0], cmd, env)


if __name__ == "__main__":
    main()
