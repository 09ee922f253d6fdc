"""`sglang_launch = "ray"` (`trace_rl.ray_servers.RayServerGroup`): the servers as Ray actors in one placement group,
one bundle per server of its GPUs (`sglang_tp`) and CPUs (`sglang_cpus`), each actor running the same command line
as a local server (here the stand-in executable, `tests/stand_in_sglang.py`). On a local Ray instance of 2 CPUs and 2
declared (logical) GPUs: placement, health, each server on the GPU Ray gave its actor, a restart in the actor's
bundle, teardown (placement group removed, no process left, also when the actor is killed), and a group the cluster
cannot hold failing within the start-up bound (the config keys: tests/rl/test_server_group.py). Bounded by the
timeouts each test passes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from tests.rl.test_server_group import STAND_IN, alive, free_ports, recorded_pids, wait_gone
from trace_rl.config import RLConfig
from trace_rl.servers import ServerGroupError

ray = pytest.importorskip("ray", reason="ray is a dependency of trace_rl; this install lacks it")
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.slow]  # one local Ray instance at a time


@pytest.fixture(scope="module", autouse=True)
def cluster():
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def config(tmp_path: Path, **kw) -> RLConfig:
    args = kw.pop("sglang_args", "--stand-in-child")
    return RLConfig(
        mode="trace",
        rollout_backend="sglang",
        sglang_launch="ray",
        rollout_workers=kw.pop("rollout_workers", 2),
        sglang_port_base=free_ports(2),
        sglang_args=f"--stand-in-pids {tmp_path / 'pids'} {args}",
        out_dir=str(tmp_path / "run"),
        model_dir=str(tmp_path / "model"),
        sglang_start_timeout_s=kw.pop("sglang_start_timeout_s", 60.0),
        **kw,
    )


def state(pg_id: str) -> str:
    return ray.util.placement_group_table()[pg_id]["state"]


def test_servers_run_in_their_bundles_and_leave_nothing_behind(tmp_path):
    from trace_rl.ray_servers import RayServerGroup

    cfg = config(tmp_path)
    with RayServerGroup(cfg, command=STAND_IN) as group:
        pg = group.pg.id.hex()
        table = ray.util.placement_group_table()[pg]
        assert table["state"] == "CREATED" and table["strategy"] == "PACK"
        assert list(table["bundles"].values()) == [{"GPU": 1.0, "CPU": 1.0}] * 2
        assert group.urls == [f"http://127.0.0.1:{cfg.sglang_port_base + i}" for i in range(2)]  # the driver's node
        assert all(requests.get(f"{u}/health", timeout=5).ok for u in group.urls)
        assert sorted(s.gpus for s in group.specs) == [(0,), (1,)]  # what Ray gave each actor
        for spec in group.specs:
            log = spec.log.read_text()
            assert f"CUDA_VISIBLE_DEVICES={spec.gpus[0]}" in log and "--tp 1 " in spec.shown()
        end = time.monotonic() + 10
        while len(recorded_pids(tmp_path)) < 4 and time.monotonic() < end:  # 2 servers + their children
            time.sleep(0.05)
        pids = recorded_pids(tmp_path)
        assert len(pids) == 4 and all(alive(p) for p in pids) and set(group.pids) <= set(pids)
    assert wait_gone(pids) == []
    assert state(pg) == "REMOVED" and group.actors == []


def test_a_dead_server_restarts_in_its_bundle_and_a_killed_actor_takes_its_server_along(tmp_path):
    from trace_rl.ray_servers import RayServerGroup

    cfg = config(tmp_path, rollout_workers=1, sglang_args="--stand-in die-after --stand-in-delay 2")
    with RayServerGroup(cfg, command=STAND_IN, kill_grace_s=2.0) as group:
        first = group.pids[0]
        assert group.exited(0, grace_s=15) == 4
        assert group.restart(0) and group.generations == [1] and group.pids[0] != first
        assert requests.get(f"{group.urls[0]}/health", timeout=5).ok
        assert "# restart 1 of 2 after exit status 4: " in group.specs[0].log.read_text()
        second = group.pids[0]
        ray.kill(group.actors[0], no_restart=True)  # the actor dies: its watchdog ends the server at once
        assert wait_gone([second], timeout_s=10) == []
        pg = group.pg.id.hex()
    assert state(pg) == "REMOVED"
    assert wait_gone(recorded_pids(tmp_path)) == []


def test_a_group_the_cluster_cannot_hold_fails_within_the_bound_naming_its_resources(tmp_path):
    from trace_rl.ray_servers import RayServerGroup

    cfg = config(tmp_path, sglang_tp=2, sglang_start_timeout_s=3.0)  # 2 servers x 2 GPUs on a 2-GPU cluster
    t0 = time.monotonic()
    with pytest.raises(ServerGroupError, match=r"could not place 2 SGLang servers of \{'GPU': 2.0, 'CPU': 1.0\}.*free"):
        with RayServerGroup(cfg, command=STAND_IN):
            pass
    assert time.monotonic() - t0 < 3.0 + 10.0
    assert all(v["state"] == "REMOVED" for v in ray.util.placement_group_table().values())
    assert recorded_pids(tmp_path) == []


def test_the_launcher_runs_on_ray_servers_and_removes_them(tmp_path, monkeypatch):
    """`scripts/launch_disagg.sh CONFIG` with `sglang_launch = "ray"` (`trace_rl.launch.main`): the controller gets
    the group's URLs and the group itself (for restarts); a failing run still removes the placement group."""
    import trace_rl.launch as launch
    from trace_rl.ray_servers import RayServerGroup

    cfg = config(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    seen = {}

    class Stop(Exception):
        pass

    class FakeController:
        def __init__(self, c: RLConfig, servers=None):
            seen["urls"], seen["group"] = c.sglang_url_list(), servers
            seen["healthy"] = all(requests.get(f"{u}/health", timeout=5).ok for u in seen["urls"])
            seen["pg"] = servers.pg.id.hex()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def run(self, desc: str):
            raise Stop

    monkeypatch.setattr(launch, "Controller", FakeController)
    monkeypatch.setattr("trace_rl.server_command.SERVER_COMMAND", STAND_IN)
    overrides = [f"{k}={getattr(cfg, k)}" for k in ("sglang_port_base", "out_dir", "model_dir", "rollout_workers")]
    overrides += ["rollout_backend=sglang", "sglang_launch=ray", "mode=qat", f"sglang_args={cfg.sglang_args}"]
    with pytest.raises(Stop):
        launch.main(overrides)
    assert isinstance(seen["group"], RayServerGroup) and seen["healthy"]
    assert seen["urls"] == [f"http://127.0.0.1:{cfg.sglang_port_base + i}" for i in range(2)]
    assert state(seen["pg"]) == "REMOVED"
    assert wait_gone(recorded_pids(tmp_path)) == []
