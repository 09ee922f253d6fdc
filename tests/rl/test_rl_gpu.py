"""The RL loop and the same-batch analyses on CUDA (engine, capturer, Triton kernels and Megatron trainer on the GPU):
the path docs/results.md ran, kept as a regression test. Run with `pytest -m gpu` on a CUDA machine."""

from __future__ import annotations

import math

import pytest

from trace_rl.config import RLConfig
from trace_rl.controller import Controller
from trace_rl.experiments.analysis import analyze

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    out = tiny_model(40)
    return str(out)


@pytest.mark.parametrize("mode", ["bf16", "qat", "trace"])
def test_rl_steps_on_cuda(model_dir, tmp_path, mode):
    cfg = RLConfig(
        model_dir=model_dir, out_dir=str(tmp_path), mode=mode, device="cuda", steps=2, prompts_per_step=4,
        group_size=4, max_new_tokens=4, rollout_workers=1, measure_all_sites=mode != "bf16",
    )  # fmt: skip
    history = Controller(cfg).run()
    assert len(history) == 2
    for m in history:
        assert math.isfinite(m["train_rollout_logprob_abs_diff"]) and math.isfinite(m["actor/grad_norm"])
        assert m["rollout/records_missing"] == 0
        if mode == "trace":
            assert m["trace/rtn_fallback_real_tokens"] == 0
        if mode != "bf16":
            assert "trace/L0.moe_in/code_flip_rate" in m  # whole-code records at every site


def test_analysis_on_cuda_matches_rows_between_engine_and_trainer(model_dir, tmp_path):
    results = analyze(model_dir, tmp_path, batches=1, prompts=4, group_size=4, max_new_tokens=4, device="cuda")
    full = next(r for r in results if r["config"] == "b4/all")
    qat = next(r for r in results if r["config"] == "qat")
    for kind in ("moe_in", "k", "v"):
        assert full[f"mse/L0.{kind}"] == 0 < qat[f"mse/L0.{kind}"]
