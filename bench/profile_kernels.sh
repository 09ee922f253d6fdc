#!/usr/bin/env bash
# Nsight Compute profile of the FP4 Triton kernels on a CUDA GPU (T = 65536, D = 4096 or $D, BF16, b = 1).
# Usage: [D=7168] bash bench/profile_kernels.sh OUT_DIR [PYTHON]
# Writes OUT_DIR/kernels.ncu-rep, OUT_DIR/details.csv (every metric of the lean section set), OUT_DIR/summary.txt
# (per kernel: duration, DRAM throughput and bytes, SM / issue activity, occupancy, registers, stall reasons),
# OUT_DIR/source.csv (the SASS source page: per instruction, executions and sampled stall reasons) and
# OUT_DIR/source_summary.txt (per kernel: executions and stall samples by opcode, global loads / stores and their L2
# sectors; with the default SKIP the record kernel [0] or [1] against its kernel without the record [2] or [3]).
# Cases, profiled in this order (report IDs 0..5) after one warm-up launch each (--launch-skip 6): quantize-and-record
# nvfp4 per-token b=1, kv_fp4 b=1, nvfp4 per-token without record, kv_fp4 without record, RTN fake-quant (nvfp4
# per-token), guided fake-quant (nvfp4 per-token record, b=1). SECTIONS="--set full" profiles every section.
set -uo pipefail
OUT=${1:?usage: bench/profile_kernels.sh OUT_DIR [PYTHON]}
PY=${2:-python}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
if ! command -v ncu >/dev/null; then
  echo "profile_kernels: ncu (Nsight Compute) is not on PATH; nothing profiled." | tee "$OUT/summary.txt"
  exit 0
fi
DRIVER="$OUT/driver.py"
cat >"$DRIVER" <<'PY'
import os

import torch

from trace_core.numerics.formats import get_format
from trace_core.numerics.guided import GuidanceStats
from trace_core.kernels import guided_fake_quant, kernel_rtn_fake_quant, quantize_record, record_buffers
from trace_core.records.spec import Record

t, d = 65536, int(os.environ.get("D", "4096"))
x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(x)
low, scales, token = record_buffers(t, d, "nvfp4", 1, "cuda", per_token=True)
kv_low, kv_scales, _ = record_buffers(t, d, "kv_fp4", 1, "cuda")
rec = Record(fmt=get_format("nvfp4"), bits=1, n=d, low_bits=low, scales=scales, global_scale=token)
stats = GuidanceStats()
cases = {  # one matching kernel launch each, in this order
    "quant_record_nvfp4_per_token_b1": lambda: quantize_record(
        x, "nvfp4", 1, per_token=True, out=out, low_bits=low, scales=scales, token_scale=token),
    "quant_record_kv_fp4_b1": lambda: quantize_record(x, "kv_fp4", 1, out=out, low_bits=kv_low, scales=kv_scales),
    "quant_no_record_nvfp4_per_token": lambda: quantize_record(x, "nvfp4", 1, per_token=True, out=out),
    "quant_no_record_kv_fp4": lambda: quantize_record(x, "kv_fp4", 1, out=out),
    "rtn_fake_quant_nvfp4_per_token": lambda: kernel_rtn_fake_quant(x, "nvfp4", per_token=True),
    "guided_nvfp4_b1": lambda: guided_fake_quant(x, rec, 1, stats=stats),
}
for phase in ("warm-up", "profiled"):  # ncu skips the warm-up launches (compilation, first touch)
    for i, (name, fn) in enumerate(cases.items()):
        fn()
        torch.cuda.synchronize()
        print(f"{phase} launch {i}: {name}", flush=True)
PY
REGEX='regex:_quantize_record|_guided'  # the group- and block-per-thread kernels
# Lean section set (about 30 s at T = 65536 on an H200); pass SECTIONS="--set full" in the environment for everything.
SECTIONS=${SECTIONS:-"--section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section Occupancy --section WarpStateStats --section InstructionStats --section LaunchStats --section SchedulerStats \
  --section SourceCounters"}
