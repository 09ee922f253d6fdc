"""The RL loop on the embedded default: a few-step run of the three modes, resume from a checkpoint, a rollout worker
killed mid-step, and the staleness bound."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from trace_core.records.reader import RecordReader
from trace_core.records.store import list_steps
from trace_rl.config import ConfigError, RLConfig
from trace_rl.controller import Controller
from trace_rl.launch import main
from trace_rl.trainer import StaleRolloutError

SMALL = dict(prompts_per_step=4, group_size=4, max_new_tokens=4, rollout_workers=2, steps=3)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    out = tiny_model(40)
    return str(out)


def _cfg(model_dir, out, **kw) -> RLConfig:
    return RLConfig(model_dir=model_dir, out_dir=str(out), **(SMALL | kw))


def _same(a: dict, b: dict) -> None:
    keys = {k for k in a if not k.startswith("time/")}
    assert keys == {k for k in b if not k.startswith("time/")}
    for k in keys:
        assert a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and math.isnan(b[k])), k


def test_three_modes_end_to_end(model_dir, tmp_path):
    table = main([f"model_dir={model_dir}", f"out_dir={tmp_path}", "steps=2", "prompts_per_step=4", "group_size=4"])
    assert list(table) == ["bf16", "qat", "trace"]
    for name in ("metrics.csv", "summary.txt", "summary.json", "mismatch_reward.png", "code_flip_per_layer.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    for mode in table:
        assert len((tmp_path / mode / "metrics.jsonl").read_text().splitlines()) == 2
    # Guided rounding follows the rollout's recorded bits; RTN QAT does not.
    assert table["trace"]["code flips moe_in"] < table["qat"]["code flips moe_in"]
    assert table["trace"]["code flips k/v"] < table["qat"]["code flips k/v"]
    assert table["trace"]["RTN fallback (real tokens)"] == 0
    assert math.isnan(table["bf16"]["code flips moe_in"])
    assert table["bf16"]["|Δ logp| mean"] < table["qat"]["|Δ logp| mean"]


def test_resume_from_checkpoint_gives_the_same_next_step(model_dir, tmp_path):
    cfg = _cfg(model_dir, tmp_path / "a", mode="trace", async_lag=1, checkpoint_every=2, steps=4)
    ctrl = Controller(cfg)
    ctrl.train_step(), ctrl.train_step()  # checkpoint after step 2, with step 2's rollout pending (async)
    assert len(ctrl.pending) == 1
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    want = ctrl.train_step()
    resumed = Controller(cfg.replace(out_dir=str(tmp_path / "b")))
    assert resumed.step == 2 and [b.step for b in resumed.pending] == [2]
    assert len((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()) == 2
    _same(resumed.train_step(), want)
    for p, q in zip(ctrl.trainer.params, resumed.trainer.params, strict=True):
        assert torch.equal(p, q)
    resumed.close()
    with pytest.raises(ValueError, match="group_size=4, the config has 8"):
        Controller(cfg.replace(out_dir=str(tmp_path / "b"), group_size=8))


def test_killed_rollout_worker_is_restarted_and_no_record_is_lost(model_dir, tmp_path):
    clean = Controller(_cfg(model_dir, tmp_path / "clean"))
    want = clean.rollout(0)
    ctrl = Controller(_cfg(model_dir, tmp_path / "chaos"))
    victim = ctrl.pool.workers[1]
    calls = []

    def kill_on_third_forward(module, args, output):
        calls.append(1)
        if len(calls) == 3:
            victim.kill()

    victim.engine.model.register_forward_hook(kill_on_third_forward)
    got = ctrl.rollout(0)
    assert got.restarts == 1 and ctrl.pool.workers[1] is not victim and len(calls) == 3
    assert len(got.trajectories) == len(want.trajectories) == 16
    reader, ref = RecordReader(ctrl.store, 0), RecordReader(clean.store, 0)
    assert reader.trajectories() == ref.trajectories() == sorted(str(i) for i in range(16))
    batch = [(i, 0, len(t.tokens)) for i, t in enumerate(want.trajectories)]
    a, b = reader.load(batch), ref.load(batch)
    for site in b.records:
        assert torch.equal(a.records[site].low_bits, b.records[site].low_bits)
        assert torch.equal(a.records[site].scales, b.records[site].scales)
    assert torch.equal(a.routes, b.routes)
    for x, y in zip(got.trajectories, want.trajectories, strict=True):
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.logprobs, y.logprobs)


def test_staleness_bound_is_enforced(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="async_lag=3 exceeds max_version_diff=2"):
        _cfg(model_dir, tmp_path, async_lag=3, max_version_diff=2)
    ctrl = Controller(_cfg(model_dir, tmp_path, mode="qat", async_lag=2, max_version_diff=2, steps=4))
    history = ctrl.run()
    assert [m["rollout/staleness"] for m in history] == [0.0, 1.0, 2.0, 2.0]
    old = ctrl.rollout(9)
    old.version = ctrl.trainer.policy_version() - 3
    rewards = torch.zeros(len(old.trajectories))
    with pytest.raises(StaleRolloutError, match="3 versions behind"):
        ctrl.trainer.step(old.trajectories, rewards, 4, str(ctrl.store), 9, old.version)


def test_restart_without_checkpoint_starts_over(model_dir, tmp_path):
    cfg = _cfg(model_dir, tmp_path, mode="trace", checkpoint_every=5)
    with Controller(cfg) as ctrl:
        first = ctrl.train_step()
    again = Controller(cfg)  # step 0's records are in the store but no checkpoint covers them
    assert again.step == 0 and not list_steps(again.store)
    _same(again.train_step(), first)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
