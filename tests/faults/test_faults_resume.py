"""Fault injection, resume and checkpoints (docs/reliability.md items 2 and 6): a controller process SIGKILLed in the
last interval before a checkpoint resumes with `async_lag = 1`; a checkpoint write that runs out of disk (a file
size limit in a real process) leaves the previous checkpoint in use; a corrupt latest checkpoint falls back to the
previous one (its OS error named); settings that change the numerics are refused unless forced; changed data
settings are refused and a pending trajectory is never trained against another prompt; a fresh start SIGKILLed
between its deletions does not resume the old run; a killed run's temporary checkpoint file is removed at start."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trace_core.records.store import StoreError, list_steps, step_dir
from trace_rl.config import ConfigError, RLConfig
from trace_rl.controller import Controller, PairingError
from trace_rl.rundir import CorruptCheckpointError, checkpoints, load_latest, save_checkpoint

pytestmark = pytest.mark.faults
REPO = Path(__file__).resolve().parents[2]
TINY = dict(prompts_per_step=2, group_size=2, max_new_tokens=2, rollout_workers=1, mode="trace")


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    out = tiny_model(4)
    return str(out)


def run_child(script: str, cfg: RLConfig) -> subprocess.CompletedProcess:
    """`script` in a fresh Python process, with `cfg` (as keyword arguments of RLConfig) in `CFG`."""
    values = json.dumps(json.dumps(dataclasses.asdict(cfg)))
    code = f"import json\nfrom trace_rl.config import RLConfig\nCFG = RLConfig(**json.loads({values}))\n"
    with socket.socket() as sock:  # the child's own rendezvous port (this process's trainer holds MASTER_PORT)
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore", "MASTER_PORT": port}
    return subprocess.run([sys.executable, "-c", code + script], env=env, capture_output=True, text=True, timeout=600)


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in rows]


KILL_AFTER_STEP_9 = """
import os, signal
from trace_rl.controller import Controller
ctrl = Controller(CFG)
while ctrl.step < 9:
    ctrl.train_step()
