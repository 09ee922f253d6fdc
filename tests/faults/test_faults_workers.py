"""Fault injection, run directory and rollout workers (docs/reliability.md items 1, 3 and 4): a second controller on
a run directory is refused naming the holder (a real process, then SIGKILLed: the lock goes with it); a hung rollout
worker misses its per-call deadline and is restarted (in-process and as a Ray actor), a step that misses its
deadline fails; shards of an earlier attempt are set aside; swapped records are refused by the trainer by name; a
worker hung in its weight sync is named, replaced and synced; invalid worker output is refused naming the
trajectory; a deleted `.lock` or a replaced directory lets no second controller train; an unwritable run directory
is named by its absolute path; a lock left to interpreter exit closes quietly."""

from __future__ import annotations

import dataclasses
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

from trace_core.records.reader import BindingMismatchError
from trace_core.records.store import PREAMBLE, shard_paths, step_dir
from trace_rl.config import RLConfig
from trace_rl.controller import Controller
from trace_rl.rollout.workers import InvalidRollout, RolloutTimeout
from trace_rl.rundir import RunDirError, RunLockedError

pytestmark = pytest.mark.faults
REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.slow
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


@pytest.fixture
def local_ray():
    """A local Ray instance on two CPUs for one test."""
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.xdist_group("ray")
@pytest.mark.slow
def test_a_hung_ray_worker_is_killed_and_restarted(model_dir, tmp_path, local_ray):
    ray = local_ray
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), use_ray=True, rollout_call_timeout_s=30, **TINY)
    with Controller(cfg) as ctrl:
        victim = ctrl.pool.workers[1]
        ray.get(victim.hang_after.remote(1))
        batch = run_bounded(lambda: ctrl.rollout(0), 400)
        assert batch.restarts == 1 and len(batch.trajectories) == 4
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(victim.version.remote())


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


def test_a_worker_hung_in_weight_sync_is_named_replaced_and_synced(model_dir, tmp_path, capsys):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), weight_sync_timeout_s=5, **TINY)
    with Controller(cfg) as ctrl:
        victim = ctrl.pool.workers[1]
        victim.hang_on_load()
        run_bounded(ctrl.train_step, 300)  # trains step 0, then syncs policy version 1
        assert "policy version 1: rollout worker 1 missed weight_sync_timeout_s=5" in capsys.readouterr().err
        assert ctrl.pool.workers[1] is not victim and ctrl.pool.versions() == [1, 1]
        run_bounded(ctrl.train_step, 300)  # the replacement rolls out and syncs as any worker
        assert ctrl.step == 2 and ctrl.pool.versions() == [2, 2]
    cfg = cfg.replace(out_dir=str(tmp_path / "b"), max_restarts=0)
    with Controller(cfg) as ctrl:
        ctrl.pool.workers[0].hang_on_load()
        with pytest.raises(RolloutTimeout, match="rollout worker 0 missed weight_sync_timeout_s=5.*max_restarts=0"):
            run_bounded(ctrl.train_step, 300)


@pytest.mark.xdist_group("ray")
@pytest.mark.slow
def test_a_ray_worker_hung_in_weight_sync_is_killed_replaced_and_synced(model_dir, tmp_path, capsys, local_ray):
    ray = local_ray
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), use_ray=True, weight_sync_timeout_s=30, **TINY)
    with Controller(cfg) as ctrl:
        victim = ctrl.pool.workers[0]
        ray.get(victim.hang_on_load.remote())
        run_bounded(ctrl.train_step, 400)
        assert "policy version 1: rollout worker 0 missed weight_sync_timeout_s=30" in capsys.readouterr().err
        assert ctrl.pool.versions() == [1, 1]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(victim.version.remote())
        run_bounded(ctrl.train_step, 400)
        assert ctrl.step == 2


def _positive_logprob(out: list) -> list:
    return [out[0], dataclasses.replace(out[1], logprobs=out[1].logprobs.clone().fill_(5.0)), *out[2:]]


def _short_logprobs(out: list) -> list:
    return [dataclasses.replace(out[0], logprobs=out[0].logprobs[:-1]), *out[1:]]


def _missing(out: list) -> list:
    return out[:-1]


def _foreign_token(out: list) -> list:
    tokens = out[0].tokens.clone()
    tokens[-1] = 10**6
    return [dataclasses.replace(out[0], tokens=tokens), *out[1:]]


