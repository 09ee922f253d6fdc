"""`bench/sglang_finish.py` runs on CPU against the installed SGLang's FP4 KV pool and allocator: what it reports
comes from a finish path whose every write succeeded (the bench asserts it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_finish_bench_times_the_tiny_shape_and_its_kv_gather_equals_the_twin(tmp_path):
    """The tiny shape: 2 MoE layers recorded, K and V of both (4 sites), one transfer per result batch, the K/V
    gather equal to its pure-torch twin, writer time spent on every batch (the bench asserts that no write failed), and
    nothing left in `--store-dir`."""
    out = subprocess.run(
        [sys.executable, "bench/sglang_finish.py", "--shape", "tiny", "--tokens", "8", "--batch", "4",
         "--requests", "2", "--device", "cpu", "--store-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kv_gather_equals_twin"] is True
    assert (result["recorded_moe_layers"], result["kv_sites"], result["transfers_per_batch"]) == (2, 4, 1.0)
    assert result["writer_ms_per_request_median"] > 0 and len(result["finish_ms"]) == 2
    assert list(tmp_path.iterdir()) == []  # its record store is removed after the run