os.kill(os.getpid(), signal.SIGKILL)  # the chosen point: steps 6-9 rolled out, the next checkpoint (10) not written
"""


@pytest.mark.slow
def test_sigkill_before_a_checkpoint_resumes_with_async_lag(model_dir, tmp_path):
    # The docs' example values: async_lag 1, checkpoint_every 5, keep_record_steps 4.
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), steps=11, async_lag=1, checkpoint_every=5, **TINY)
    child = run_child(KILL_AFTER_STEP_9, cfg)
    assert child.returncode == -9, child.stderr[-3000:]
    assert [s for s, _ in checkpoints(tmp_path)] == [5] and 5 in list_steps(tmp_path / "records")
    before = metrics(tmp_path)
    assert [m["step"] for m in before] == list(range(9))
    with Controller(cfg) as ctrl:
        assert ctrl.step == 5 and [b.step for b in ctrl.pending] == [5]
        history = ctrl.run()
    assert [m["step"] for m in history] == list(range(11))
    # Rollout seeds depend only on (seed, step, worker): the resumed steps 5-8 are the killed run's steps 5-8.
    assert metrics(tmp_path)[:9] == before


FILL_THE_DISK = """
import resource, signal
from trace_rl.controller import Controller
from trace_rl.rundir import checkpoints
ctrl = Controller(CFG)
ctrl.train_step(), ctrl.train_step()  # checkpoint 2 is written
size = max(f.stat().st_size for f in (ctrl.out / "checkpoint-00000002.dist").iterdir())  # the trainer's shard
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))  # room for records, not for a checkpoint
ctrl.train_step(), ctrl.train_step()  # checkpoint 4 does not fit
"""


@pytest.mark.slow
def test_disk_full_and_corrupt_checkpoints_fall_back_to_the_previous_one(model_dir, tmp_path, capsys):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), steps=5, async_lag=1, checkpoint_every=2, **TINY)
    child = run_child(FILL_THE_DISK, cfg)
    assert child.returncode == 1, child.stderr[-3000:]
    # The OS error and the directory, not only Megatron's "Worker failure": the run's last line.
    error = f"OSError: [Errno 27] File too large (writing the trainer checkpoint): '{tmp_path.resolve()}/.checkpoint-"
    assert child.stderr.strip().splitlines()[-1].endswith(f"{error}00000004.dist.tmp'"), child.stderr[-3000:]
    assert [s for s, _ in checkpoints(tmp_path)] == [2]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]  # the failed write left nothing
    needed = step_dir(tmp_path / "records", 2)
    needed.rename(tmp_path / "aside")
    with pytest.raises(StoreError, match="checkpoint-00000002.pt needs record step 2"):
        Controller(cfg)
    (tmp_path / "aside").rename(needed)
    with Controller(cfg) as ctrl:
        assert ctrl.step == 2 and [b.step for b in ctrl.pending] == [2]
        ctrl.run()
    assert [s for s, _ in checkpoints(tmp_path)] == [4, 5]  # two kept
    want = metrics(tmp_path)
    latest = tmp_path / "checkpoint-00000005.pt"
    data = bytearray(latest.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the payload
    latest.write_bytes(bytes(data))
    with Controller(cfg) as ctrl:
        assert ctrl.step == 4 and [b.step for b in ctrl.pending] == [4]
        assert "checkpoint-00000005.pt is damaged" in capsys.readouterr().err
        ctrl.run()
    assert (tmp_path / "checkpoint-00000005.pt.corrupt").exists()
    assert metrics(tmp_path) == want
    # A damaged file of the trainer's distributed checkpoint makes the checkpoint damaged too.
    shard = next((tmp_path / "checkpoint-00000005.dist").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with Controller(cfg) as ctrl:
        assert ctrl.step == 4
        assert f"{shard.name}: hash mismatch" in capsys.readouterr().err
        ctrl.run()
    assert metrics(tmp_path) == want
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.dist")) == [
        "checkpoint-00000004.dist",
        "checkpoint-00000005.dist",
    ]


def test_resume_with_changed_numerics_is_refused_unless_forced(model_dir, tmp_path):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), steps=1, **TINY)
    with Controller(cfg) as ctrl:
        ctrl.run()
    changes = {
        "record_all_layers=True, the config has False": {"record_all_layers": False},
        "measure_all_sites=False, the config has True": {"measure_all_sites": True},
        "max_new_tokens=2, the config has 3": {"max_new_tokens": 3},
        "lr=0.0003, the config has 0.001": {"lr": 1e-3},
        "mode='trace', the config has 'qat'": {"mode": "qat"},
        "record_bits=1, the config has 2": {"record_bits": 2},
    }
    for message, change in changes.items():
        with pytest.raises(ValueError, match=f"{message} .*force_resume=true"):
            Controller(cfg.replace(**change))
    with Controller(cfg.replace(force_resume=True, lr=1e-3)) as forced:
        assert forced.step == 1 and forced.trainer.opt.param_groups[0]["lr"] == 1e-3
    with Controller(cfg, resume=False) as fresh:  # a fresh start drops the old run's checkpoints
        assert fresh.step == 0 and not checkpoints(tmp_path)
    save_checkpoint(tmp_path, 9, {"config": dataclasses.asdict(cfg), "step": 9, "trainer": {}})  # earlier rounds'
    with pytest.raises(ConfigError, match="checkpoint-00000009.pt holds the trainer in an earlier format"):
        Controller(cfg)
    (tmp_path / "checkpoint.pt").write_bytes(b"old format")
    with pytest.raises(ConfigError, match="old checkpoint format"):
        Controller(cfg)


def test_checkpoint_files_are_verified(tmp_path):
    first = save_checkpoint(tmp_path, 1, {"x": torch.arange(4)})
    second = save_checkpoint(tmp_path, 2, {"x": torch.arange(5)})
    second.write_bytes(second.read_bytes()[:-3])
    first.write_bytes(first.read_bytes()[:20])
    with pytest.raises(CorruptCheckpointError, match=r"00000002.pt is truncated .*; .*00000001.pt is truncated"):
        load_latest(tmp_path)
    assert [p for _, p in checkpoints(tmp_path)] == [first, second]  # nothing renamed
    save_checkpoint(tmp_path, 3, {"x": torch.arange(6)})
    assert [s for s, _ in checkpoints(tmp_path)] == [2, 3]
    assert torch.equal(load_latest(tmp_path).state["x"], torch.arange(6))


DATA = Path(__file__).parents[1] / "data" / "math_tiny.jsonl"


def test_changed_data_settings_are_refused_and_pending_trajectories_keep_their_prompts(tmp_path):
    from tests.hf_tiny import make_hf_checkpoint

    data = tmp_path / "math.jsonl"
    data.write_text(DATA.read_text())
    cfg = RLConfig(
        model_dir=str(make_hf_checkpoint(tmp_path / "hf")),
        out_dir=str(tmp_path / "run"),
        data=str(data),
        prompt_key="question",
        answer_key="solution.answer",
        steps=4,
        async_lag=1,
        checkpoint_every=2,
        loggers="none",
        **(TINY | {"max_new_tokens": 4}),
    )
    with Controller(cfg) as ctrl:
        ctrl.train_step(), ctrl.train_step()  # checkpoint 2, step 2's trajectories pending
    changes = {
        "shuffle=True, the config has False": {"shuffle": False},
        "system_prompt='', the config has 'Be brief.'": {"system_prompt": "Be brief."},
        "reward='exact_match', the config has 'math'": {"reward": "math"},
    }
    for message, change in changes.items():
        with pytest.raises(ValueError, match=f"{message} .*force_resume=true"):
            Controller(cfg.replace(**change))
    # Forced, or the dataset file edited under the same name: the pending trajectories are not trained against
    # prompts they were not generated from.
    for change in ({"shuffle": False}, {"system_prompt": "Be brief."}):
        with Controller(cfg.replace(force_resume=True, **change)) as ctrl:
            assert ctrl.step == 2 and [b.step for b in ctrl.pending] == [2]
            with pytest.raises(PairingError, match=r"step 2: trajectory \d was generated from prompt \d+:\w+ of"):
                ctrl.train_step()
    rows = DATA.read_text().splitlines()
    data.write_text("\n".join(rows[1:] + rows[:1]) + "\n")
    with Controller(cfg) as ctrl, pytest.raises(PairingError, match="the dataset file changed"):
        ctrl.train_step()
    data.write_text(DATA.read_text())
    with Controller(cfg) as ctrl:
        ctrl.run()
        assert ctrl.step == 4
        with pytest.raises(RuntimeError, match=r"is finished: 4 of steps=4 trained \(raise steps to go on\)"):
            ctrl.train_step()


KILL_BETWEEN_DELETIONS = """
import os, signal, pathlib
from trace_rl.controller import Controller
unlink = pathlib.Path.unlink
def unlink_then_die(self, *args, **kwargs):  # the chosen point: one checkpoint file deleted, the other not yet
    unlink(self, *args, **kwargs)
    if self.name.startswith("checkpoint-") and self.name.endswith(".pt"):
        os.kill(os.getpid(), signal.SIGKILL)
