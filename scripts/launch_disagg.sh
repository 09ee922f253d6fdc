#!/usr/bin/env bash
# TRACE RL launcher.
#
#   scripts/launch_disagg.sh                      # embedded default: tiny Qwen3-MoE, modes bf16, qat, trace
#   RECIPE=mxfp4-w4a8-kv4 scripts/launch_disagg.sh  # the same under another precision recipe, into out/rl-<recipe>
#   scripts/launch_disagg.sh CONFIG [key=value]   # the same loop under a JSON / TOML / YAML RLConfig file
#
# With no arguments it builds the tiny model if needed (out/tiny-model), runs the RL loop in each mode (embedded
# rollout engine + Megatron trainer, CPU or one GPU) and writes out/rl/: metrics.csv, per-mode metrics.jsonl and
# checkpoints, PNG plots and the summary table. With a config, `use_ray = true` runs the rollout workers as Ray
# actors (on the cluster named by RAY_ADDRESS if set); `rollout_backend = "sglang"` with `sglang_urls` uses running
# patched SGLang servers as the rollout workers (one mode; see docs/deploy.md). See docs/rl.md. It runs
# `trace-rl demo` (the project's CLI; `trace-rl demo --help` lists every config key).
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE_RL=${TRACE_RL:-$( [ -x .venv/bin/trace-rl ] && echo .venv/bin/trace-rl || echo trace-rl )}
# torch's OpenMP threads sleep instead of spinning while they wait: on a CPU shared with other work, spinning
# threads stretch a demo step about ten times (bench/rl_step.py, docs/rl.md); the numbers do not change.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
if [ $# -eq 0 ]; then
    if [ -n "${RECIPE:-}" ]; then
        exec "$TRACE_RL" demo "recipe=$RECIPE" "out_dir=out/rl-$RECIPE"
    fi
    exec "$TRACE_RL" demo
fi
config=$1
shift
if [ ! -f "$config" ]; then
    echo "launch_disagg.sh: config file '$config' not found" >&2
    exit 2
fi
exec "$TRACE_RL" demo --config "$config" "$@"
