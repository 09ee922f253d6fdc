"""The megatron-core patch stack (`patches/megatron/v0.19.2/`) against the pip-installed megatron-core 0.19.2 wheel:
pristine files proven by the wheel's `dist-info/RECORD` digests, the stack applied by `make setup` (so the tested
Megatron is the patched one), `git apply` taking it in the upstream layout; and what it is for: Megatron's
distributed optimizer steps CPU parameters (gloo) as it steps CUDA ones."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "megatron_patches.py"
_spec = importlib.util.spec_from_file_location("megatron_patches", SCRIPT)
mp = importlib.util.module_from_spec(_spec)
sys.modules["megatron_patches"] = mp
_spec.loader.exec_module(mp)
sp = sys.modules["sglang_patches"]  # the machinery megatron_patches runs


def test_every_patch_is_applied_and_regenerates_byte_identically(capsys):
    root, digests = sp.installed_root(mp.MEGATRON)
    patches = sp.load_patches(mp.MEGATRON)
    for patch in patches:
        original, state = sp.pristine(patch, root, digests, mp.MEGATRON)
        assert state == "patched", f"{patch.package_path} is not patched; run `make setup`"
        patched = sp.apply_hunks(patch, original)
        assert (root / patch.package_path).read_text() == patched
        assert (
            sp.make_patch(patch.description, patch.path, original, patched)
            == (mp.MEGATRON.patch_dir / patch.name).read_text()
        )
        assert patch.path.startswith("megatron/core/")  # upstream repository layout
    assert sp.main(["apply"], stack=mp.MEGATRON) == 0
    assert capsys.readouterr().out.count("already applied") == len(patches)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_apply_accepts_the_stack_in_upstream_layout(tmp_path):
    root, digests = sp.installed_root(mp.MEGATRON)
    patches = sp.load_patches(mp.MEGATRON)
    for patch in patches:
        dest = tmp_path / patch.path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(sp.pristine(patch, root, digests, mp.MEGATRON)[0])
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "apply", *(str(mp.MEGATRON.patch_dir / p.name) for p in patches)], cwd=tmp_path, check=True)
    for patch in patches:
        assert (tmp_path / patch.path).read_text() == (root / patch.package_path).read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_distributed_optimizer_steps_cpu_parameters_like_adamw(dtype):
    """One rank, CPU: Megatron's distributed optimizer (AdamW, FP32 masters, clipping by the global norm) gives
    the update of torch's AdamW on FP32 masters with `clip_grad_norm_`, what the single-rank trainer runs."""
    from megatron_trace.cpu import init_single_rank
    from megatron_trace.model import MoEModelConfig, build_moe_model
    from megatron_trace.parallel import make_optimizer, unwrap, wrap_ddp

    init_single_rank()
    dims = dict(vocab=64, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, experts=4, topk=2, expert_ffn=16)
    cfg = MoEModelConfig(**dims)
    (chunk,) = wrap_ddp([build_moe_model(cfg, dtype=dtype, routing_replay=False, grouped=True)])
    params = list(unwrap(chunk).parameters())
    master = [p.detach().float().clone().requires_grad_() for p in params]
    reference = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.0)
    optimizer = make_optimizer([chunk], lr=1e-2, clip_grad=1.0)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        chunk.zero_grad_buffer()
        for p, m in zip(params, master, strict=True):
            p.main_grad.copy_(torch.randn(p.shape, generator=g))
            m.grad = p.main_grad.clone()
        norm = float(torch.nn.utils.clip_grad_norm_(master, 1.0))
        reference.step()
        ok, got_norm, _ = optimizer.step()
        assert ok and got_norm == pytest.approx(norm, rel=1e-6)
        for p, m in zip(params, master, strict=True):
            torch.testing.assert_close(p.detach(), m.detach().to(dtype), rtol=1e-6, atol=1e-7)
