"""The SGLang rollout backend (`trace_rl.rollout.sglang_worker`) against a protocol stand-in of a patched SGLang server
(`tests.rl_stand_in.StandIn`: sglang 0.5.15.post1's endpoints as read from the installed source, sampling with the
real `EmbeddedEngine` and writing records as TRACE's capturer does; its knobs inject the server faults the worker
must catch). The worker, pool, controller and trainer are the real ones.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.rl_stand_in import StandIn
from trace_core.records.reader import RecordReader
from trace_core.records.store import list_steps
from trace_rl.config import ConfigError, RLConfig
from trace_rl.controller import Controller, record_spec
from trace_rl.launch import main
from trace_rl.rollout.sglang_worker import SGLangError, SGLangWorker, StaleRolloutHandle
from trace_rl.rollout.workers import Request
from trace_rl.task import VOCAB
from trace_rl.warmup import HF_DIR

SMALL = dict(prompts_per_step=4, group_size=4, max_new_tokens=4, steps=2, mode="trace", rollout_backend="sglang")


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    out = tiny_model(4)
    return str(out)


def _cfg(model_dir: str, out: Path, *servers: StandIn, **kw) -> RLConfig:
    urls = ",".join(s.url for s in servers)
    base = dict(model_dir=model_dir, out_dir=str(out), sglang_urls=urls, rollout_workers=len(servers))
    return RLConfig(**base | SMALL | kw)


def test_config_validates_the_sglang_backend():
    ok = RLConfig(rollout_backend="sglang", sglang_urls="http://a:1, http://b:2")
    assert ok.sglang_url_list() == ["http://a:1", "http://b:2"]
    assert ok.replace(mode="bf16").mode == "bf16"  # TRACE off on the servers, their routes stored (test_rl_live.py)
    bad = {
        "rollout_backend": ({"rollout_backend": "vllm"}, "is not one of"),
        "no urls": ({"rollout_backend": "sglang", "rollout_workers": 1}, "needs sglang_urls"),
        "urls unused": ({"sglang_urls": "http://a:1"}, "needs rollout_backend='sglang'"),
        "scheme": ({"rollout_backend": "sglang", "sglang_urls": "a:1,b:2"}, "must start with http"),
        "count": ({"rollout_backend": "sglang", "sglang_urls": "http://a:1"}, "rollout_workers=2 must equal"),
        "bf16 measure": (
            {
                "rollout_backend": "sglang",
                "sglang_urls": "http://a:1,http://b:2",
                "mode": "bf16",
                "measure_all_sites": True,
            },
            "measure_all_sites=true needs an FP4 mode",
        ),
    }
    for kw, match in bad.values():
        with pytest.raises(ConfigError, match=match):
            RLConfig(**kw)


def test_controller_rolls_out_ahead_on_sglang_servers_with_async_lag(model_dir, tmp_path):
    """async_lag = 1: the rollout of step n + 1 runs on policy version n; the servers file its records under step
    n + 1 (the step named in each request id), bound to the version that produced them, and the trainer rounds
    every real token by them within the staleness bound."""
    out = tmp_path / "run"
    servers = [StandIn(model_dir, (out / "records").resolve()) for _ in range(2)]
    history = Controller(_cfg(model_dir, out, *servers, steps=3, async_lag=1)).run()
    assert [m["rollout/staleness"] for m in history] == [0, 1, 1]
    assert all(m["rollout/records_missing"] == 0 and m["trace/rtn_fallback_real_tokens"] == 0 for m in history)
    for step, version in [(0, 0), (1, 0), (2, 1)]:
        reader = RecordReader(out / "records", step)
        assert sorted(reader.trajectories(), key=int) == [str(i) for i in range(16)]
        assert {(reader.binding(t).step, reader.binding(t).policy_version) for t in reader.trajectories()} == {
            (step, version)
        }


@pytest.mark.parametrize("legacy_handle", [False, True], ids=["handle-list", "handle-dict"])
def test_controller_trains_on_sglang_servers(model_dir, tmp_path, legacy_handle):
    out = tmp_path / "run"
    servers = [StandIn(model_dir, (out / "records").resolve()) for _ in range(2)]
    for server in servers:
        server.legacy_handle = legacy_handle
    ctrl = Controller(_cfg(model_dir, out, *servers))
    history = ctrl.run()
    assert [m["step"] for m in history] == [0, 1]
    assert all(m["rollout/staleness"] == 0 for m in history)
    # Every real position was rounded by the servers' records (the final token is never fed back by SGLang).
    assert all(m["rollout/records_missing"] == 0 and m["trace/rtn_fallback_real_tokens"] == 0 for m in history)
    assert list_steps(out / "records") == [0, 1]
    assert sorted(RecordReader(out / "records", 1).trajectories(), key=int) == [str(i) for i in range(16)]
    assert ctrl.pool.versions() == [2, 2] and [s.engine.version for s in servers] == [2, 2]
    assert [p.name for p in (out / "weights").iterdir()] == ["v2"]
    assert servers[0].updates[-1] == {"model_path": str((out / "weights" / "v2").resolve()), "weight_version": "2"}


def _request(store: Path, step: int = 0) -> Request:
    return Request(0, step, torch.tensor([[3, 4, 5, 6]] * 2), (4, 5), seed=0, store=str(store)).next_attempt()


def test_stale_handle_is_an_error(model_dir, tmp_path):
    server = StandIn(model_dir, tmp_path, step_offset=1)  # records under a policy version the worker did not push
    worker = SGLangWorker(server.url, _cfg(model_dir, tmp_path, server), VOCAB)
    with pytest.raises(StaleRolloutHandle, match="records of step 0 by policy version 1 .* pushed policy version 0"):
        worker.generate(_request(tmp_path))
    with pytest.raises(
        StaleRolloutHandle, match="rollout step 3 sent to http://127.0.0.1:\\d+, which serves .* async_lag=0"
    ):
        worker.generate(_request(tmp_path, step=3))


def test_handle_of_another_store_and_missing_records(model_dir, tmp_path):
    server = StandIn(model_dir, tmp_path / "elsewhere")
    worker = SGLangWorker(server.url, _cfg(model_dir, tmp_path, server), VOCAB)
    with pytest.raises(SGLangError, match="record handle fields .* do not match the request"):
        worker.generate(_request(tmp_path / "records"))
    server.store, server.drop_records = tmp_path / "records", True
    worker = SGLangWorker(server.url, _cfg(model_dir, tmp_path, server, sglang_timeout_s=0.5), VOCAB)
    with pytest.raises(SGLangError, match=r"records of trajectories \['4', '5'\] did not reach"):
        worker.generate(_request(tmp_path / "records"))


def test_weight_sync_failures_name_the_server_and_response(model_dir, tmp_path):
    server = StandIn(model_dir, tmp_path / "records")
    ctrl = Controller(_cfg(model_dir, tmp_path, server, rollout_workers=1))
    tensors = ctrl.trainer.hf_weights()
    server.fail_update = True
    with pytest.raises(SGLangError, match=f"{server.url}/update_weights_from_disk: HTTP 400: .*injected"):
        ctrl.pool.load_weights(tensors, 1)
    server.fail_update, server.ignore_version = False, True
    with pytest.raises(SGLangError, match=f"{server.url}: .*Succeeded.* reports weight_version 0, not 1"):
        ctrl.pool.load_weights(tensors, 1)
    server.weight_version = "default"
    with pytest.raises(SGLangError, match="weight_version='default'.*--weight-version 0"):
        SGLangWorker(server.url, ctrl.cfg, VOCAB)
    with pytest.raises(SGLangError, match="http://127.0.0.1:9/model_info: ConnectionRefusedError"):
        SGLangWorker("http://127.0.0.1:9", ctrl.cfg, VOCAB)


def test_launch_runs_one_mode_on_sglang_servers(model_dir, tmp_path):
    servers = [StandIn(model_dir, (tmp_path / "trace" / "records").resolve()) for _ in range(2)]
    urls = ",".join(s.url for s in servers)
    args = [f"model_dir={model_dir}", f"out_dir={tmp_path}", "rollout_backend=sglang", f"sglang_urls={urls}"]
    args += ["steps=1", "prompts_per_step=4", "group_size=4", "max_new_tokens=4"]
    with pytest.raises(ConfigError, match="runs one mode"):
        main(["--modes", "qat,trace", *args])
    assert list(main(args)) == ["trace"]
    assert len((tmp_path / "trace" / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize(
    "policy, named",
    [
        ({"trace_record_bits": 2}, "bits: server 2, trainer 1"),
        ({"trace_layers": "latter-half"}, "moe_layers: server (1,), trainer (0, 1)"),
        ({"trace_sites": "moe_in"}, "attn_layers: server (), trainer (0, 1)"),
        ({"trace_mode": "off"}, "the server records nothing"),
        ({"trace_sites": "none"}, "trace_sites='none': the server runs the FP4 numerics of nvfp4-w4a4-kv4 but records"),
    ],
)
def test_a_server_capturing_another_policy_is_refused_by_name(model_dir, tmp_path, policy, named):
    """One capture policy: the pool reads each server's `--trace-*` settings from `/server_info` at start-up and
    refuses one whose record spec differs from the trainer's (its records would leave trainer sites to RTN)."""
    from trace_rl.policy import RolloutTask
    from trace_rl.rollout.sglang_worker import SGLangPool
    from trace_rl.task import EOS

    server = StandIn(model_dir, tmp_path)
    server.policy = policy
    try:
        cfg = _cfg(model_dir, tmp_path, server)
        task = RolloutTask(str(Path(model_dir) / HF_DIR), 16, (EOS,))
        with pytest.raises(SGLangError, match=re.escape(named)):
            SGLangPool(cfg, record_spec(2, cfg), task)
        server.policy = {}
        SGLangPool(cfg, record_spec(2, cfg), task)  # the same server with the trainer's policy is taken
    finally:
        server.server.shutdown()


