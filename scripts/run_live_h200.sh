#!/usr/bin/env bash
# The RL loop on a live patched SGLang server on one GPU (docs/rl.md, "On a live server, one GPU"): bf16, qat and
# trace on the tiny addition task and on a small math JSONL, the server started by the launcher on GPU 0 beside the
# trainer (weights by CUDA IPC), then the same settings on the embedded engine; tables, step breakdown, the step-time
# overhead of trace over qat and the plots under OUT, rewritten after every run (trace_rl/experiments/live.py).
#
#   scripts/run_live_h200.sh OUT [--work DIR] [--steps 20] [--budget 540] [--tasks addition,math] [key=value ...]
#   scripts/run_live_h200.sh OUT --cpu [--steps 3]     # the CPU twin: the real SGLang server on CPU
#
# Needs SGLang 0.5.15.post1 with its GPU wheels, patched (`python3 scripts/sglang_patches.py apply`); builds the two
# tiny models if missing (out/tiny-model, out/tiny-hf). Uses .venv/bin/python if there, else python3 ($PYTHON wins).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} PYTHONUNBUFFERED=1
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: scripts/run_live_h200.sh OUT [--cpu] [options of python -m trace_rl.experiments.live]" >&2
    exit 2
fi
out=$1
shift
args=()
cpu=0
for a in "$@"; do
    if [ "$a" = --cpu ]; then cpu=1; else args+=("$a"); fi
done
[ -f out/tiny-hf/config.json ] || "$PY" -m tests.hf_tiny out/tiny-hf
if [ $cpu = 1 ]; then
    # the CPU twin: small batches, a few steps; later options (the caller's) win
    exec "$PY" -m trace_rl.experiments.live "$out" --device cpu --server-command "$PY tests/sglang_cpu_server.py" \
        --steps 3 --budget 3600 prompts_per_step=4 group_size=4 ${args[@]+"${args[@]}"}
fi
exec "$PY" -m trace_rl.experiments.live "$out" ${args[@]+"${args[@]}"}
