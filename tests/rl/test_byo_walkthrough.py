"""The walk-through of docs/rl.md, "Bring your own model and data", as shipped: `trace-rl train --config
configs/byo-math-cpu.toml` on the tiny random checkpoint `python -m tests.hf_tiny` makes. Its reward varies within
groups from the first step (the math reward alone would give every sample 0), the samples land in samples.jsonl,
the report builds, and over the documented 24 steps the reward rises (slow)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.hf_tiny import make_hf_checkpoint
from trace_rl.cli import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "byo-math-cpu.toml"


def _train(tmp_path: Path, monkeypatch, *overrides: str) -> list[dict]:
    monkeypatch.chdir(ROOT)  # the config's paths are relative to the checkout, as documented
    model = make_hf_checkpoint(tmp_path / "tiny-hf")
    out = tmp_path / "byo-math"
    main(["train", "--config", str(CONFIG), f"model_dir={model}", f"out_dir={out}", "loggers=none", *overrides])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_walkthrough_trains_from_its_first_step(tmp_path, monkeypatch, capsys):
    history = _train(tmp_path, monkeypatch, "steps=2", "eval_every=2")
    assert all(m["reward/zero_variance_groups"] < 2 for m in history)  # some group has a reward signal
    assert all(m["actor/pg_loss"] != 0 for m in history)
    rows = [json.loads(line) for line in (tmp_path / "byo-math" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 and {r["step"] for r in rows} == {0, 1}
    assert rows[0]["prompt"].startswith("system\nPut the final answer in \\boxed{}.") and rows[0]["response"]
    assert "trained nothing" not in capsys.readouterr().err
    main(["report", str(tmp_path / "byo-math")])
    assert (tmp_path / "byo-math" / "mismatch_reward.png").stat().st_size > 0


@pytest.mark.slow
def test_the_walkthrough_reward_rises_over_its_documented_steps(tmp_path, monkeypatch):
    history = _train(tmp_path, monkeypatch)
    assert len(history) == 24
    rewards = [m["reward/mean"] for m in history]
    assert statistics.fmean(rewards[-8:]) > 2 * statistics.fmean(rewards[:8])
