#!/usr/bin/env bash
# The SGLang-side GPU measurements of docs/performance.md ("Capture and record store"), in one run:
#   1. scheduler-thread time per finished 16K-token request (bench/sglang_finish.py, one request per result batch);
#   2. capture overhead at decode 64 under a CUDA graph and eagerly, and at prefill 8K, with the kernels capture
#      adds per forward, and the store copy as bytes vs 8-byte words (bench/capture.py);
#   3. the same overhead on TP rank 0 of 4 (its record shard, a quarter-wide expert GEMM);
#   4. which SGLang modules import on this host (bench/sglang_imports.py).
# Usage: bash bench/sglang_h200.sh OUT_DIR [PYTHON]   (each step bounded by `timeout`; a step that fails or runs
# out of time leaves its error in OUT_DIR/<step>.log and the next step still runs)
set -uo pipefail
OUT=${1:?usage: bench/sglang_h200.sh OUT_DIR [PYTHON]}
PY=${2:-python}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
timeout 30 "$PY" bench/sglang_finish.py --tokens 16384 --seam-stand-in --store-dir /dev/shm --batch 1 --requests 5 \
  >"$OUT/sglang_finish.jsonl" 2>"$OUT/sglang_finish.log"
echo "sglang_finish rc $?" >>"$OUT/steps.txt"
timeout 60 "$PY" bench/capture.py --parts graph,overhead,copy --out "$OUT/capture.json" >"$OUT/capture.txt" 2>"$OUT/capture.log"
echo "capture rc $?" >>"$OUT/steps.txt"
timeout 30 "$PY" bench/capture.py --parts overhead --tp-size 4 --iters 5 --repeats 3 --out "$OUT/capture_tp4.json" \
  >"$OUT/capture_tp4.txt" 2>"$OUT/capture_tp4.log"
echo "capture_tp4 rc $?" >>"$OUT/steps.txt"
timeout 15 "$PY" bench/sglang_imports.py >"$OUT/sglang_imports.txt" 2>"$OUT/sglang_imports.log"
echo "sglang_imports rc $?" >>"$OUT/steps.txt"
