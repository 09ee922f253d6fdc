"""Fault injection, run directory and rollout workers (docs/reliability.md items 1, 3 and 4): a second controller on
a run directory is refused naming the holder (a real process, then SIGKILLed: the lock goes with it); a hung rollout
worker misses its per-call deadline and is restarted (in-process and as a Ray actor), a step that misses its
deadline fails; shards of an earlier attempt are set aside; swapped records are refused by the trainer by name."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import pytest
import torch

from trace_core.store import PREAMBLE, shard_paths, step_dir
from trace_core.store_reader import BindingMismatchError
from trace_rl.config import RLConfig
from trace_rl.controller import Controller
from trace_rl.rundir import RunLockedError
from trace_rl.workers import RolloutTimeout

pytestmark = pytest.mark.faults
REPO = Path(__file__).resolve().parents[1]
TINY = dict(prompts_per_step=2, group_size=2, max_new_tokens=2, rollout_workers=2, steps=2, mode="trace")


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    out = tiny_model(4)
    return str(out)


HOLD = """
import sys, time
from pathlib import Path
from trace_rl.rundir import RunLock
lock = RunLock(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_controller_is_refused_naming_the_holder(model_dir, tmp_path):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), **TINY)
    with Controller(cfg) as first:
        first.run()  # 2 steps, checkpoint at the end
        metrics = (tmp_path / "metrics.jsonl").read_text()
        with pytest.raises(RunLockedError, match=f'in use by another controller: .*"pid": {os.getpid()}'):
            Controller(cfg)
        assert (tmp_path / "metrics.jsonl").read_text() == metrics and step_dir(first.store, 0).is_dir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RunLockedError, match=f'"pid": {holder.pid}'):
            Controller(cfg)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
    finally:
        holder.kill()
    with Controller(cfg) as resumed:  # the kernel dropped the dead holder's lock
        assert resumed.step == 2


def run_bounded(fn, seconds: float):
    """`fn()` on a thread; fails the test (instead of hanging it) when it does not return within `seconds`."""
    box: dict = {}

    def target() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still blocked after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["out"]


def test_a_hung_in_process_worker_is_restarted_and_a_step_deadline_fails(model_dir, tmp_path):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path / "a"), rollout_call_timeout_s=15, **TINY)
    with Controller(cfg) as ctrl:
        victim = ctrl.pool.workers[1]
        victim.hang_after(1)
        batch = run_bounded(lambda: ctrl.rollout(0), 300)
        assert batch.restarts == 1 and ctrl.pool.workers[1] is not victim and len(batch.trajectories) == 4
    cfg = cfg.replace(out_dir=str(tmp_path / "b"), rollout_call_timeout_s=5, rollout_step_timeout_s=5)
    with Controller(cfg) as ctrl:
        ctrl.pool.workers[0].hang_after(1)
        with pytest.raises(RolloutTimeout, match="step 0: rollout did not finish within rollout_step_timeout_s"):
            run_bounded(lambda: ctrl.rollout(0), 300)


def test_a_hung_ray_worker_is_killed_and_restarted(model_dir, tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), use_ray=True, rollout_call_timeout_s=30, **TINY)
        with Controller(cfg) as ctrl:
            victim = ctrl.pool.workers[1]
            ray.get(victim.hang_after.remote(1))
            batch = run_bounded(lambda: ctrl.rollout(0), 400)
            assert batch.restarts == 1 and len(batch.trajectories) == 4
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(victim.version.remote())
    finally:
        ray.shutdown()


def test_shards_of_an_earlier_attempt_are_set_aside(model_dir, tmp_path):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path / "first"), **TINY)
    with Controller(cfg) as first:
        first.rollout(0)  # an earlier attempt of step 0, say from a run that died before its checkpoint
    with Controller(cfg.replace(out_dir=str(tmp_path / "second"))) as ctrl:
        earlier = step_dir(tmp_path / "first" / "records", 0)
        step_dir(ctrl.store, 0).mkdir(parents=True)
        for shard in shard_paths(earlier):
            shutil.copy(shard, step_dir(ctrl.store, 0) / f"earlier-{shard.name}")
        metrics = ctrl.train_step()
    assert metrics["rollout/stale_shards"] == 2
    kept = sorted(p.name for p in step_dir(tmp_path / "second" / "records", 0).iterdir() if p.name.startswith("."))
    assert [n for n in kept if n.startswith(".stale-earlier-")] and len(kept) == 3  # 2 set aside + the lock file


def swap_entries(shard: Path, a: str, b: str) -> None:
    """Swap two trajectories' header entries (their records) in a shard, with a valid header CRC."""
    data = shard.read_bytes()
    magic, version, hlen, _ = PREAMBLE.unpack_from(data)
    header = json.loads(data[PREAMBLE.size : PREAMBLE.size + hlen])
    entries = header["trajectories"]
    entries[a], entries[b] = entries[b], entries[a]
    head = json.dumps(header, separators=(",", ":")).encode()
    shard.write_bytes(PREAMBLE.pack(magic, version, len(head), zlib.crc32(head)) + head + data[PREAMBLE.size + hlen :])


def test_swapped_records_are_refused_by_the_trainer(model_dir, tmp_path):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), temperature=2.0, **(TINY | {"rollout_workers": 1}))
    with Controller(cfg) as ctrl:
        batch = ctrl.rollout(0)
        trajs = batch.trajectories
        pairs = [
            (i, j)
            for i in range(len(trajs))
            for j in range(i + 1, len(trajs))
            if len(trajs[i].tokens) == len(trajs[j].tokens) and not torch.equal(trajs[i].tokens, trajs[j].tokens)
        ]
        assert pairs, "no two different trajectories of equal length to swap"
        i, j = pairs[0]
        (shard,) = shard_paths(step_dir(ctrl.store, 0))
        swap_entries(shard, str(i), str(j))  # same ids, same lengths, another trajectory's records
        rewards = torch.zeros(len(trajs))
        with pytest.raises(
            BindingMismatchError, match=f"trajectory '{i}' .*trajectory '{j}' != expected '{i}'.*tokens"
        ):
            ctrl.trainer.step(trajs, rewards, cfg.group_size, str(ctrl.store), 0, batch.version)
