"""The RL loop on a live SGLang server (docs/rl.md, "On a live server, one GPU"): the step breakdown, bf16 on a server
(TRACE off, the routes SGLang returns stored for R3), the summary of `trace_rl.experiments.live`, and, marked slow,
the loop itself against a real patched SGLang server on CPU started by the launcher (`tests/sglang_cpu_server.py`).
"""

from __future__ import annotations

import base64
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.sglang_server import free_port
from trace_core.records.reader import RecordReader
from trace_core.records.spec import Binding, token_digest
from trace_core.records.store import finalize_step, list_steps
from trace_rl.config import ConfigError, RLConfig
from trace_rl.controller import BREAKDOWN, Controller, step_breakdown
from trace_rl.experiments import live
from trace_rl.rollout.engine import Trajectory
from trace_rl.rollout.sglang_worker import SGLangError, SGLangWorker
from trace_rl.rollout.workers import Request
from trace_rl.server_command import capture_flags
from trace_rl.servers import port_in_use

REPO = Path(__file__).resolve().parents[2]
PARTS = [f"time/breakdown/{p}_s" for p in BREAKDOWN]


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model(4))


def _adds_up(m: dict) -> None:
    assert all(m[k] >= 0 for k in PARTS), {k: m[k] for k in PARTS}
    assert math.isclose(sum(m[k] for k in PARTS), m["time/step_s"], rel_tol=1e-9, abs_tol=1e-9)


def test_the_breakdown_parts_are_disjoint_and_add_up_to_the_step():
    got = step_breakdown(10.0, generate_s=4.0, record_wait_s=1.0, record_read_s=0.5, train_s=3.0, weight_sync_s=1.0)
    want = {"rollout": 3.0, "record_wait": 1.0, "record_read": 0.5, "train": 2.5, "weight_sync": 1.0, "idle": 2.0}
    assert got == {f"time/breakdown/{k}_s": v for k, v in want.items()}
    _adds_up(got | {"time/step_s": 10.0})


def test_an_embedded_step_carries_the_breakdown(model_dir, tmp_path):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), steps=1, prompts_per_step=2, group_size=4,
                   max_new_tokens=4, rollout_workers=1, loggers="none")  # fmt: skip
    with Controller(cfg, resume=False) as ctrl:
        m = ctrl.train_step()
    _adds_up(m)
    assert m["time/breakdown/record_wait_s"] == 0  # the embedded engine hands its records back with the trajectories
    assert 0 < m["time/breakdown/record_read_s"] == m["time/record_read_s"]
    assert m["time/breakdown/train_s"] + m["time/breakdown/record_read_s"] == pytest.approx(m["time/train_s"])


def test_bf16_runs_on_sglang_with_trace_off_and_the_routes_returned():
    keys = dict(mode="bf16", rollout_backend="sglang", sglang_launch="local", sglang_gpus="0", rollout_workers=1)
    assert capture_flags(RLConfig(**keys)) == [
        "--trace-mode", "off", "--weight-version", "0", "--enable-return-routed-experts",
    ]  # fmt: skip
    assert "--trace-mode" in capture_flags(RLConfig(**keys | {"mode": "trace"}))
    with pytest.raises(ConfigError, match="measure_all_sites=true needs an FP4 mode"):
        RLConfig(**keys, measure_all_sites=True)


def _bf16_worker(tmp_path: Path) -> SGLangWorker:
    w = object.__new__(SGLangWorker)  # no server: only what _store_routes and _check_bf16 read
    w.url, w.cfg, w._version, w.bf16 = "http://stand-in", RLConfig(), 3, True
    w.route_shape = (2, 2, 4)
    return w


def test_a_bf16_worker_stores_the_routes_sglang_returned_bound_to_the_rollout(tmp_path):
    w = _bf16_worker(tmp_path)
    store = tmp_path / "records"
    tokens = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([5, 6, 1])]
    routes = [torch.randint(0, 4, (len(t) - 1, 2, 2), dtype=torch.int32) for t in tokens]
    outs = [{"meta_info": {"routed_experts": base64.b64encode(r.numpy().tobytes()).decode()}} for r in routes]
    trajs = [Trajectory(t, 2, torch.zeros(len(t) - 2), None, recorded=len(t) - 1, attempt="a1") for t in tokens]
    req = Request(0, 3, [t[:2] for t in tokens], (4, 5), 0, str(store), attempt="a1")
    w._store_routes(req, trajs, outs)
    finalize_step(store, 3)
    reader = RecordReader(store, 3)
    assert reader.trajectories() == ["4", "5"]
    reader.check_bindings(
        {
            str(r): Binding(3, 3, str(r), "a1", token_digest(t.tokens), w.cfg.recipe)
            for r, t in zip((4, 5), trajs, strict=True)
        }
    )
    got = reader.load([("4", 0, 4), ("5", 0, 2)])
    assert not got.records
    assert torch.equal(got.routes[0, :4], routes[0]) and torch.equal(got.routes[1, :2], routes[1])

    far = routes[0].clone()
    far[1, 0, 1] = 4  # the model has 4 experts
    bad = {
        "none": ({"meta_info": {}}, "no meta_info.'routed_experts'. .start the server with --enable-return-routed"),
        "not base64": ({"meta_info": {"routed_experts": "*"}}, "is not base64"),
        "length": ({"meta_info": {"routed_experts": base64.b64encode(bytes(8)).decode()}}, "holds 2 ids, not 4 "),
        "ids": ({"meta_info": {"routed_experts": base64.b64encode(far.numpy().tobytes()).decode()}}, "outside 0..3"),
    }
    for out, match in bad.values():
        with pytest.raises(SGLangError, match=match):
            w._store_routes(Request(0, 4, [tokens[0][:2]], (4,), 0, str(store), "a1"), trajs[:1], [out])