# DRAM bytes (any write amplification of the record's small stores shows here) and the stall reasons per issue
STALLS="long_scoreboard lg_throttle drain mio_throttle wait math_pipe_throttle not_selected short_scoreboard \
  no_instruction barrier membar dispatch_stall imc_miss branch_resolving misc selected"
METRICS="dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_read.sum"
for s in $STALLS; do METRICS="$METRICS,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"; done
# shellcheck disable=SC2086
# SKIP / COUNT (default 6 / 6: every profiled launch) pick a range of the 12 launches, e.g. SKIP=7 COUNT=1: kv_fp4 with
# the record only
if ! ncu --clock-control none -k "$REGEX" --launch-skip "${SKIP:-6}" --launch-count "${COUNT:-6}" $SECTIONS \
     --metrics "$METRICS" -f \
     -o "$OUT/kernels" \
     env PYTHONPATH=".:${PYTHONPATH:-}" "$PY" "$DRIVER" >"$OUT/ncu.log" 2>&1; then
  if grep -qiE "ERR_NVGPUCTRPERM|permission|not supported|counters" "$OUT/ncu.log"; then
    echo "profile_kernels: ncu could not read GPU performance counters (see $OUT/ncu.log);" \
         "run as root or enable NVreg_RestrictProfilingToAdminUsers=0. Nothing profiled." | tee "$OUT/summary.txt"
    exit 0
  fi
  echo "profile_kernels: ncu failed, see $OUT/ncu.log" | tee "$OUT/summary.txt"
  tail -20 "$OUT/ncu.log"
  exit 0
fi
if [ ! -f "$OUT/kernels.ncu-rep" ]; then
  echo "profile_kernels: ncu wrote no report (counters unavailable?), see $OUT/ncu.log" | tee "$OUT/summary.txt"
  exit 0
fi
ncu --import "$OUT/kernels.ncu-rep" --page details --csv >"$OUT/details.csv" 2>>"$OUT/ncu.log"
"$PY" - "$OUT/details.csv" >"$OUT/summary.txt" <<'PY'
import csv
import sys
from collections import defaultdict

wanted = ("Duration", "DRAM Throughput", "Memory Throughput", "Compute (SM) Throughput", "Executed Ipc Active",
          "Issue Slots Busy", "Achieved Occupancy", "Registers Per Thread", "Executed Instructions",
          "Shared Memory Configuration Size", "Block Size", "Grid Size", "Warp Cycles Per Issued Instruction")
rows = defaultdict(dict)
with open(sys.argv[1]) as f:
    for r in csv.DictReader(f):
        key = (r.get("ID"), r.get("Kernel Name", "")[:40])
        name = r.get("Metric Name", "")
        if name in wanted or name.startswith(("dram__", "lts__", "smsp__average_warps_issue_stalled")):
            rows[key][name] = f'{r["Metric Value"]} {r.get("Metric Unit", "")}'.strip()
for (kid, name), m in rows.items():
    print(f"[{kid}] {name}")
    for k in wanted:
        if k in m:
            print(f"    {k:<36} {m[k]}")
    for k in sorted(k for k in m if k not in wanted):  # raw counters: bytes, sectors, stalls per issued instr.
        short = k.replace("smsp__average_warps_issue_stalled_", "stall ").replace("_per_issue_active.ratio", "")
        print(f"    {short:<36} {m[k]}")
PY
grep "^profiled" "$OUT/ncu.log" >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
# Per SASS instruction (stall samples need the SourceCounters section): where the instructions and the stalls are
ncu --import "$OUT/kernels.ncu-rep" --page source --csv --print-source sass >"$OUT/source.csv" 2>>"$OUT/ncu.log"
"$PY" - "$OUT/source.csv" "${SKIP:-6}" >"$OUT/source_summary.txt" <<'PY'
import csv
import re
import sys
from collections import defaultdict


