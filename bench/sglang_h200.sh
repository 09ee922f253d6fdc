#!/usr/bin/env bash
# The SGLang-side GPU measurements of docs/performance.md ("Capture and record store"), in one run:
#   1. capture overhead at decode 64 under a CUDA graph and eagerly, and at prefill 8K: plain / captured pairs in
#      alternating order (median and quartiles), with the per-forward device time of the kernels capture adds or
#      replaces, and the store copy as bytes vs 8-byte words (bench/capture.py);
#   2. scheduler-thread time per finished 16K-token request (bench/sglang_finish.py, one request per result batch);
#   3. the same overhead on TP rank 0 of 4 (its record shard, a quarter-wide expert GEMM);
#   4. which SGLang modules import on this host (bench/sglang_imports.py).
# Usage: bash bench/sglang_h200.sh OUT_DIR [PYTHON]   (each step bounded by `timeout`; a step that fails or runs
# out of time leaves its error in <step>.log and the next step still runs). Every step's output and log, and
# steps.txt (each step's exit status), go into one archive, OUT_DIR/sglang_h200.tar.gz, written on exit even when
# the run is cut short: one file to fetch back from a machine that returns few.
set -uo pipefail
OUT=${1:?usage: bench/sglang_h200.sh OUT_DIR [PYTHON]}
PY=${2:-python}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
RUN=$(mktemp -d "$OUT/sglang_h200.XXXXXX")
trap 'tar -czf "$OUT/sglang_h200.tar.gz" -C "$RUN" . && rm -rf "$RUN"' EXIT
step() {  # step NAME SECONDS OUTFILE COMMAND...: run COMMAND, stdout to OUTFILE, stderr to NAME.log
  local name=$1 limit=$2 out=$3
  shift 3
  timeout "$limit" "$@" >"$RUN/$out" 2>"$RUN/$name.log"
  echo "$name rc $?" >>"$RUN/steps.txt"
}
step capture 60 capture.txt "$PY" bench/capture.py --parts graph,overhead,copy --iters 5 --repeats 20 \
  --profile-forwards 3 --out "$RUN/capture.json"
step sglang_finish 30 sglang_finish.jsonl "$PY" bench/sglang_finish.py --tokens 16384 \
  --store-dir /dev/shm --batch 1 --requests 5
step capture_tp4 30 capture_tp4.txt "$PY" bench/capture.py --parts overhead --tp-size 4 --iters 5 --repeats 10 \
  --profile-forwards 3 --out "$RUN/capture_tp4.json"
step sglang_imports 15 sglang_imports.txt "$PY" bench/sglang_imports.py
