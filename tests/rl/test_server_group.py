"""trace_rl.servers: the launcher's supervised group of local SGLang servers, run against a stand-in server
executable (tests/stand_in_sglang.py) through the real ServerGroup: start-up, health, failures within the bound with
the log tail, an occupied port, teardown of every process group (also on SIGINT / SIGTERM of a launcher process),
a server dying mid-run, the capture policy on the command line, the launcher's wiring and the config keys. Each
test is bounded by the timeouts it passes (start-up, kill grace, waits for exit and for pids to go)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trace_rl.config import ConfigError, RLConfig, load_config
from trace_rl.servers import ServerGroup, ServerGroupError, capture_flags, server_specs

STAND_IN = [sys.executable, str(Path(__file__).parents[1] / "stand_in_sglang.py")]
REPO = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> int:
    """A base port with `n` free consecutive ports."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def config(tmp_path: Path, servers: int = 2, **kw) -> RLConfig:
    args = kw.pop("sglang_args", "")
    gpus = kw.pop("sglang_gpus", ";".join(str(i) for i in range(servers)))
    pids = tmp_path / "pids"
    return RLConfig(
        mode="trace",
        rollout_backend="sglang",
        sglang_launch="local",
        sglang_gpus=gpus,
        rollout_workers=servers,
        sglang_port_base=free_ports(servers),
        sglang_args=f"--stand-in-pids {pids} {args}".strip(),
        out_dir=str(tmp_path / "run"),
        model_dir=str(tmp_path / "model"),
        sglang_start_timeout_s=kw.pop("sglang_start_timeout_s", 20.0),
        **kw,
    )


def recorded_pids(tmp_path: Path) -> list[int]:
    path = tmp_path / "pids"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, already dead, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_a_healthy_group_gives_urls_and_leaves_no_process_after_close(tmp_path):
    cfg = config(tmp_path, sglang_args="--stand-in-child")
    with ServerGroup(cfg, command=STAND_IN) as group:
        assert group.urls == [f"http://127.0.0.1:{cfg.sglang_port_base + i}" for i in range(2)]
        import requests

        assert all(requests.get(f"{u}/health", timeout=5).status_code == 200 for u in group.urls)
        end = time.monotonic() + 10
        while len(recorded_pids(tmp_path)) < 4 and time.monotonic() < end:  # 2 servers + their children
            time.sleep(0.05)
        pids = recorded_pids(tmp_path)
        assert len(pids) == 4 and all(alive(p) for p in pids)
        log = (tmp_path / "run" / "servers" / "server1.log").read_text()
        assert "CUDA_VISIBLE_DEVICES=1" in log
    assert wait_gone(pids) == []


def test_a_server_that_exits_at_start_fails_the_launch_with_its_log_tail(tmp_path):
    cfg = config(tmp_path, sglang_args="--stand-in exit")
    t0 = time.monotonic()
    with pytest.raises(ServerGroupError) as e:
        ServerGroup(cfg, command=STAND_IN).__enter__()
    assert time.monotonic() - t0 < cfg.sglang_start_timeout_s
    msg = str(e.value)
    # both servers exit: whichever the launch sees first is named, with its own command
    server = re.search(r"SGLang server(\d) ", msg)
    assert server is not None and "exited with status 3" in msg and "invalid device ordinal" in msg, msg
    assert f"command: CUDA_VISIBLE_DEVICES={server.group(1)} " in msg and "--trace-store" in msg
    assert wait_gone(recorded_pids(tmp_path)) == []


