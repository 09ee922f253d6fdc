#!/usr/bin/env bash
# TRACE RL launcher.
#
#   scripts/launch_disagg.sh                      # embedded default: tiny Qwen3-MoE, modes bf16, qat, trace
#   scripts/launch_disagg.sh CONFIG [key=value]   # the same loop under a JSON / TOML / YAML RLConfig file
#
# With no arguments it builds the tiny model if needed (out/tiny-model), runs the RL loop in each mode (embedded
# rollout engine + Megatron trainer, CPU or one GPU) and writes out/rl/: metrics.csv, per-mode metrics.jsonl and
# checkpoints, PNG plots and the summary table. With a config, `use_ray = true` runs the rollout workers as Ray
# actors (on the cluster named by RAY_ADDRESS if set); `rollout_backend = "sglang"` with `sglang_urls` uses running
# patched SGLang servers as the rollout workers (one mode; see docs/deploy.md). See docs/rl.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ $# -eq 0 ]; then
    exec "$PYTHON" -m trace_rl.launch
fi
config=$1
shift
if [ ! -f "$config" ]; then
    echo "launch_disagg.sh: config file '$config' not found" >&2
    exit 2
fi
exec "$PYTHON" -m trace_rl.launch --config "$config" "$@"
