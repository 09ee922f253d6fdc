"""Weight sync without disk (`trace_rl.weight_sync`): the buckets, the checks, the `tensor` and `distributed`
transports end to end, their failures and the counted disk fallback.

The receiving side is SGLang 0.5.15's own code throughout (`tests.sglang_weights.WeightReceiver`: the route's body
parsing, the tokenizer manager's normalization, `TpModelWorker`'s deserialization, `ModelRunner`'s
`update_weights_from_tensor` / `init_weights_update_group` / `update_weights_from_distributed` /
`destroy_weights_update_group`), behind the RL protocol stand-in (`tests.rl_stand_in.StandIn`: in a thread, or as
server processes the launcher's `ServerGroup` starts) and behind SGLang's real Qwen3-MoE model on CPU with TRACE's
emulate hook (`tests/sglang_weights_cpu.py`, a process of its own). Distributed groups run on gloo here; what needs
CUDA IPC or NCCL is in `tests/rl/test_weight_sync_gpu.py`. Every multi-process test is bounded by the timeouts it
passes (server start-up, `weight_sync_timeout_s`, waits for exit).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from tests.rl.test_server_group import alive, free_ports
from tests.rl_stand_in import StandIn
from trace_rl.config import ConfigError, RLConfig, load_config
from trace_rl.controller import Controller, record_spec
from trace_rl.policy import RolloutTask
from trace_rl.rollout.sglang_worker import SGLangError, SGLangPool, SGLangWorker
from trace_rl.servers import ServerGroup
from trace_rl.task import EOS
from trace_rl.trainer import MegatronTrainer
from trace_rl.warmup import HF_DIR, load_megatron_state
from trace_rl.weight_buckets import (
    MIB,
    WeightSyncError,
    check_manifest,
    checkpoint_manifest,
    dtype_name,
    iter_buckets,
    nbytes,
    plan_buckets,
)
from trace_rl.weight_sync import WeightSync

REPO = Path(__file__).resolve().parents[2]
STAND_IN = [sys.executable, str(REPO / "tests" / "stand_in_sglang.py")]
SMALL = dict(
    prompts_per_step=4,
    group_size=4,
    max_new_tokens=4,
    steps=2,
    mode="trace",
    rollout_backend="sglang",
    reward="tests.rl_small:varied_reward",
    loggers="none",
)  # varied: every step changes the policy
BUCKET_MB = 16 / 1024  # 16 KiB: the tiny model's tensors spread over several buckets, one split across two


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model(4))


@pytest.fixture(scope="module")
def trainer(model_dir) -> MegatronTrainer:
    tiny, _, state = load_megatron_state(model_dir)
    return MegatronTrainer(tiny, state, mode="trace", spec=record_spec(tiny.layers, RLConfig()), lr=1e-3,
                           max_version_diff=3)  # fmt: skip


def _cfg(model_dir: str, out: Path, *servers: StandIn, **kw) -> RLConfig:
    urls = ",".join(s.url for s in servers)
    base = dict(model_dir=model_dir, out_dir=str(out), sglang_urls=urls, rollout_workers=len(servers))
    return RLConfig(**base | SMALL | kw)


def _pool(model_dir: str, cfg: RLConfig) -> SGLangPool:
    return SGLangPool(cfg, record_spec(2, cfg), RolloutTask(str(Path(model_dir) / HF_DIR), 16, (EOS,)))


# ----------------------------------------------------------------- buckets and checks
def test_buckets_hold_every_tensor_once_in_order_within_the_bound(trainer):
    tensors = trainer.hf_weights()
    assert list(tensors) == list(trainer.hf_weights())  # the export's order is deterministic
    sizes = [nbytes(t) for t in tensors.values()]
    largest, total = max(sizes), sum(sizes)
    for limit in (1, 4096, largest - 1, largest, 3 * largest, total, 10 * total):
        plan = plan_buckets(tensors, limit)
        assert plan == plan_buckets(tensors, limit)
        assert [n for b in plan for n in b.names] == list(tensors), limit  # each tensor once, in export order
        for i, b in enumerate(plan):
            assert b.nbytes == sum(nbytes(tensors[n]) for n in b.names)
            assert b.nbytes <= limit or len(b.names) == 1, (limit, b)  # a larger tensor goes alone
            if i + 1 < len(plan):  # greedy: the next tensor did not fit
                assert b.nbytes + nbytes(tensors[plan[i + 1].names[0]]) > limit
            assert b.dtypes == tuple(dtype_name(tensors[n].dtype) for n in b.names)
            assert all(getattr(torch, d) == tensors[n].dtype for n, d in zip(b.names, b.dtypes, strict=True))
            assert b.shapes == tuple(tuple(tensors[n].shape) for n in b.names)
            meta = b.metadata()
            assert meta == {"names": list(b.names), "dtypes": list(b.dtypes), "shapes": [list(s) for s in b.shapes]}
    assert len(plan_buckets(tensors, 1)) == len(tensors) and len(plan_buckets(tensors, total)) == 1
    assert [b.nbytes for b in plan_buckets(tensors, largest - 1) if b.nbytes > largest - 1] == [largest] * sizes.count(
        largest
    )
    for bucket, ts in iter_buckets(tensors, 4096):
        assert all(t is tensors[n] for n, t in zip(bucket.names, ts, strict=True))  # contiguous: no copy
    assert plan_buckets({}, 10) == []
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        plan_buckets(tensors, 0)


def test_the_trainers_names_and_shapes_are_checked_against_the_served_checkpoint(trainer, model_dir):
    manifest = checkpoint_manifest(Path(model_dir) / HF_DIR)
    tensors = trainer.hf_weights()
    check_manifest(tensors, manifest, "hf")  # the export names exactly the checkpoint's tensors
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    renamed = {("model.layers.1.mlp.experts.2.upproj.weight" if k == name else k): v for k, v in tensors.items()}
    with pytest.raises(WeightSyncError, match=r"1 of the checkpoint's tensors not sent .*up_proj.*; 1 not in the"):
        check_manifest(renamed, manifest, "hf")
    reshaped = dict(tensors) | {name: tensors[name][:1]}
    with pytest.raises(WeightSyncError, match=r"1 of another shape .*up_proj.weight \(1, \d+\), checkpoint"):
        check_manifest(reshaped, manifest, "hf")
    with pytest.raises(WeightSyncError, match="holds no \\*.safetensors"):
        checkpoint_manifest(Path(model_dir))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["weight_sync=ipc"], "weight_sync='ipc' is not one of"),
        (["weight_sync=tensor"], "needs rollout_backend='sglang'"),
        (["weight_sync_bucket_mb=0"], "weight_sync_bucket_mb=0.0 must be > 0"),
        (["weight_sync_disk_fallback=true"], "disk is the fallback"),
        (["weight_sync_backend=mpi"], "weight_sync_backend='mpi' is not one of"),
        (["weight_sync_backend=gloo"], "needs weight_sync='distributed'"),
        (["weight_sync_master=10.0.0.1:x"], "port 'x' is not a number"),
        (
            ["rollout_backend=sglang", "sglang_urls=http://rollout-0:30000", "rollout_workers=1", "weight_sync=tensor"],
            "must run on this host",
        ),
        (
            ["rollout_backend=sglang", "sglang_urls=http://rollout-0:30000", "rollout_workers=1"]
            + ["weight_sync=distributed"],
            "needs weight_sync_master",
        ),
    ],
)
def test_bad_weight_sync_keys_are_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_weight_sync_keys_and_defaults():
    cfg = RLConfig()
    assert (cfg.weight_sync, cfg.weight_sync_bucket_mb, cfg.weight_sync_disk_fallback) == ("disk", 512.0, False)
    assert (cfg.weight_sync_backend, cfg.weight_sync_master) == ("nccl", "")
    remote = ["rollout_backend=sglang", "sglang_urls=http://rollout-0:30000", "rollout_workers=1"]
    ok = load_config(None, [*remote, "weight_sync=distributed", "weight_sync_master=10.0.0.1:29500"])
    assert ok.weight_sync_master == "10.0.0.1:29500"
    local = load_config(None, ["rollout_backend=sglang", "sglang_urls=http://127.0.0.1:1", "rollout_workers=1"]
                        + ["weight_sync=tensor", "weight_sync_disk_fallback=true"])  # fmt: skip
    assert local.weight_sync == "tensor" and local.weight_sync_disk_fallback


# ----------------------------------------------------------------- tensor, in-process servers
def test_a_run_syncs_by_tensor_without_disk(model_dir, tmp_path):
    """Two controller steps with `weight_sync = "tensor"`: every bucket through SGLang's tensor receiving code, the
    servers' weights equal the trainer's bit for bit, no checkpoint written, the metrics reported."""
    out = tmp_path / "run"
    servers = [StandIn(model_dir, (out / "records").resolve()) for _ in range(2)]
    cfg = _cfg(model_dir, out, *servers, weight_sync="tensor", weight_sync_bucket_mb=BUCKET_MB)
    with Controller(cfg) as ctrl:
        history = ctrl.run()
        final = ctrl.trainer.hf_weights()
        assert ctrl.pool.versions() == [2, 2]
    assert not (out / "weights").exists()  # nothing went through disk
    total = float(sum(nbytes(t) for t in final.values()))
    buckets = len(plan_buckets(final, int(BUCKET_MB * MIB)))
    for m in history:
        assert m["weight_sync/bytes"] == total and m["weight_sync/buckets"] == buckets > 2
        assert m["weight_sync/disk_syncs"] == m["weight_sync/disk_fallbacks"] == 0 and m["weight_sync/seconds"] > 0
        assert m["rollout/records_missing"] == 0 and m["trace/rtn_fallback_real_tokens"] == 0
    for server in servers:
        assert set(server.weights) == set(final)
        assert all(torch.equal(server.weights[n], t) for n, t in final.items())
        assert server.engine.version == 1  # the step-1 rollout sampled with version 1 (loaded at its /generate)
        updates = [req for endpoint, req in server.receiver.requests if endpoint == "/update_weights_from_tensor"]
        assert len(updates) == 2 * buckets
        assert all(r.load_format is None and len(r.serialized_named_tensors) == 1 for r in updates)  # TP = 1
        assert [r.weight_version for r in updates] == ["1"] * buckets + ["2"] * buckets
        assert [r.flush_cache for r in updates] == ([False] * (buckets - 1) + [True]) * 2


def test_a_failed_tensor_sync_raises_or_falls_back_to_disk_counted(model_dir, tmp_path, capsys):
    server = StandIn(model_dir, (tmp_path / "records").resolve())
    server.fail_tensor_update = True
    cfg = _cfg(model_dir, tmp_path, server, weight_sync="tensor", weight_sync_bucket_mb=BUCKET_MB)
    with Controller(cfg) as ctrl:
        tensors = ctrl.trainer.hf_weights()
        with pytest.raises(SGLangError, match=f"{server.url}/update_weights_from_tensor: HTTP 400: .*injected"):
            ctrl.pool.load_weights(tensors, 1)
    with Controller(cfg.replace(out_dir=str(tmp_path / "fallback"), weight_sync_disk_fallback=True)) as ctrl:
        server.store = (tmp_path / "fallback" / "records").resolve()
        history = ctrl.run()
        assert ctrl.pool.sync.disk_fallbacks == 2
        err = capsys.readouterr().err
        assert err.count("weight_sync='tensor' failed") == 2 and "falling back to disk" in err and "injected" in err
        assert [m["weight_sync/disk_fallbacks"] for m in history] == [1.0, 1.0]
        assert [m["weight_sync/disk_syncs"] for m in history] == [1.0, 1.0]
        assert [p.name for p in (tmp_path / "fallback" / "weights").iterdir()] == ["v2"]
        server.fail_tensor_update = False  # the next sync goes by tensor again
        metrics = ctrl.pool.load_weights(ctrl.trainer.hf_weights(), 3)
        assert metrics["weight_sync/disk_fallbacks"] == metrics["weight_sync/disk_syncs"] == 0
        assert ctrl.pool.versions() == [3]


def test_a_name_the_server_lacks_and_a_wrong_name_are_refused_by_name(model_dir, tmp_path, trainer):
    server = StandIn(model_dir, (tmp_path / "records").resolve())
    cfg = _cfg(model_dir, tmp_path, server, weight_sync="tensor", weight_sync_bucket_mb=BUCKET_MB)
    pool = _pool(model_dir, cfg)
    tensors = trainer.hf_weights()
    renamed = {k.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.qproj"): v for k, v in tensors.items()}
    with pytest.raises(WeightSyncError, match=r"not in the checkpoint \(first \['model.layers.0.self_attn.qproj"):
        pool.load_weights(renamed, 1)
    assert server.receiver.requests == []  # refused before anything was sent
    del server.weights["model.layers.1.mlp.gate.weight"]  # a server whose model lacks a parameter
    with pytest.raises(SGLangError, match=rf"{server.url}/update_weights_from_tensor: HTTP 400: .*no parameter for"):
        pool.load_weights(tensors, 1)


# ----------------------------------------------------------------- distributed: a group that cannot form
@pytest.mark.parametrize(
    ("join", "tp", "named"),
    [("never", 1, "no complete answer within weight_sync_timeout_s's deadline"), ("refuse", 2, "HTTP 400: .*injected")],
)
def test_a_group_that_cannot_form_fails_the_start_in_bounded_time_naming_the_server(
    model_dir, tmp_path, join, tp, named
):
    bad = StandIn(model_dir, tmp_path)  # joining needs a process of its own: the end-to-end test below
    bad.join, bad.policy = join, {"tp_size": tp}  # a TP = 2 server holds ranks 1 and 2 of 3
    cfg = _cfg(model_dir, tmp_path, bad, weight_sync="distributed", weight_sync_backend="gloo",
               weight_sync_timeout_s=3.0)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as e:
        _pool(model_dir, cfg)
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0 + 5.0 + 2.0, elapsed  # the timeout, the grace for answers, slack
    msg = str(e.value)
    assert f"weight-update group of {1 + tp} ranks (gloo) not formed" in msg and f"{bad.url} (ranks 1..{tp})" in msg
    assert re.search(named, msg) and "weight_sync_timeout_s=3.0" in msg


def test_a_server_of_several_dp_or_pp_ranks_is_refused_for_the_group(model_dir, tmp_path):
    server = StandIn(model_dir, tmp_path)
    server.policy = {"pp_size": 2}
    cfg = _cfg(model_dir, tmp_path, server, weight_sync="distributed", weight_sync_backend="gloo")
    with pytest.raises(WeightSyncError, match=rf"{server.url}: weight_sync='distributed' needs pp_size=1"):
        _pool(model_dir, cfg)
    assert server.receiver.requests == []


# ----------------------------------------------------------------- end to end with server processes
@pytest.mark.parametrize(("weight_sync", "servers"), [("distributed", 2), ("tensor", 1)])
def test_the_loop_syncs_weights_into_server_processes_bit_for_bit(model_dir, tmp_path, weight_sync, servers):
    """The launcher's `ServerGroup` starts stand-in server processes; two controller steps sync each policy into
    them (distributed: a gloo group of the trainer and both servers, ranks 1 and 2; tensor: shared memory across
    processes) and they sample with it; each server's weights after the run equal the trainer's bit for bit, the
    group is destroyed at the end and no server process is left."""
    dump, pids = tmp_path / "dump", tmp_path / "pids"
    args = f"--stand-in rl --stand-in-pids {pids}"
    cfg = RLConfig(**SMALL | dict(
        model_dir=model_dir, out_dir=str(tmp_path / "run"), sglang_launch="local", rollout_workers=servers,
        sglang_gpus=";".join(str(i) for i in range(servers)), sglang_port_base=free_ports(servers),
        sglang_start_timeout_s=300.0, weight_sync=weight_sync, weight_sync_bucket_mb=BUCKET_MB,
        weight_sync_backend="gloo" if weight_sync == "distributed" else "nccl", weight_sync_timeout_s=120.0,
    ))  # fmt: skip
    dumps = []
    with ServerGroup(cfg.replace(sglang_args=f"{args} --stand-in-dump {dump}"), command=STAND_IN) as group:
        with Controller(cfg.replace(sglang_urls=",".join(group.urls))) as ctrl:
            history = ctrl.run()
            final = ctrl.trainer.hf_weights()
            assert ctrl.pool.versions() == [2] * servers
        logs = [spec.log.read_text() for spec in group.specs]
    dumps = [load_file(dump / f"v{v}.safetensors") for v in (1, 2)]  # every server dumps to the same directory
    assert set(dumps[1]) == set(final) and all(torch.equal(dumps[1][n], t) for n, t in final.items())
    assert not all(torch.equal(dumps[0][n], t) for n, t in final.items())  # version 1 was another policy
    assert not (tmp_path / "run" / "weights").exists()
    for m in history:
        assert m["weight_sync/disk_syncs"] == 0 and m["weight_sync/buckets"] > 2
        assert m["rollout/records_missing"] == 0 and m["trace/rtn_fallback_real_tokens"] == 0
    if weight_sync == "distributed":
        for i, log in enumerate(logs):
            assert f"/init_weights_update_group rank_offset={i + 1} world_size=3 backend=gloo" in log
            assert "/destroy_weights_update_group" in log
    gone = time.monotonic() + 15
    recorded = [int(x) for x in pids.read_text().split()]
    while time.monotonic() < gone and any(alive(p) for p in recorded):
        time.sleep(0.1)
    assert len(recorded) == servers and not any(alive(p) for p in recorded)


def test_a_failed_distributed_sync_falls_back_to_disk_and_the_group_is_not_used_again(model_dir, tmp_path, capsys):
    """A server process whose distributed updates fail (answered at once, nothing received): with the fallback each
    step's sync goes by disk, counted; after the first failure the group is left alone (its collectives may be out
    of step), and the run still trains on the servers' records."""
    cfg = RLConfig(**SMALL | dict(
        model_dir=model_dir, out_dir=str(tmp_path / "run"), sglang_launch="local", rollout_workers=1, sglang_gpus="0",
        sglang_port_base=free_ports(1), sglang_start_timeout_s=300.0, weight_sync="distributed",
        weight_sync_backend="gloo", weight_sync_timeout_s=10.0, weight_sync_disk_fallback=True,
        weight_sync_bucket_mb=BUCKET_MB,
    ))  # fmt: skip
    with ServerGroup(cfg.replace(sglang_args="--stand-in rl --stand-in-fail-distributed"), command=STAND_IN) as group:
        with Controller(cfg.replace(sglang_urls=",".join(group.urls))) as ctrl:
            history = ctrl.run()
            assert ctrl.pool.versions() == [2] and ctrl.pool.sync.disk_fallbacks == 2
        log = group.specs[0].log.read_text()
    assert [m["weight_sync/disk_fallbacks"] for m in history] == [1.0, 1.0]
    assert all(m["rollout/records_missing"] == 0 for m in history)
    err = capsys.readouterr().err
    assert "weight_sync='distributed' failed" in err and "injected" in err
    assert "not used again after a failed sync" in err  # the second sync did not touch the group
    assert log.count("/update_weights_from_distributed") == 0  # failed before SGLang's code: never logged
    assert "/destroy_weights_update_group" in log