def num(s: str) -> float:
    try:
        return float((s or "").replace(",", ""))
    except ValueError:
        return 0.0


kernels = []  # per kernel: opcode -> executed warp instructions, stall samples, samples by reason; global accesses
with open(sys.argv[1]) as f:
    for row in csv.reader(f):
        if row and row[0] == "Kernel Name":
            header = None
            kernels.append((defaultdict(float), defaultdict(float), defaultdict(float), defaultdict(lambda: [0.0] * 3)))
        elif row and row[0] == "Address":
            header = row
        elif row and kernels and header:
            r = dict(zip(header, row, strict=False))
            m = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", r["Source"])
            op = m.group(1).split(".")[0] if m else "?"
            inst, samples, reasons, mem = kernels[-1]
            inst[op] += num(r["Instructions Executed"])
            samples[op] += num(r["Warp Stall Sampling (All Samples)"])
            for k in header:
                if k.startswith("stall_") and "Not Issued" not in k:
                    reasons[k[6:]] += num(r[k])
            if r.get("Address Space", "").strip() == "Global":
                acc = mem[f"{op} {r.get('Access Size', '').strip()} bit"]
                for i, k in enumerate(
                    ("Instructions Executed", "L1 Tag Requests Global", "L2 Theoretical Sectors Global")
                ):
                    acc[i] += num(r[k])
for kid, (inst, samples, reasons, mem) in enumerate(kernels):
    ti, ts = sum(inst.values()), sum(samples.values()) or 1
    print(f"[{kid}] {ti / 1e6:.1f} M warp instructions executed, {ts:.0f} stall samples")
    print(
        "    stall samples by reason: "
        + ", ".join(
            f"{k} {100 * v / ts:.1f} %" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]) if v >= 0.005 * ts
        )
    )
    print(f"    {'opcode':<8} {'M inst':>7} {'% inst':>7} {'% samples':>9}")
    for op in sorted(inst, key=lambda o: -inst[o])[:16]:
        print(f"    {op:<8} {inst[op] / 1e6:7.2f} {100 * inst[op] / ti:6.1f} % {100 * samples[op] / ts:8.1f} %")
    print(f"    {'global access':<16} {'M inst':>7} {'M L1 requests':>13} {'M L2 sectors':>12}")
    for k, (n, req, sec) in sorted(mem.items()):
        print(f"    {k:<16} {n / 1e6:7.2f} {req / 1e6:13.2f} {sec / 1e6:12.2f}")
if sys.argv[2] == "6":  # launches 6, 7, 8, 9: records [0] nvfp4, [1] kv_fp4; [2], [3] the same without the record
    for rec, plain in ((0, 2), (1, 3)):
        if plain >= len(kernels):
            continue
        (i0, s0, q0, _), (i1, s1, q1, _) = kernels[rec], kernels[plain]
        print(
            f"[{rec}] - [{plain}]: stall samples {sum(s0.values()) - sum(s1.values()):+.0f}, by reason: "
            + ", ".join(
                f"{k} {q0[k] - q1[k]:+.0f}"
                for k in sorted(q0, key=lambda k: (-abs(q0[k] - q1[k]), k))
                if abs(q0[k] - q1[k]) >= 100
            )
        )
        print(
            "    warp instructions (M) by opcode: "
            + ", ".join(
                f"{o} {(i0[o] - i1[o]) / 1e6:+.2f}"
                for o in sorted(set(i0) | set(i1), key=lambda o: (-abs(i0[o] - i1[o]), o))
                if abs(i0[o] - i1[o]) >= 1e5
            )
        )
PY
cat "$OUT/source_summary.txt"
echo "profile_kernels: full report $OUT/kernels.ncu-rep, all metrics $OUT/details.csv, per instruction $OUT/source.csv"
