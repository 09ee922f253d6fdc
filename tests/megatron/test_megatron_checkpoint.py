"""Trainer checkpoints through Megatron's distributed checkpointing (`megatron_trace.checkpoint`) move between layouts
bit for bit: one rank -> TP = 2 + SP, EP = 2 (SequentialMLP and the TRACE grouped experts), PP = 2, PP = 2 with two
virtual stages (two gloo ranks, torchrun) -> one rank.

The single rank (in this process) saves BF16 parameters, FP32 masters that differ from them, and AdamW moments after
one step. Each two-rank layout loads that checkpoint into its shards (under Megatron DDP, whose parameters are views
of one buffer), gathers parameters, masters and both moments back to full tensors (every one must equal the saved
one exactly: a checkpoint is a copy, there is no tolerance) and saves its own checkpoint; the single rank loads each
of those and must get the same state again. A checkpoint of another model, and one whose file was changed, are
refused. Two more layouts hold the masters and moments in Megatron's distributed optimizer (DP = 2, and EP = 2
with the grouped experts; on the CPU with `patches/megatron`), which must load, give back and save the same state.
On a GPU machine the same test runs with NCCL and CUDA tensors.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CFG_KW = dict(vocab=96, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, experts=4, topk=2, expert_ffn=32)
LAYOUTS = {
    "tp2": (dict(tp=2), False),
    "ep2": (dict(ep=2), False),
    "ep2_grouped": (dict(ep=2), True),
    "pp2": (dict(pp=2), False),
    "pp2_vpp2": (dict(pp=2, vpp=2), False),
}
# Megatron's distributed optimizer (each DP rank holds a range of every master and moment) in place of the AdamW over
# full masters; the dense parameters are split over DP = 2 in both, the experts too in the first.
DISTRIBUTED = {"dp2_distopt": (dict(), False), "ep2_grouped_distopt": (dict(ep=2), True)}
FIELDS = ("param", "master", "exp_avg", "exp_avg_sq")


def _trainer_state(chunks):
    """Parameters of `chunks`, FP32 masters (a fresh AdamW over them) and the optimizer."""
    params = [p for c in chunks for p in c.parameters()]
    master = [p.detach().float().clone().requires_grad_() for p in params]
    return params, master, torch.optim.AdamW(master, lr=1e-3)


def _full(chunks, params, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Every field gathered to full tensors under the single-rank names (`{}` off the first pipeline stage)."""
    from megatron_trace.checkpoint import adam_state
    from megatron_trace.parallel import gather_full_state

    master, moments, _ = adam_state(params, opt)
    of = {id(p): i for i, p in enumerate(params)}
    pick = {
        "param": lambda p: p.detach(),
        "master": lambda p: master[of[id(p)]].detach(),
        "exp_avg": lambda p: moments["exp_avg"][of[id(p)]],
        "exp_avg_sq": lambda p: moments["exp_avg_sq"][of[id(p)]],
    }
    return {f: gather_full_state(chunks, pick[f]) for f in FIELDS}


def _worker(work: Path) -> None:
    """Two ranks: each layout loads the single rank's checkpoint, gathers it, saves its own."""
    from megatron.core import parallel_state

    from megatron_trace import checkpoint
    from megatron_trace.model import MoEModelConfig, build_moe_model
    from megatron_trace.parallel import Layout, build_chunks, make_optimizer, wrap_ddp

    cfg = MoEModelConfig(**CFG_KW)
    for name, (kw, grouped) in (LAYOUTS | DISTRIBUTED).items():
        layout = Layout(**kw)
        layout.init()
        chunks = build_chunks(
            lambda v, layout=layout, grouped=grouped: build_moe_model(
                cfg, dtype=torch.bfloat16, seed=7, vp_stage=v, grouped=grouped, **layout.config_overrides()
            ),
            layout,
        )
        distributed = name in DISTRIBUTED
        chunks = wrap_ddp(chunks, distributed_optimizer=distributed)
        if distributed:
            params, opt = [p for c in chunks for p in c.parameters()], make_optimizer(chunks, lr=1e-3)
        else:
            params, _, opt = _trainer_state(chunks)
        common = checkpoint.load(work / "single", chunks, params, opt)
        assert common["version"] == 3 and common["adam_step"] == 1, common
        full = _full(chunks, params, opt)
        if torch.distributed.get_rank() == 0:
            torch.save(full, work / f"{name}.pt")
        checkpoint.save(work / name, chunks, params, opt, version=common["version"], layout=name)
        parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single(seed: int):
    from megatron_trace.cpu import init_single_rank
    from megatron_trace.model import MoEModelConfig, build_moe_model

    init_single_rank()
    model = build_moe_model(MoEModelConfig(**CFG_KW), dtype=torch.bfloat16, seed=seed)
    return model, *_trainer_state([model])


def _assert_equal(got: dict, ref: dict) -> None:
    for f in FIELDS:
        assert got[f].keys() == ref[f].keys(), f
        for k, v in ref[f].items():
            assert got[f][k].dtype == v.dtype and torch.equal(got[f][k], v), (f, k)


@pytest.mark.slow
def test_a_checkpoint_moves_between_layouts_bit_for_bit(tmp_path):
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from megatron_trace import checkpoint

    model, params, master, opt = _single(seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in master:
            m.add_(torch.randn(m.shape, generator=g).to(m.device) * 1e-3)  # masters are not the BF16 parameters
            m.grad = torch.randn(m.shape, generator=g).to(m.device)
    opt.step()
    ref = _full([model], params, opt)
    checkpoint.save(tmp_path / "single", [model], params, opt, version=3, layout="single")

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
    proc = subprocess.run([*cmd, __file__, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    for name in LAYOUTS | DISTRIBUTED:
        _assert_equal(torch.load(tmp_path / f"{name}.pt"), ref)  # one rank -> the layout
        back, p2, _, opt2 = _single(seed=5)
        common = checkpoint.load(tmp_path / name, [back], p2, opt2)
        assert common == {"adam_step": 1, "version": 3, "layout": name}
        _assert_equal(_full([back], p2, opt2), ref)  # the layout -> one rank

    # Another model (more experts) is refused; so is a changed file of the checkpoint.
    from megatron_trace.model import MoEModelConfig, build_moe_model

    other = build_moe_model(MoEModelConfig(**(CFG_KW | {"experts": 8})), dtype=torch.bfloat16)
    p3, _, opt3 = _trainer_state([other])
    with pytest.raises(ValueError, match="shape mismatch .* decoder.layers.mlp.router.weight"):
        checkpoint.load(tmp_path / "single", [other], p3, opt3)
    shard = next((tmp_path / "tp2").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointingException, match=shard.name):
        checkpoint.verify(tmp_path / "tp2")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
