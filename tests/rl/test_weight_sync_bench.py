"""`bench/weight_sync.py`: the policy it sends is the trainer's export of a model of the checkpoint's shape (the
names and shapes a transformers checkpoint of that config holds), and, marked slow, the bench itself against the
real patched SGLang server on CPU (`tests/sglang_cpu_server.py`): every sync lands as a new policy version, in as
many buckets as the bucket size gives, and the server is gone afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.serve_server import PID_FILE
from bench.weight_sync import policy
from tests.hf_tiny import make_hf_checkpoint
from trace_rl.weight_buckets import MIB, checkpoint_manifest, plan_buckets

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf"), num_hidden_layers=3)


def test_the_benchs_policy_has_the_names_and_shapes_of_a_transformers_checkpoint(checkpoint):
    tensors = policy(json.loads((checkpoint / "config.json").read_text()), "cpu")
    assert {n: tuple(t.shape) for n, t in tensors.items()} == checkpoint_manifest(checkpoint)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16} and all(t.is_contiguous() for t in tensors.values())


@pytest.mark.slow
def test_the_bench_syncs_a_live_cpu_server_in_the_buckets_it_reports(checkpoint, tmp_path):
    out = tmp_path / "out" / "ws.json"
    bench = [sys.executable, str(REPO / "bench" / "weight_sync.py"), "--out", str(out), "--hf-config",
             str(checkpoint / "config.json"), "--sources", "cpu", "--bucket-mb", "0.01", "1", "--syncs", "2",
             "--server-command", f"{sys.executable} {REPO / 'tests' / 'sglang_cpu_server.py'}"]  # fmt: skip
    run = subprocess.run(bench, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    tensors = policy(result["hf_config"], "cpu")
    size = sum(t.nbytes for t in tensors.values())
    assert result["policy"] == {"tensors": len(tensors), "bytes": size}
    for mb in (0.01, 1):
        entry = result["results"][f"cpu-{mb:g}MiB"]
        assert len(entry["syncs"]) == 2
        for sync in entry["syncs"]:  # each one a version the server reported (else the bench failed)
            assert sync["bytes"] == size and sync["buckets"] == len(plan_buckets(tensors, int(mb * MIB)))
            assert sync["seconds"] > 0 and sync["sender_peak_extra_bytes"] is None
    assert result["results"]["cpu-0.01MiB"]["syncs"][0]["buckets"] > 1
    log = (out.parent / "weight_sync_server.log").read_text()
    assert log.count("/update_weights_from_tensor") == 2 * sum(
        len(plan_buckets(tensors, int(mb * MIB))) for mb in (0.01, 1)
    )
    assert not (out.parent / PID_FILE).exists()  # the server's process group was stopped
