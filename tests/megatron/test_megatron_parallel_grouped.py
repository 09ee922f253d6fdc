"""The shard rules of `megatron_trace.parallel` for the TRACE grouped experts (`weight [E_local, out, in]`) at EP = 2
(torchrun, two gloo ranks): `load_full_state` puts global experts `r * E / EP .. ` (SequentialMLP names, the one
naming of the full state) into rank r's grouped rows, and `gather_full_state` gives the full state back exactly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CFG_KW = dict(vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, topk=2, expert_ffn=32)


def _worker(work: Path) -> None:
    from megatron.core import parallel_state

    from megatron_trace.model import MoEModelConfig, build_moe_model
    from megatron_trace.parallel import Layout, gather_full_state, load_full_state

    layout = Layout(ep=2)
    layout.init()
    model = build_moe_model(MoEModelConfig(**CFG_KW), grouped=True, **layout.config_overrides())
    full = gather_full_state([model])
    # distinct values per global tensor, so a misplaced expert cannot match
    target = {
        k: torch.full_like(v, float(i)) + torch.arange(v.numel()).view(v.shape) * 1e-3
        for i, (k, v) in enumerate(sorted(full.items()))
    }
    load_full_state(model, target)
    back = gather_full_state([model])
    rank, local = parallel_state.get_expert_model_parallel_rank(), CFG_KW["experts"] // 2
    rows_ok = all(
        torch.equal(
            model.decoder.layers[layer].mlp.experts.linear_fc1.weight[i],
            target[f"decoder.layers.{layer}.mlp.experts.local_experts.{rank * local + i}.linear_fc1.weight"],
        )
        for layer in range(CFG_KW["layers"])
        for i in range(local)
    )
    out = {
        "names": sorted(full),
        "round_trip": sorted(back) == sorted(target) and all(torch.equal(back[k], target[k]) for k in target),
        "rows_ok": rows_ok,
    }
    (work / f"result.{torch.distributed.get_rank()}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_grouped_experts_shard_over_ep_and_gather_back(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    proc = subprocess.run(cmd + [__file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["round_trip"] and r["rows_ok"]
        experts = {n for n in r["names"] if ".local_experts." in n}
        assert len(experts) == CFG_KW["layers"] * CFG_KW["experts"] * 2  # fc1 and fc2 of every global expert
        assert not any(n.endswith("experts.linear_fc1.weight") for n in r["names"])  # SequentialMLP names only


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
