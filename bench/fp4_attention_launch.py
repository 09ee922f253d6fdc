"""Time the FP4 grouped decode kernel under alternative launch settings on a CUDA GPU, at the shapes of
`bench/fp4_attention.py`, against SGLang's BF16-KV triton decode in the same run.

The variants change only how the same instructions are scheduled (software-pipeline stages, a register cap that
lets more programs share an SM), not the math: each variant's output is compared with the first's (SGLang's
settings) and must be equal bit for bit. `fp4_attention.GROUPED_LAUNCH` holds the one the kernel launches.
Graph-timed (median, L2 flushed), as the main bench.

Usage: python bench/fp4_attention_launch.py [--out launch.json] [--slots 2097152]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench.*, tests.* of this checkout

from bench.common import graph_ms, versions, write_json
from bench.fp4_attention import CASES, SPLITS, pool
from tests.fp4_attention_checks import sglang_decode_attention
from trace_core.kernels import fp4_attention as fa

VARIANTS = {
    "stages 2": {"num_warps": 4, "num_stages": 2},  # SGLang's
    "stages 3": {"num_warps": 4, "num_stages": 3},
    "stages 2, 96 regs": {"num_warps": 4, "num_stages": 2, "maxnreg": 96},
    "stages 3, 96 regs": {"num_warps": 4, "num_stages": 3, "maxnreg": 96},
}


def run(slots: int, kv_heads: int, q_heads: int, d: int) -> list[dict]:
    decode_attention_fwd = sglang_decode_attention()
    codes, scales, bf16, _ = pool(slots, kv_heads, d)
    rows = []
    for batch, length in CASES:
        indices = torch.randperm(slots - 1, device="cuda")[: batch * length] + 1
        indptr = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * length
        nsplit = torch.full((batch,), SPLITS, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, q_heads, d, dtype=torch.bfloat16, device="cuda")
        logits = torch.empty(batch, q_heads, SPLITS, d, device="cuda")
        lse = torch.empty(batch, q_heads, SPLITS, device="cuda")
        common = (indptr, indices, logits, lse, nsplit, SPLITS, 1 / math.sqrt(d))
        o = torch.empty_like(q)
        row = {"batch": batch, "tokens": length}
        row["bf16_us"] = 1e3 * graph_ms(partial(decode_attention_fwd, q, bf16[0], bf16[1], o, *common, 1.0, 1.0))
        ref = None
        for name, launch in VARIANTS.items():
            with fa.grouped_launch(launch):
                o = torch.empty_like(q)
                fp4 = partial(fa.fp4_decode_attention, q, codes[0], scales[0], codes[1], scales[1], o, *common)
                fp4()
                ref = o.clone() if ref is None else ref
                row[f"{name}: equal"] = torch.equal(o, ref)
                row[f"{name}: us"] = 1e3 * graph_ms(fp4)
                row[f"{name}: over bf16"] = row[f"{name}: us"] / row["bf16_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--slots", type=int, default=2 * 1024 * 1024, help="KV pool slots (default 2M)")
    args = parser.parse_args()
    rows = run(args.slots, 4, 32, 128)
    print(versions())
    print(f"default: {fa.GROUPED_LAUNCH}\n")
    cols = ["batch", "tokens", "bf16_us"] + [f"{v}: over bf16" for v in VARIANTS]
    print("| " + " | ".join(cols) + " | all equal |\n|" + "---|" * (len(cols) + 1))
    for r in rows:
        equal = all(r[f"{v}: equal"] for v in VARIANTS)
        print(
            "| " + " | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + f" | {equal} |"
        )
    write_json(args.out, {"gpu": torch.cuda.get_device_name(), "default": fa.GROUPED_LAUNCH, "rows": rows})


if __name__ == "__main__":
    main()
