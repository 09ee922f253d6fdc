"""Colocation memory handoff (`colocate = true`, `trace_rl.rollout.colocate`): around every trainer step the pool
releases the servers' GPU memory and resumes it (weights, the weight sync, then KV cache and CUDA graphs), each
timed in the step metrics; a server without the memory saver is refused; a launched server whose SGLang refuses
`--enable-memory-saver` (no torch_memory_saver package) ends the launch naming `colocate`.

No SGLang server runs on a CPU, so the servers are the RL protocol stand-in (`tests.rl_stand_in.StandIn`), whose
release / resume routes parse their bodies as SGLang 0.5.15's routes do and keep the state SGLang's
`WeightUpdater` keeps (released tags, weights undefined after their resume until a complete update, release only
when idle), and refuse a rollout on released or undefined memory. That the memory is given back on a GPU (and the
FP4 KV pool and TRACE's capture buffers with it) needs an H200 and torch_memory_saver: not run."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

from tests.rl.test_server_group import free_ports
from tests.rl.test_weight_sync import BUCKET_MB, SMALL, STAND_IN, _cfg
from tests.rl_stand_in import StandIn
from trace_rl.config import ConfigError, RLConfig, load_config
from trace_rl.controller import Controller, export_device
from trace_rl.rollout.sglang_worker import SGLangError
from trace_rl.servers import MEMORY_SAVER_FLAG, ServerGroup, ServerGroupError, server_specs


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model(4))


def _servers(model_dir: str, out: Path, n: int) -> list[StandIn]:
    servers = [StandIn(model_dir, (out / "records").resolve()) for _ in range(n)]
    for s in servers:
        s.memory_saver = True
    return servers


def test_a_colocated_tensor_sync_on_cuda_exports_the_policy_on_the_trainers_gpu():
    """CUDA IPC only where the servers share the trainer's GPUs and take its tensors: colocated `tensor` on CUDA."""
    base = dict(rollout_backend="sglang", sglang_launch="local", sglang_gpus="0", rollout_workers=1)
    assert export_device(RLConfig(**base, colocate=True, weight_sync="tensor", device="cuda")) == "cuda"
    assert export_device(RLConfig(**base, colocate=False, weight_sync="tensor", device="cuda")) == "cpu"
    assert export_device(RLConfig(**base, colocate=True, weight_sync="disk", device="cuda")) == "cpu"
    assert export_device(RLConfig(**base, colocate=True, weight_sync="tensor", device="cpu")) == "cpu"


@pytest.mark.parametrize("weight_sync", ["tensor", "disk"])
def test_each_step_releases_then_resumes_weights_syncs_and_resumes_the_rest(model_dir, tmp_path, weight_sync):
    """Two colocated steps on two servers: per step, after the rollout every server releases all its memory, and
    after the trainer step resumes its weights, takes the whole new policy (every bucket), then resumes its KV cache
    and CUDA graphs before the next rollout; the servers end with the trainer's weights, every record is there, and
    the release and resume times are in the metrics (`time/step_s` is the sum of its parts)."""
    out = tmp_path / "run"
    servers = _servers(model_dir, out, 2)
    cfg = _cfg(model_dir, out, *servers, colocate=True, weight_sync=weight_sync, weight_sync_bucket_mb=BUCKET_MB)
    with Controller(cfg) as ctrl:
        history = ctrl.run()
        final = ctrl.trainer.hf_weights()
        assert ctrl.pool.versions() == [2, 2] and not ctrl.pool.memory.asleep
    update = "update tensor" if weight_sync == "tensor" else "update disk"
    step = ["release cuda_graph,kv_cache,weights", "resume weights"]
    for server in servers:
        want = ["generate", *step, f"{update} v1", "resume cuda_graph,kv_cache", "generate", *step, f"{update} v2"]
        want.append("resume cuda_graph,kv_cache")
        assert server.events == want, server.events
        assert server.offloaded == set() and not server.weights_lost
        assert all(torch.equal(server.weights[n], t) for n, t in final.items())
    for m in history:
        assert m["time/release_s"] > 0 and m["time/resume_s"] > 0 and m["weight_sync/restarts"] == 0
        parts = m["time/rollout_s"] + m["time/release_s"] + m["time/train_s"] + m["time/sync_s"]
        assert abs(m["time/step_s"] - parts) < 1e-3 and m["time/resume_s"] < m["time/sync_s"]
        assert m["rollout/records_missing"] == 0 and m["trace/rtn_fallback_real_tokens"] == 0


def test_a_rollout_on_released_memory_is_refused_and_so_is_a_server_without_the_saver(model_dir, tmp_path):
    out = tmp_path / "run"
    (server,) = _servers(model_dir, out, 1)
    cfg = _cfg(model_dir, out, server, colocate=True)
    with Controller(cfg) as ctrl:
        batch = ctrl.rollout(0)
        assert ctrl.pool.release_memory() > 0 and server.offloaded == {"weights", "kv_cache", "cuda_graph"}
        with pytest.raises(SGLangError, match="memory is released; load_weights .* comes first"):
            ctrl.rollout(1)
        assert server.events == ["generate", "release cuda_graph,kv_cache,weights"]  # nothing reached the server
        assert len(batch.trajectories) == SMALL["prompts_per_step"] * SMALL["group_size"]
    server.memory_saver = False
    with pytest.raises(SGLangError, match=rf"colocate=true needs SGLang servers started with --enable-memory-saver; "
                                          rf"\['{server.url}'\] report enable_memory_saver false"):  # fmt: skip
        Controller(cfg.replace(out_dir=str(tmp_path / "again")))


def test_launched_servers_get_the_memory_saver_and_a_server_that_refuses_it_names_colocate(model_dir, tmp_path):
    """The launcher adds `--enable-memory-saver` with `colocate`; a server that exits at start because SGLang
    finds no torch_memory_saver (here: the stand-in runs the check SGLang's launcher runs for the flag) ends the
    launch within the start-up bound, its log tail and a line naming `colocate` and the package."""
    if importlib.util.find_spec("torch_memory_saver") is not None:
        pytest.skip("torch_memory_saver is installed here: SGLang would accept the flag")
    cfg = _cfg(model_dir, tmp_path, colocate=True, sglang_launch="local", sglang_gpus="0", rollout_workers=1,
               sglang_urls="", sglang_port_base=free_ports(1), sglang_start_timeout_s=120.0)  # fmt: skip
    assert MEMORY_SAVER_FLAG in server_specs(cfg, STAND_IN)[0].argv
    assert MEMORY_SAVER_FLAG not in server_specs(cfg.replace(colocate=False), STAND_IN)[0].argv
    t0 = time.monotonic()
    with pytest.raises(ServerGroupError) as e:
        with ServerGroup(cfg, command=STAND_IN):
            pass
    assert time.monotonic() - t0 < cfg.sglang_start_timeout_s
    msg = str(e.value)
    assert "server0" in msg and "exited with status 1 before it was healthy" in msg
    assert "torch-memory-saver is not installed" in msg  # SGLang's own warning, in the log tail
    assert "colocate=true starts the servers with --enable-memory-saver, which needs the torch_memory_saver" in msg


def test_colocate_needs_the_sglang_backend():
    with pytest.raises(ConfigError, match="colocate=true needs rollout_backend='sglang'"):
        load_config(None, ["colocate=true"])
    assert RLConfig().colocate is False