pathlib.Path.unlink = unlink_then_die
Controller(CFG, resume=False)
"""


def test_a_fresh_start_killed_between_its_deletions_does_not_resume_the_old_run(model_dir, tmp_path):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), steps=2, checkpoint_every=1, loggers="none", **TINY)
    with Controller(cfg) as ctrl:
        ctrl.run()
    assert [s for s, _ in checkpoints(tmp_path)] == [1, 2]
    child = run_child(KILL_BETWEEN_DELETIONS, cfg)
    assert child.returncode == -9, child.stderr[-3000:]
    assert len(checkpoints(tmp_path)) == 1  # the old run's other checkpoint is still there
    with Controller(cfg) as ctrl:  # the default start (resume) finishes the fresh start
        assert ctrl.step == 0 and not ctrl.pending and not checkpoints(tmp_path)
    assert not (tmp_path / ".fresh-start").exists()


KILL_BEFORE_THE_RENAME = """
import os, signal
from trace_rl.controller import Controller
replace = os.replace
def die_before_a_checkpoint_rename(src, dst, *args, **kwargs):  # the chosen point: the .pt temp file written
    if str(dst).endswith(".pt"):
        os.kill(os.getpid(), signal.SIGKILL)
    replace(src, dst, *args, **kwargs)
os.replace = die_before_a_checkpoint_rename
Controller(CFG).train_step()
"""


def test_a_checkpoint_temp_file_of_a_killed_run_is_removed_at_start(model_dir, tmp_path, capsys):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), steps=2, checkpoint_every=1, loggers="none", **TINY)
    child = run_child(KILL_BEFORE_THE_RENAME, cfg)
    assert child.returncode == -9, child.stderr[-3000:]
    (temp,) = tmp_path.glob(".checkpoint-00000001.pt.*.tmp")
    assert not checkpoints(tmp_path)
    with Controller(cfg) as ctrl:
        assert ctrl.step == 0 and not temp.exists()
        assert f"removed {temp}, a temporary file of a controller that was killed" in capsys.readouterr().err
