"""Expert parallel 2 on CPU: two gloo ranks launched with torchrun, allgather dispatcher, two experts per rank.
Each rank trains on its own trajectories; every captured site must still equal `guided_round` of the rollout's
records and R3 must replay the rollout's routes, with tokens dispatched to experts on the other rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CFG_KW = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=4, topk=2, expert_ffn=32)


def _worker() -> None:
    from megatron_trace.config import TraceConfig
    from megatron_trace.cpu import init_megatron
    from megatron_trace.emulate import emulate_rollout
    from megatron_trace.model import MoEModelConfig, build_moe_model
    from megatron_trace.rows import PAD, pack_microbatch
    from megatron_trace.session import TraceSession
    from trace_core.numerics.guided import guided_round
    from trace_core.records.spec import RecordSpec

    init_megatron(expert_parallel=2)
    # Ranks of one expert-parallel group exchange tokens, so their micro-batches share one shape: pad to 24.
    rank = torch.distributed.get_rank()
    cfg = MoEModelConfig(**CFG_KW)
    model = build_moe_model(cfg, dtype=torch.bfloat16, expert_model_parallel_size=2)
    assert len(model.decoder.layers[0].mlp.experts.local_experts) == 2
    spec = RecordSpec(bits=1, moe_layers=(0, 1), attn_layers=(1,))
    g = torch.Generator().manual_seed(10 + rank)
    lengths = torch.randint(9, 20, (4,), generator=g).tolist()
    trajs = [(i, torch.randint(0, cfg.vocab, (n,), generator=g)) for i, n in enumerate(lengths)]
    source = emulate_rollout(
        model,
        [pack_microbatch(trajs[:2], seq_len=24), pack_microbatch(trajs[2:], seq_len=24)],
        spec,
        num_trajectories=4,
        max_positions=32,
    )
    g = torch.Generator().manual_seed(99)  # the same perturbation of replicated parameters on both ranks
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 2e-3 * p.float().abs().mean()).to(p.dtype))
    taps, routing = [], {}
    for i, layer in enumerate(model.decoder.layers):
        layer.mlp.router.register_forward_hook(lambda m, a, out, i=i: routing.__setitem__(i, out[1]))
    session = TraceSession(model, TraceConfig(mode="trace", spec=spec), tap=lambda *a: taps.append(a))
    mb = pack_microbatch([trajs[3], trajs[0], trajs[1]], seq_len=24)
    session.begin_microbatch(mb.rows, source)
    model(mb.input_ids, mb.position_ids, mb.attention_mask).float().square().mean().backward()
    session.end_step()
    for site, rows, x, y in taps:
        if site in spec.sites():
            r = source.records(site, rows)
            assert torch.equal(y, guided_round(x, r.record, 1, has_record=r.has_record)), site
    keep = (mb.rows.traj != PAD) & ~mb.rows.last
    for layer, routing_map in routing.items():
        idx, _ = source.routes(layer, mb.rows)
        assert torch.equal(routing_map[keep], torch.zeros_like(routing_map).scatter_(1, idx, True)[keep])
    for expert in model.decoder.layers[0].mlp.experts.local_experts:
        assert expert.linear_fc1.weight.grad.abs().sum() > 0
    print(f"rank {rank} ok", flush=True)
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_expert_parallel_2_with_torchrun_on_cpu():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    proc = subprocess.run([*cmd, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout


if __name__ == "__main__":
    _worker()