def test_a_bf16_worker_refuses_a_server_that_runs_trace_or_returns_no_routes(tmp_path):
    w = _bf16_worker(tmp_path)
    w._check_bf16({"trace_mode": "off", "enable_return_routed_experts": True})
    with pytest.raises(SGLangError, match="runs --trace-mode emulate .FP4 numerics.; start it with --trace-mode off"):
        w._check_bf16({"trace_mode": "emulate", "enable_return_routed_experts": True})
    with pytest.raises(SGLangError, match="does not return routes: start it with --enable-return-routed-experts"):
        w._check_bf16({"trace_mode": "off", "enable_return_routed_experts": False})


def _history(mode: str, step_s: float, n: int = 3) -> list[dict]:
    parts = dict(rollout=0.4, record_wait=0.1, record_read=0.05, train=step_s - 0.75, weight_sync=0.1, idle=0.1)
    return [
        {"step": i, "mode": mode, "reward/mean": 0.5, "train_rollout_logprob_abs_diff": 0.01,
         "train_rollout_logprob_diff_max": 0.1, "train_rollout_logprob_diff_min": -0.1, "train_rollout_k3_kl": 1e-4,
         "train_rollout_extreme_token_frac_tau2": 0.0, "time/step_s": step_s * (3 if i == 0 else 1),
         "rollout/restarts": 0.0} | {f"time/breakdown/{k}_s": v for k, v in parts.items()}
        for i in range(n)
    ]  # fmt: skip


