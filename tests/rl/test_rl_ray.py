"""The Ray layer: rollout workers and the trainer as Ray actor processes behind the same interfaces. A worker
process that exits mid-request is restarted and the step completes with every record in the store (workers with
`fp4_attention = "decode"`, which report their FP4 pool reads); trajectories equal the in-process pool's."""

from __future__ import annotations

import pytest
import torch

from trace_core.records.reader import RecordReader
from trace_rl.config import RLConfig
from trace_rl.controller import Controller
from trace_rl.trainer import RayTrainer

ray = pytest.importorskip("ray", reason="ray is a dependency of trace_rl; this install lacks it")
pytestmark = pytest.mark.xdist_group("ray")  # one local Ray instance at a time (pytest-xdist --dist loadgroup)


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    out = tiny_model(10)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield str(out)
    ray.shutdown()


@pytest.mark.slow
def test_ray_worker_process_killed_mid_request_is_restarted(model_dir, tmp_path):
    small = dict(model_dir=model_dir, prompts_per_step=4, group_size=4, max_new_tokens=4, steps=2, mode="trace")
    # decode attention from the FP4 KV pool in these actors (fp4_attention), the default engine in the ones below
    ctrl = Controller(RLConfig(out_dir=str(tmp_path / "ray"), use_ray=True, fp4_attention="decode", **small))
    victim = ctrl.pool.workers[1]
    ray.get(victim.exit_after.remote(3))  # the actor process exits during its third forward
    first = ctrl.train_step()
    assert first["rollout/restarts"] == 1 and ctrl.pool.workers[1] is not victim
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(victim.version.remote())
    assert len(RecordReader(ctrl.store, 0).trajectories()) == 16
    second = ctrl.train_step()
    assert second["rollout/restarts"] == 0 and ctrl.pool.versions() == [2, 2]
    assert first["rollout/fp4_decode_reads"] > 0 and second["rollout/fp4_decode_reads"] > 0
    assert isinstance(ctrl.trainer, RayTrainer) and ctrl.trainer.policy_version() == 2

    want = Controller(RLConfig(out_dir=str(tmp_path / "local0"), **small)).rollout(0)
    got = Controller(RLConfig(out_dir=str(tmp_path / "ray0"), use_ray=True, **small)).rollout(0)
    for x, y in zip(got.trajectories, want.trajectories, strict=True):
        assert torch.equal(x.tokens, y.tokens)