# ----------------------------------------------------------------- SGLang's real Qwen3-MoE model with TRACE emulate
@pytest.fixture(scope="module")
def sglang_model_server(tmp_path_factory):
    """`tests/sglang_weights_cpu.py` as a server process (its URL), stopped after the module."""
    port = free_ports(1)
    log = tmp_path_factory.mktemp("sglang-weights") / "server.log"
    env = os.environ | {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(REPO)}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tests.sglang_weights_cpu", "--port", str(port)], cwd=REPO,
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait(30)


@pytest.mark.parametrize("weight_sync", ["tensor", "distributed"])
def test_sglangs_qwen3_moe_takes_the_buckets_as_from_disk(sglang_model_server, tmp_path, weight_sync):
    """SGLang's real Qwen3-MoE model with TRACE emulate, updated through SGLang's own receiving code in buckets of
    1 KiB (an expert's gate and up in different buckets), holds every parameter bit for bit as the same model
    loaded from disk by SGLang's loader, its routed experts fake-quantized."""
    from tests.sglang_model_cpu import VOCAB as MODEL_VOCAB
    from tests.sglang_model_cpu import checkpoint
    from tests.sglang_weights_cpu import hf_config

    url = sglang_model_server
    weights = checkpoint(torch.Generator().manual_seed(0))
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(weights, hf / "model.safetensors")
    hf_config().to_json_file(hf / "config.json")
    cfg = RLConfig(mode="trace", rollout_backend="sglang", sglang_urls=url, rollout_workers=1, out_dir=str(tmp_path),
                   weight_sync=weight_sync, weight_sync_bucket_mb=1 / 1024, weight_sync_timeout_s=120.0,
                   weight_sync_backend="gloo" if weight_sync == "distributed" else "nccl")  # fmt: skip
    requests.post(f"{url}/stand_in/reset", json={}, timeout=60).raise_for_status()
    assert requests.get(f"{url}/stand_in/compare", timeout=60).json()["differ"]  # another checkpoint before
    worker = SGLangWorker(url, cfg, MODEL_VOCAB)
    sync = WeightSync(cfg, [worker], hf, tmp_path / "weights")
    try:
        plan = plan_buckets(weights, 1024)
        split = [b for b in plan if any(n.endswith("gate_proj.weight") for n in b.names[-1:])]
        assert split  # some expert's gate ends a bucket and its up starts the next
        metrics = sync.push(weights, 1)
    finally:
        sync.close()
    assert metrics["weight_sync/buckets"] == len(plan) and metrics["weight_sync/disk_syncs"] == 0
    result = requests.get(f"{url}/stand_in/compare", timeout=60).json()
    assert result["differ"] == [] and result["checked"] > 0 and result["experts_quantized"]
    assert worker.version() == 1
