"""A launched SGLang server that dies mid-run (`trace_rl.servers.ServerGroup.restart`, `sglang_max_restarts`): the
stand-in server processes the launcher's group starts (`tests/stand_in_sglang.py --stand-in rl`: generation,
records, weight updates through SGLang's receiving code) exit during a `/generate`; the pool restarts the server,
brings it to the current policy version by the run's transport and runs its request again as a new attempt, and
the step's records are complete. A server that keeps dying stops the run with its log tail once its restarts are
spent. Each test is bounded by the timeouts it passes (server start-up, weight sync, kill grace)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.rl.test_server_group import alive, free_ports
from tests.rl.test_weight_sync import BUCKET_MB, SMALL, STAND_IN
from trace_core.records.reader import RecordReader
from trace_rl.config import RLConfig
from trace_rl.controller import Controller
from trace_rl.servers import ServerGroup, ServerGroupError


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model(4))


def _cfg(model_dir: str, tmp_path: Path, servers: int, **kw) -> RLConfig:
    return RLConfig(**SMALL | dict(
        model_dir=model_dir, out_dir=str(tmp_path / "run"), sglang_launch="local", rollout_workers=servers,
        sglang_gpus=";".join(str(i) for i in range(servers)), sglang_port_base=free_ports(servers),
        sglang_start_timeout_s=300.0, weight_sync_timeout_s=120.0, weight_sync_bucket_mb=BUCKET_MB,
    ) | kw)  # fmt: skip


def _gone(pids: list[int], timeout_s: float = 15.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


@pytest.mark.slow
@pytest.mark.parametrize(("weight_sync", "servers"), [("disk", 1), ("tensor", 1), ("distributed", 2)])
def test_a_server_killed_mid_request_is_restarted_and_its_request_retried(model_dir, tmp_path, weight_sync, servers):
    """The last server exits during its second `/generate` (step 1, after the sync of policy 1); the pool restarts
    it (its log appended), gives it policy 1 (disk: the kept export; tensor: the trainer's tensors; distributed: a
    new group with every server) and runs the request again as a new attempt. Step 1 counts one restart, every
    trajectory has its records, and after the run every server holds the trainer's final weights."""
    dump, pids, once = tmp_path / "dump", tmp_path / "pids", tmp_path / "died"
    cfg = _cfg(model_dir, tmp_path, servers, weight_sync=weight_sync)
    if weight_sync == "distributed":
        cfg = cfg.replace(weight_sync_backend="gloo")
    victim = servers - 1
    args = f"--stand-in rl --stand-in-pids {pids} --stand-in-dump {dump} --stand-in-die-at 2 --stand-in-die-once "
    args += f"{once} --stand-in-die-port {cfg.sglang_port_base + victim}"
    with ServerGroup(cfg.replace(sglang_args=args), command=STAND_IN) as group:
        with Controller(cfg.replace(sglang_urls=",".join(group.urls)), servers=group) as ctrl:
            history = ctrl.run()
            final = ctrl.trainer.hf_weights()
            assert ctrl.pool.versions() == [2] * servers
            store = ctrl.store
        assert group.restarts[victim] == 1 and once.exists()
        log = group.specs[victim].log.read_text()
    assert "exiting during /generate call 2 (injected)" in log and "# restart 1 of 2 after exit status 9: " in log
    assert [m["rollout/restarts"] for m in history] == [0.0, 1.0]
    for m in history:
        assert m["rollout/records_missing"] == 0 and m["trace/rtn_fallback_real_tokens"] == 0
    assert len(RecordReader(store, 1).trajectories()) == SMALL["prompts_per_step"] * SMALL["group_size"]
    if weight_sync == "distributed":  # the group was formed again with the restarted server
        assert log.count("/init_weights_update_group rank_offset=2 world_size=3 backend=gloo") == 2
    last = load_file(dump / "v2.safetensors")
    assert set(last) == set(final) and all(torch.equal(last[n], t) for n, t in final.items())
    assert _gone([int(x) for x in pids.read_text().split()])


@pytest.mark.slow
def test_a_server_that_keeps_dying_stops_the_run_with_its_log_tail(model_dir, tmp_path):
    """A server that exits at every `/generate`: restarted once (`sglang_max_restarts = 1`), then the run stops
    with a `ServerGroupError` naming it, its restarts and its log tail; no server process is left."""
    pids = tmp_path / "pids"
    cfg = _cfg(model_dir, tmp_path, 1, sglang_max_restarts=1)
    args = f"--stand-in rl --stand-in-pids {pids} --stand-in-die-at 1"
    t0 = time.monotonic()
    with pytest.raises(ServerGroupError) as e:
        with ServerGroup(cfg.replace(sglang_args=args), command=STAND_IN) as group:
            with Controller(cfg.replace(sglang_urls=",".join(group.urls)), servers=group) as ctrl:
                ctrl.run()
    msg = str(e.value)
    assert "server0" in msg and "exited with status 9" in msg and "after 1 restarts (sglang_max_restarts=1)" in msg
    assert "exiting during /generate call 1 (injected)" in msg  # the log tail
    assert time.monotonic() - t0 < 2 * cfg.sglang_start_timeout_s
    assert _gone([int(x) for x in pids.read_text().split()])
