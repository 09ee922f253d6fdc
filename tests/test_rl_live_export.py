"""`trace-rl export` on a live run (`trace_rl.snapshot`): the newest intact checkpoint is linked out of the run
directory and verified, without the run's lock and without changing the directory; a snapshot taken before
retention deletes its checkpoint still loads to that checkpoint's policy bit for bit."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from tests.rl_small import SMALL_RUN
from trace_rl.cli import _trainer_of, export_run
from trace_rl.config import RLConfig
from trace_rl.controller import Controller
from trace_rl.snapshot import snapshot_latest


def test_export_of_a_live_run_is_consistent_and_survives_retention(tiny_model, tmp_path):
    run = tmp_path / "run"
    cfg = RLConfig(model_dir=str(tiny_model(10)), out_dir=str(run), **(SMALL_RUN | dict(steps=4, checkpoint_every=1)))
    with Controller(cfg, resume=False) as ctrl:  # the live run holds its lock throughout
        ctrl.train_step(), ctrl.train_step()
        want = ctrl.trainer.hf_weights()
        (tmp_path / "snap").mkdir()
        state, path = snapshot_latest(run, tmp_path / "snap")
        assert state["step"] == 2
        before = sorted(p.name for p in run.iterdir())
        ctrl.train_step(), ctrl.train_step()  # checkpoints 3 and 4: retention deletes 1 and 2
        assert not (run / path.name).exists()
        trainer, _ = _trainer_of(state, path)
        got = trainer.hf_weights()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        exported = load_file(export_run(run, tmp_path / "hf") / "model.safetensors")
        latest = ctrl.trainer.hf_weights()
        assert all(torch.equal(exported[k], latest[k]) for k in latest)
        assert not any(p.name.startswith(".snapshot-") for p in (tmp_path / "hf").iterdir())
    assert "checkpoint-00000002.pt" in before and not any(p.suffix == ".corrupt" for p in run.iterdir())
