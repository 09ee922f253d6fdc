"""Weight sync into a live patched SGLang 0.5.15.post1 server (`gpu` marker): `weight_sync = "tensor"` by CUDA IPC
into a colocated server (one GPU, TP = 1, the trainer's tensors on the same device) and `weight_sync = "distributed"`
over NCCL (two GPUs: NCCL refuses two ranks on one device), each compared with a disk load of the same weights.

The server runs TRACE in emulate mode on a random Qwen3-MoE checkpoint (`tests.sglang_server.SERVED_MODEL`), so its
routed-expert weights are fake-quantized by the plugin's hook after `FusedMoE.weight_loader`. Policy W1 is loaded
from disk (`/update_weights_from_disk`) and answers a greedy request; then W0 and W1 again are pushed in buckets
(CUDA tensors, and CPU tensors through shared memory): after W1 the same request must give the same tokens and the
same log-probs bit for bit, so the weights the server computes with (fake-quantized experts included) are what a
disk load gives. The sync's seconds, bytes and peak extra GPU memory are printed (`-s`).

Run on a GPU machine with SGLang 0.5.15.post1, its GPU wheels and this package installed (patch stack applied):
`pytest -m gpu tests/rl/test_weight_sync_gpu.py -s`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file

from tests.hf_tiny import DIMS, make_hf_checkpoint
from tests.sglang_server import SERVED_MODEL, Server, served_flags
from trace_rl.config import RLConfig
from trace_rl.rollout.sglang_worker import SGLangWorker
from trace_rl.weight_sync import WeightSync

pytestmark = pytest.mark.gpu

START_S = 480
PROMPT = list(range(3, 40))


def _checkpoints(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The served checkpoint (W0) and a perturbed policy W1 with the same names, shapes and dtypes."""
    hf = make_hf_checkpoint(tmp_path / "hf", seed=0, **SERVED_MODEL)
    w0: dict[str, torch.Tensor] = {}
    for f in sorted(hf.glob("*.safetensors")):
        w0 |= load_file(f)
    g = torch.Generator().manual_seed(1)
    w1 = {k: (v.float() * (1 + 0.1 * torch.randn(v.shape, generator=g))).to(v.dtype) for k, v in w0.items()}
    return hf, w0, w1


def _greedy(url: str) -> tuple[list[int], list[float]]:
    payload = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
        "return_logprob": True,
    }
    resp = requests.post(f"{url}/generate", json=payload, timeout=120)
    assert resp.status_code == 200, resp.text[:2000]
    out = resp.json()
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def _server(tmp_path: Path, hf: Path, gpu: int) -> Server:
    flags = served_flags(tmp_path / "records", "fp4_e2m1", sites="moe_in,k,v", extra=("--weight-version", "0"))
    server = Server(hf, flags, tmp_path / "server.log", env={"CUDA_VISIBLE_DEVICES": str(gpu)})
    try:
        server.wait_ready(START_S)
    except BaseException:
        server.stop()
        raise
    return server


def _same_as_disk(tmp_path: Path, server: Server, hf: Path, w0: dict, w1: dict, **sync_keys) -> dict:
    """Disk-load W1, answer; push W0 then W1 by `sync_keys`' transport from CUDA and from CPU tensors, answer; the
    answers after W1 equal the disk load's. The sync metrics of each W1 push."""
    base = dict(mode="trace", rollout_backend="sglang", sglang_urls=server.url, rollout_workers=1,
                out_dir=str(tmp_path), sglang_timeout_s=300.0, weight_sync_timeout_s=300.0)  # fmt: skip
    worker = SGLangWorker(server.url, RLConfig(**base), DIMS["vocab_size"])
    WeightSync(RLConfig(**base), [worker], hf, tmp_path / "weights").push(w1, 1)
    at_disk = _greedy(server.url)
    sync = WeightSync(RLConfig(**base | sync_keys), [worker], hf, tmp_path / "weights")
    metrics = {}
    try:
        for device in ("cuda", "cpu"):
            version = worker.version()
            sync.push({k: t.to(device) for k, t in w0.items()}, version + 1)
            assert _greedy(server.url)[1] != at_disk[1], "W0 answers as W1 does: the test cannot tell them apart"
            metrics[device] = sync.push({k: t.to(device) for k, t in w1.items()}, version + 2)
            assert _greedy(server.url) == at_disk, f"{device} tensors: not the disk load's answer\n{server.tail()}"
            assert worker.version() == version + 2
    finally:
        sync.close()
    print(json.dumps(metrics, indent=1))
    return metrics


def test_tensor_sync_by_cuda_ipc_answers_as_a_disk_load(tmp_path):
    hf, w0, w1 = _checkpoints(tmp_path)
    server = _server(tmp_path, hf, 0)  # colocated: the server and this process on GPU 0
    try:
        metrics = _same_as_disk(tmp_path, server, hf, w0, w1, weight_sync="tensor", weight_sync_bucket_mb=4.0)
    finally:
        server.stop()
    total = sum(t.numel() * t.element_size() for t in w1.values())
    assert metrics["cuda"]["weight_sync/bytes"] == total and metrics["cuda"]["weight_sync/buckets"] > 1
    assert metrics["cuda"]["weight_sync/disk_syncs"] == 0 and "weight_sync/gpu_peak_extra_bytes" in metrics["cuda"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs two GPUs")
def test_distributed_sync_over_nccl_answers_as_a_disk_load(tmp_path):
    hf, w0, w1 = _checkpoints(tmp_path)
    torch.cuda.set_device(0)  # the sender, rank 0
    server = _server(tmp_path, hf, 1)
    try:
        metrics = _same_as_disk(tmp_path, server, hf, w0, w1, weight_sync="distributed", weight_sync_bucket_mb=4.0)
    finally:
        server.stop()
    assert metrics["cuda"]["weight_sync/disk_syncs"] == 0 and metrics["cpu"]["weight_sync/buckets"] > 1


def test_the_trainer_exports_the_policy_on_its_gpu_as_on_the_cpu(tmp_path):
    """`hf_weights(device="cuda")`, what a colocated `tensor` sync sends (`trace_rl.controller.export_device`): every
    tensor on the GPU, bit for bit the CPU export, so the sync carries CUDA IPC handles of the trainer's memory."""
    from trace_rl.controller import Controller
    from trace_rl.warmup import make_tiny_model

    model = tmp_path / "tiny"
    make_tiny_model(model, seed=0)
    cfg = RLConfig(model_dir=str(model), out_dir=str(tmp_path / "run"), device="cuda", steps=1)
    with Controller(cfg, resume=False) as ctrl:
        want = ctrl.trainer.hf_weights()
        got = ctrl.trainer.hf_weights(device="cuda")
    assert list(got) == list(want)
    assert all(t.is_cuda and torch.equal(t.cpu(), want[k]) for k, t in got.items())