def test_invalid_output_of_an_embedded_worker_is_refused_naming_the_trajectory(model_dir, tmp_path):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), **(TINY | {"rollout_workers": 1}))
    cases = [
        (_positive_logprob, r"step 0: rollout request 0, trajectory 1: log-prob of response token 0 is 5.0, not fin"),
        (_short_logprobs, r"step 0: rollout request 0, trajectory 0: log-probs of shape \(\d\,\) for its \d response"),
        (_missing, r"step 0: rollout request 0 returned 3 trajectories for its 4 rows \[0, 1, 2, 3\]"),
        (_foreign_token, r"step 0: rollout request 0, trajectory 0: token ids \[1000000\] are not in the vocabulary"),
    ]
    with Controller(cfg) as ctrl:
        worker = ctrl.pool.workers[0]
        generate = worker.generate
        for tamper, message in cases:  # the worker's real output, damaged on its way out
            worker.generate = lambda req, tamper=tamper: tamper(generate(req))
            with pytest.raises(InvalidRollout, match=message):
                ctrl.rollout(0)
        worker.generate = generate
        assert len(ctrl.rollout(0).trajectories) == 4  # the step finalizes once the output is valid


def test_deleting_the_lock_file_or_replacing_the_directory_does_not_let_two_controllers_train(model_dir, tmp_path):
    out = tmp_path / "run"
    cfg = RLConfig(model_dir=model_dir, out_dir=str(out), **TINY)
    with Controller(cfg) as first:
        (out / ".lock").unlink()
        with pytest.raises(RunLockedError, match=f"{out} is in use by another controller: unknown .*was deleted"):
            Controller(cfg)
        first.train_step()  # the holder goes on and writes the holder file again
        assert f'"pid": {os.getpid()}' in (out / ".lock").read_text()
        out.rename(tmp_path / "moved")
        out.mkdir()
        with pytest.raises(RunLockedError, match=f"run directory {out} was moved or replaced"):
            first.train_step()


HOLD_IN_A_MODULE = """
import sys
from pathlib import Path
import trace_rl.rundir as rundir
rundir.held = rundir.RunLock(Path(sys.argv[1]))  # alive until the interpreter clears the module's names
raise RuntimeError("crash")
"""


def test_a_lock_left_to_interpreter_exit_closes_quietly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-c", HOLD_IN_A_MODULE, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 1 and "RuntimeError: crash" in child.stderr
    assert "Exception ignored" not in child.stderr and "AttributeError" not in child.stderr, child.stderr


START = """
from trace_rl.controller import Controller
Controller(CFG)
"""


def _without_root_override() -> list[str]:
    """The command prefix that makes file modes hold for this process: root ignores them unless it gives up
    CAP_DAC_OVERRIDE (setpriv); no prefix for other users."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory cannot be made")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


@pytest.mark.parametrize("read_only", ["out_dir", "records"])
def test_an_unwritable_run_directory_is_named_by_its_absolute_path(model_dir, tmp_path, read_only):
    out = tmp_path / "run"
    (out / "records").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    locked = out if read_only == "out_dir" else out / "records"
    locked.chmod(0o555)
    try:
        cfg = RLConfig(model_dir=model_dir, out_dir="run", **TINY)  # relative, as an operator writes it
        code = f"from trace_rl.config import RLConfig\nCFG = RLConfig(**{dataclasses.asdict(cfg)!r})\n{START}"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        child = subprocess.run(
            [*_without_root_override(), sys.executable, "-c", code],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        locked.chmod(0o755)
    last = child.stderr.strip().splitlines()[-1]
    if read_only == "out_dir":
        assert last == f"trace_rl.rundir.RunDirError: run directory {out}: cannot create {out}/.lock: Permission denied"
    else:
        assert last == f"trace_rl.rundir.RunDirError: record store {out}/records is not writable: Permission denied"
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'  # nothing written is lost


def test_a_record_store_outside_the_run_directory_holds_the_records_and_serves_one_run(model_dir, tmp_path):
    """`record_store` puts the step directories there, not under `<out_dir>/records`; a second run directory
    pointed at the same store is refused by name before it changes anything, and the owner still resumes."""
    store = tmp_path / "fast" / "store"
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path / "a"), record_store=str(store), loggers="none", **TINY)
    with Controller(cfg) as ctrl:
        ctrl.run()
    assert step_dir(store, 1).is_dir() and shard_paths(step_dir(store, 1))
    assert not (tmp_path / "a" / "records").exists()
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    other = dataclasses.replace(cfg, out_dir=str(tmp_path / "b"))
    with pytest.raises(RunDirError, match=f"record store {store} belongs to the run in {tmp_path / 'a'}, not to "):
        Controller(other)
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before  # nothing of the owner's touched
    with Controller(dataclasses.replace(cfg, steps=3)) as ctrl:  # the owner resumes from its own store
        assert ctrl.step == 2
