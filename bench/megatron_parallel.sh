#!/usr/bin/env bash
# Trainer layouts on one host with 2 GPUs: single GPU (twice: the second run with the micro-batches reversed is the
# noise floor; $REPEAT runs, default 2), then TP=2 (+SP), EP=2 (alltoall), PP=2 and DP=2 (distributed optimizer), or
# the layouts in $LAYOUTS, each for a few RL steps of the `small` preset in trace mode (bench/megatron_parallel.py); prints the table
# docs/megatron.md quotes.   [LAYOUTS="tp=2 ep=2"] [REPEAT=4] bench/megatron_parallel.sh OUT_DIR [args for megatron_parallel.py]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/megatron_parallel.sh OUT_DIR}
shift
mkdir -p "$out"
work=$(mktemp -d)
PY=${PYTHON:-python3}
run() {
    local n=$1 layout=$2
    shift 2
    "$PY" -m torch.distributed.run --nproc_per_node "$n" --master_port $((29500 + RANDOM % 1000)) \
        bench/megatron_parallel.py --layout "$layout" --work "$work" --out "$out/${layout//[=,]/_}" "$@" \
        > "$out/${layout//[=,]/_}.log" 2>&1 || { tail -n 40 "$out/${layout//[=,]/_}.log"; exit 1; }
}
# The table is rewritten after every layout: a run cut short by a time limit still leaves it for what finished.
run 1 single --repeat "${REPEAT:-2}" "$@"
"$PY" bench/megatron_parallel.py --summary "$out" > "$out/summary.md"
for layout in ${LAYOUTS:-tp=2 ep=2 pp=2 dp=2}; do
    run 2 "$layout" "$@"
    "$PY" bench/megatron_parallel.py --summary "$out" > "$out/summary.md"
done
cat "$out/summary.md"