@pytest.mark.parametrize(
    "mode, serves, named",
    [
        ("trace", dict(hidden=128), "hidden: server 128, trainer 64"),
        (
            "trace",
            dict(num_layers=3, moe_layers=[0, 1, 2]),
            "num_layers: server 3, trainer 2; moe_layers: server [0, 1, 2]",
        ),
        ("qat", dict(num_experts=16), "num_experts: server 16, trainer 4"),
        ("trace", dict(architectures=["LlamaForCausalLM"]), "architectures: server ['LlamaForCausalLM'], trainer"),
        ("bf16", dict(architectures=["LlamaForCausalLM"]), "architectures: server ['LlamaForCausalLM'], trainer"),
        ("trace", None, "/server_info reports no TRACE model layout"),
    ],
)
def test_a_server_running_another_model_is_refused_by_name_at_start(model_dir, tmp_path, mode, serves, named):
    """The pool's start-up refuses a server that serves another model than the trainer's, naming what differs: the
    architectures of its `/model_info` in every mode, and with TRACE on the model layout its capturer reports in
    `/server_info` (layers, widths, experts, ...); a TRACE server that reports no layout is refused too. The same
    server serving the trainer's model is taken."""
    from trace_rl.policy import RolloutTask
    from trace_rl.rollout.sglang_worker import SGLangPool
    from trace_rl.task import EOS

    server = StandIn(model_dir, tmp_path)
    if mode == "bf16":
        server.policy = {"trace_mode": "off", "enable_return_routed_experts": True}
    layout, archs = dict(server.layout), list(server.architectures)
    if serves is None:
        server.layout = None
    else:
        server.architectures = serves.pop("architectures", archs)
        server.layout = layout | serves
    try:
        cfg = _cfg(model_dir, tmp_path, server, mode=mode)
        task = RolloutTask(str(Path(model_dir) / HF_DIR), 16, (EOS,))
        with pytest.raises(SGLangError, match=f"serves another model .*{re.escape(named)}|{re.escape(named)}"):
            SGLangPool(cfg, record_spec(2, cfg), task)
        server.layout, server.architectures = layout, archs
        SGLangPool(cfg, record_spec(2, cfg), task)
    finally:
        server.server.shutdown()