def test_the_live_summary_reports_the_breakdown_the_overhead_and_the_embedded_mismatch(tmp_path):
    args = live.parser().parse_intermixed_args([str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    run = live.Live(args)
    run.runs = {"addition": {"live": {"qat": _history("qat", 1.0), "trace": _history("trace", 1.05)},
                             "embedded": {"trace": _history("trace", 0.5)}}}  # fmt: skip
    run.info = {"addition/live/qat": {"steps": 3, "server_start_s": 42.0}}
    run.write()
    out = tmp_path / "out"
    for name in ("summary.txt", "summary.json", "metrics.csv", "mismatch_reward.png", "code_flip_per_layer.png",
                 "step_breakdown.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "summary.json").read_text())
    o = data["overhead"]["addition"]["live"]
    assert o["overhead (mean)"] == pytest.approx(0.05) and o["Δ train s"] == pytest.approx(0.05)  # first step left out
    assert data["mismatch"]["addition"]["embedded"]["trace"]["|Δ logp| mean"] == 0.01
    text = (out / "summary.txt").read_text()
    assert "E2E step-time overhead of trace over qat: +5.0 % (mean)" in text and "server start" in text
    assert (tmp_path / "work" / "addition" / "live" / "summary.txt").exists()  # what make demo writes, per backend


def test_record_store_gives_every_run_a_store_of_its_own_under_it(tmp_path):
    """`--record-store DIR`: each run's `record_store` is `DIR/<task>/<backend>/<mode>` (the controller refuses a
    store shared by two run directories); without it, the store stays in the run directory."""
    argv = [str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--device", "cpu"]
    run = live.Live(live.parser().parse_intermixed_args([*argv, "--record-store", str(tmp_path / "shm")]))
    stores = {(t, b, m): run.config(t, b, m).record_store_dir() for t in ("addition", "math") for b in ("live",
              "embedded") for m in ("qat", "trace")}  # fmt: skip
    assert stores[("math", "live", "trace")] == tmp_path / "shm" / "math" / "live" / "trace"
    assert len(set(stores.values())) == len(stores)
    plain = live.Live(live.parser().parse_intermixed_args(argv)).config("addition", "live", "trace")
    assert plain.record_store_dir() == tmp_path / "work" / "addition" / "live" / "trace" / "records"


# ------------------------------------------------------------------ against a real SGLang server on CPU
@pytest.mark.slow
def test_the_loop_on_a_live_cpu_sglang_server_started_by_the_launcher(model_dir, tmp_path):
    """`scripts/run_live_h200.sh`'s code path (`trace_rl.experiments.live`) on CPU: the launcher starts the real
    patched SGLang server (tests/sglang_cpu_server.py) for two steps of each mode, weights by `weight_sync =
    "tensor"` (CPU tensors through shared memory), each mode on a server of its own (bf16: TRACE off, the routes
    it returns stored for R3). Every step's breakdown adds up to its time, the
    steps fit in the run's wall time, the trace steps rounded every real token by the server's records (no RTN
    fallback), and no server is left running."""
    out, work, port = tmp_path / "out", tmp_path / "work", free_port()
    server = f"{sys.executable} {REPO / 'tests' / 'sglang_cpu_server.py'}"
    argv = [str(out), "--work", str(work), "--device", "cpu", "--tasks", "addition", "--modes", "bf16,qat,trace",
            "--steps", "2", "--budget", "3600", "--no-embedded", "--server-command", server,
            f"model_dir={model_dir}", "prompts_per_step=2", "group_size=4", "loggers=none",
            f"sglang_port_base={port}", "sglang_start_timeout_s=600", "sglang_timeout_s=300",
            "rollout_step_timeout_s=600", "weight_sync_timeout_s=300"]  # fmt: skip
    assert live.main(argv) == 0
    info = json.loads((out / "summary.json").read_text())["info"]
    for mode in ("bf16", "qat", "trace"):
        run = work / "addition" / "live" / mode
        history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in history] == [0, 1]
        for m in history:
            _adds_up(m)
            assert m["weight_sync/buckets"] >= 1 and m["weight_sync/disk_syncs"] == 0  # by tensor, no disk
            assert m["rollout/records_missing"] == 0
        assert sum(m["time/step_s"] for m in history) < info[f"addition/live/{mode}"]["wall_s"]
        assert list_steps(run / "records")[:2] == [0, 1]  # (then 2: a TRACE server opens its next step's directory)
        assert RecordReader(run / "records", 1).trajectories() == sorted(str(i) for i in range(8))
        assert not (run / "weights").exists()
    trace = [json.loads(line) for line in (work / "addition/live/trace/metrics.jsonl").read_text().splitlines()]
    assert all(m["trace/rtn_fallback_real_tokens"] == 0 for m in trace)  # every real token had the server's record
    assert all(m["time/breakdown/record_wait_s"] > 0 for m in trace)  # the server writes them behind its answer
    # the servers' own finish-path counters over each run, read from /server_info before teardown (qat records too:
    # its code-flip rates)
    for mode in ("qat", "trace"):
        [c] = info[f"addition/live/{mode}"]["server_trace"]
        assert c["requests"] >= c["trajectories_written"] >= 2 * 8 and c["failed"] == 0, (mode, c)
        assert c["finish_s"] > 0 and c["write_s"] > 0 and c["host_bytes"] > 0 and c["shards_written"] >= 2, (mode, c)
    assert info["addition/live/bf16"]["server_trace"] == [None]  # TRACE off: no capturer
    assert "server 0 TRACE finish path: " in (out / "summary.txt").read_text()
    assert not port_in_use(port)  # the launcher stopped the server


@pytest.mark.slow
def test_async_lag_on_a_live_cpu_sglang_server_files_each_rollout_under_its_step(model_dir, tmp_path):
    """async_lag = 1 against the real patched SGLang server on CPU: the rollout of step n + 1 runs on policy
    version n, the server files its records under step n + 1 (the step each request id names), bound to version
    n, and the trainer rounds every real token by them (no RTN fallback) within the staleness bound."""
    out, work, port = tmp_path / "out", tmp_path / "work", free_port()
    server = f"{sys.executable} {REPO / 'tests' / 'sglang_cpu_server.py'}"
    argv = [str(out), "--work", str(work), "--device", "cpu", "--tasks", "addition", "--modes", "trace",
            "--steps", "3", "--budget", "3600", "--no-embedded", "--server-command", server,
            f"model_dir={model_dir}", "prompts_per_step=2", "group_size=4", "loggers=none", "async_lag=1",
            f"sglang_port_base={port}", "sglang_start_timeout_s=600", "sglang_timeout_s=300",
            "rollout_step_timeout_s=600", "weight_sync_timeout_s=300"]  # fmt: skip
    assert live.main(argv) == 0
    run = work / "addition" / "live" / "trace"
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/staleness"] for m in history] == [0, 1, 1]
    assert all(m["rollout/records_missing"] == 0 and m["trace/rtn_fallback_real_tokens"] == 0 for m in history)
    for step, version in [(0, 0), (1, 0), (2, 1)]:
        reader = RecordReader(run / "records", step)
        assert reader.trajectories() == sorted(str(i) for i in range(8))
        assert {(reader.binding(t).step, reader.binding(t).policy_version) for t in reader.trajectories()} == {
            (step, version)
        }
    assert not port_in_use(port)