@pytest.mark.parametrize("behaviour", ["never-healthy", "sleep"])
def test_a_server_that_never_becomes_healthy_times_out_by_name(tmp_path, behaviour):
    cfg = config(tmp_path, servers=1, sglang_args=f"--stand-in {behaviour}", sglang_start_timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(ServerGroupError, match=r"server0 .* did not answer /health within sglang_start_timeout_s=2"):
        with ServerGroup(cfg, command=STAND_IN, kill_grace_s=2.0):
            pass
    assert time.monotonic() - t0 < 2.0 + 2.0 + 3.0  # the bound, the kill grace, slack
    assert wait_gone(recorded_pids(tmp_path)) == []


def test_an_occupied_port_is_refused_by_name_before_anything_starts(tmp_path):
    cfg = config(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", cfg.sglang_port_base + 1))
        s.listen()
        with pytest.raises(ServerGroupError, match=rf"port {cfg.sglang_port_base + 1} of server1 .* already in use"):
            ServerGroup(cfg, command=STAND_IN).__enter__()
    assert recorded_pids(tmp_path) == []


@pytest.mark.parametrize("visible", ["5,7", None], ids=["launcher-devices", "host"])
def test_a_gpu_index_beyond_the_gpus_is_refused_by_name_before_anything_starts(tmp_path, monkeypatch, visible):
    """`sglang_gpus` indexes the launcher's own CUDA_VISIBLE_DEVICES (a scheduler's allocation) when it has one,
    else the host's GPUs: an index beyond them fails the launch at once, naming the server, the key and what there
    is, before any server starts."""
    import torch

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    count = 2 if visible else torch.cuda.device_count()
    cfg = config(tmp_path, servers=1, sglang_gpus=str(count), device="cuda")
    where = f"CUDA_VISIBLE_DEVICES='{visible}' of the launcher" if visible else "this host"
    named = rf"server0 \(.*\): sglang_gpus='{count}': GPU {count} does not exist: {where} has {count} GPU\(s\)"
    t0 = time.monotonic()
    with pytest.raises(ServerGroupError, match=named):
        ServerGroup(cfg, command=STAND_IN).__enter__()
    assert time.monotonic() - t0 < 5.0 and recorded_pids(tmp_path) == []


def test_server_gpus_index_the_launchers_cuda_visible_devices(tmp_path, monkeypatch):
    """Under a launcher restricted to GPUs 5 and 7, `sglang_gpus = "1;0"` puts server0 on GPU 7 and server1 on
    GPU 5 (their CUDA_VISIBLE_DEVICES, as their logs' command lines show)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    cfg = config(tmp_path, sglang_gpus="1;0", device="cuda")
    with ServerGroup(cfg, command=STAND_IN, kill_grace_s=2.0) as group:
        assert [s.env["CUDA_VISIBLE_DEVICES"] for s in group.specs] == ["7", "5"]
        heads = [s.log.read_text().splitlines()[0] for s in group.specs]
    assert heads[0].startswith("# CUDA_VISIBLE_DEVICES=7 ") and heads[1].startswith("# CUDA_VISIBLE_DEVICES=5 ")
    assert wait_gone(recorded_pids(tmp_path)) == []


def test_a_server_dying_mid_run_stops_the_run_with_its_log_tail(tmp_path):
    """With no restart allowed (`sglang_max_restarts = 0`) the monitor stops the run at once."""
    cfg = config(
        tmp_path, sglang_args="--stand-in die-after --stand-in-delay 1.5 --stand-in-child", sglang_max_restarts=0
    )
    before = signal.getsignal(signal.SIGTERM)  # whatever an earlier test of the process installed
    t0 = time.monotonic()
    with pytest.raises(ServerGroupError, match=r"(?s)server\d .* exited with status 4 while the run used it.*argv"):
        with ServerGroup(cfg, command=STAND_IN):
            time.sleep(30)  # the run, in a blocking call; the monitor stops it
    assert time.monotonic() - t0 < 15
    assert wait_gone(recorded_pids(tmp_path)) == []
    assert signal.getsignal(signal.SIGTERM) is before  # restored


def test_a_dead_server_is_restarted_on_its_port_until_its_restarts_are_spent(tmp_path):
    """`restart` starts a server that exited again (same command and port, its log appended, a new process, its
    generation moved) and does nothing to one that runs; the monitor leaves a dead server with restarts left to the
    pool, and stops the run (log tail) once they are spent."""
    import requests

    cfg = config(tmp_path, servers=1, sglang_args="--stand-in die-after --stand-in-delay 2", sglang_max_restarts=1)
    t0 = time.monotonic()
    with pytest.raises(
        ServerGroupError, match=r"(?s)server0 .* status 4 .* after 1 restarts \(sglang_max_restarts=1\)"
    ):
        with ServerGroup(cfg, command=STAND_IN) as group:
            assert group.restart(0) is False and group.generations == [0]  # it runs
            assert group.exited(0, grace_s=10) == 4
            time.sleep(2 * 1.0)  # two monitor looks: a restart is left, so the run goes on
            first = group.pids[0]
            assert group.restart(0) is True and group.generations == [1] and group.restarts == [1]
            assert group.pids[0] != first and requests.get(f"{group.urls[0]}/health", timeout=5).ok
            log = group.specs[0].log.read_text()
            assert log.count("--stand-in die-after") == 2 and "# restart 1 of 1 after exit status 4: " in log
            time.sleep(30)  # it dies again with no restart left: the monitor stops this
    assert time.monotonic() - t0 < 25
    assert wait_gone(recorded_pids(tmp_path)) == []


LAUNCHER = """
import sys, time
from trace_rl.config import RLConfig
from trace_rl.servers import ServerGroup
cfg = RLConfig(**{cfg!r})
with ServerGroup(cfg, command={cmd!r}):
    print("ready", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_launcher_leaves_no_orphan_server(tmp_path, sig):
    cfg = config(tmp_path, sglang_args="--stand-in-child")
    keys = ("mode", "rollout_backend", "sglang_launch", "sglang_gpus", "rollout_workers", "sglang_port_base")
    fields = {k: getattr(cfg, k) for k in keys + ("sglang_args", "out_dir", "model_dir", "sglang_start_timeout_s")}
    code = textwrap.dedent(LAUNCHER.format(cfg=fields, cmd=STAND_IN))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline().strip() == b"ready", proc.stderr.read().decode()
        pids = recorded_pids(tmp_path)
        assert len(pids) == 4 and all(alive(p) for p in pids)
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert wait_gone(pids) == []


def test_the_command_line_carries_the_trainers_capture_policy(tmp_path):
    import transformers

    from sglang_trace.config import served_spec
    from trace_rl.controller import capture_spec

    hf = transformers.Qwen3MoeConfig(num_hidden_layers=4, architectures=["Qwen3MoeForCausalLM"])
    for kw in (
        {},
        {"record_all_layers": False, "record_bits": 2},
        {"measure_all_sites": True},
        {"recipe": "mxfp4-w4a8-kv4"},
    ):
        cfg = config(tmp_path, sglang_gpus="0,1;2,3", sglang_args="--attention-backend triton", **kw)
        specs = server_specs(cfg, STAND_IN)
        assert [s.gpus for s in specs] == [(0, 1), (2, 3)]
        argv = list(specs[1].argv)
        assert argv[argv.index("--tp") + 1] == "2" and argv[argv.index("--port") + 1] == str(cfg.sglang_port_base + 1)
        assert argv[-2:] == ["--attention-backend", "triton"]
        flags = dict(zip(argv[::1], argv[1::1], strict=False))
        assert flags["--trace-store"] == str((tmp_path / "run" / "records").resolve())
        assert flags["--weight-version"] == "0" and flags["--trace-step"] == "0" and flags["--trace-mode"] == "emulate"
        info = {
            "trace_mode": "emulate",
            "trace_record_bits": int(flags["--trace-record-bits"]),
            "trace_layers": flags["--trace-layers"],
            "trace_sites": flags["--trace-sites"],
            "trace_store": flags["--trace-store"],
            "trace_step": 0,
            "trace_recipe": flags["--trace-recipe"],
            "trace_debug_layer": -1,
            "trace_host_ring_gb": None,
        }
        assert served_spec(info, hf) == capture_spec(4, cfg), kw  # what SGLangWorker.check_policy compares
        assert ("--kv-cache-dtype" in argv) == ("k" in flags["--trace-sites"])
    assert capture_flags(config(tmp_path, record_all_layers=False))[7] == "latter-half"
    elsewhere = capture_flags(config(tmp_path, record_store=str(tmp_path / "shm" / "store")))
    assert elsewhere[elsewhere.index("--trace-store") + 1] == str(tmp_path / "shm" / "store")  # record_store


def test_the_launcher_starts_the_group_runs_on_its_urls_and_tears_it_down(tmp_path, monkeypatch):
    import requests

    import trace_rl.launch as launch

    cfg = config(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    seen = {}

    class Stop(Exception):
        pass

    class FakeController:
        def __init__(self, c: RLConfig, servers=None):
            seen["group"] = servers
            seen["urls"] = c.sglang_url_list()
            seen["healthy"] = all(requests.get(f"{u}/health", timeout=5).ok for u in seen["urls"])
            seen["out_dir"] = c.out_dir

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def run(self, desc: str):
            raise Stop  # the run fails: the group still goes

    monkeypatch.setattr(launch, "Controller", FakeController)
    monkeypatch.setattr("trace_rl.server_command.SERVER_COMMAND", STAND_IN)
    overrides = [f"{k}={getattr(cfg, k)}" for k in ("sglang_gpus", "sglang_port_base", "out_dir", "model_dir")]
    overrides += ["rollout_backend=sglang", "sglang_launch=true", "mode=qat", f"sglang_args={cfg.sglang_args}"]
    with pytest.raises(Stop):
        launch.main(overrides)
    assert seen["urls"] == [f"http://127.0.0.1:{cfg.sglang_port_base + i}" for i in range(2)] and seen["healthy"]
    assert seen["out_dir"] == str(tmp_path / "run" / "qat")
    assert (tmp_path / "run" / "qat" / "servers" / "server0.log").exists()
    pids = recorded_pids(tmp_path)
    assert len(pids) == 2 and wait_gone(pids) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sglang_launch=maybe"], "sglang_launch='maybe' is not one of"),
        (["sglang_gpus=0;1"], "sglang_gpus='0;1' needs sglang_launch='local' or 'ray'"),
        (["sglang_launch=local", "rollout_backend=sglang", "sglang_gpus=0;x"], "sglang_gpus='0;x': 'x' is not"),
        (["sglang_launch=local", "rollout_backend=sglang", "sglang_gpus=0;0"], "gives a GPU to two servers"),
        (["sglang_launch=local", "rollout_backend=sglang", "sglang_gpus=0"], "rollout_workers=2 must equal the 1"),
        (["sglang_launch=local", "sglang_gpus=0;1"], "sglang_launch='local' needs rollout_backend='sglang'"),
        (["sglang_launch=local", "rollout_backend=sglang", "sglang_gpus=0;1", "sglang_args=--port 1"], r"\['--port'\]"),
        (
            ["sglang_launch=local", "rollout_backend=sglang", "sglang_gpus=0;1", "sglang_port_base=80"],
            "sglang_port_base=80",
        ),
        (
            ["sglang_launch=local", "rollout_backend=sglang", "sglang_gpus=0;1", "sglang_urls=http://a:1,http://b:2"],
            "must be empty",
        ),
        (["sglang_launch=ray", "rollout_backend=sglang", "sglang_gpus=0;1"], "Ray assigns the GPUs"),
        (["sglang_launch=ray", "rollout_backend=sglang", "sglang_tp=0"], "sglang_tp=0 must be >= 1"),
        (["sglang_launch=ray", "rollout_backend=sglang", "sglang_cpus=0"], "sglang_cpus=0 must be >= 1"),
        (["sglang_tp=2"], "sglang_tp=2 needs sglang_launch='ray'"),
        (["sglang_max_restarts=-1"], "sglang_max_restarts=-1 must be >= 0"),
    ],
)
def test_bad_launch_keys_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_launch_keys_from_a_file_and_their_defaults(tmp_path):
    assert (RLConfig().sglang_launch, RLConfig().sglang_gpus, RLConfig().sglang_args) == ("off", "", "")
    (tmp_path / "rl.toml").write_text(
        'rollout_backend = "sglang"\nsglang_launch = true\nsglang_gpus = ["0,1", "2,3"]\n'
        'sglang_args = ["--attention-backend", "triton", "--mem-fraction-static", "0.5"]\n'
    )
    cfg = load_config(tmp_path / "rl.toml")
    assert (cfg.sglang_launch, cfg.sglang_gpus) == ("local", "0,1;2,3")
    assert cfg.sglang_args == "--attention-backend triton --mem-fraction-static 0.5"
    assert (
        cfg.replace(sglang_urls="http://127.0.0.1:30000,http://127.0.0.1:30001").sglang_url_list()[1].endswith("30001")
    )
