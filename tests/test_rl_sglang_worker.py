"""The SGLang rollout backend (`trace_rl.sglang_worker`) against a protocol stand-in of a patched SGLang server.

A real SGLang server cannot run here (no sglang-kernel, no CUDA), so `StandIn` is a stdlib `http.server` in a
thread that speaks the JSON of sglang 0.5.15.post1's endpoints as read from the installed source:
`/generate` (`GenerateReqInput`: batched `input_ids`, `rid`, `sampling_params`, `return_logprob`; each output
`{"output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version",
"output_token_logprobs": [[logprob, token_id, None], ...], "trace": [None, ..., handle]}}`: TRACE's handle rides
SGLang's per-output-token `customized_info` channel, so `meta_info["trace"]` is a list with the handle at the last
output token; the pre-0.5.15 dict form is still read, `legacy_handle`), `/update_weights_from_disk`
(`UpdateWeightFromDiskReqInput.model_path` / `weight_version` -> `{"success", "message", "num_paused_requests"}`,
HTTP 400 on failure) and `/model_info` (`weight_version`), behind SGLang's own `--api-key` / `--admin-api-key`
decision (`sglang.srt.utils.auth.decide_request_auth`, with the endpoints' auth levels of `http_server.py`). It
samples with the real `EmbeddedEngine` (the same FP4 numerics) and, like `sglang_trace`'s capturer, writes each
request's records of positions [0, seqlen - 1) with a `trace_core.store.StepWriter` under the step of its integer
weight version, bound to the trajectory and attempt of the request id, on a background thread after answering.
Its knobs inject the server faults the worker must catch. The worker, pool, controller and trainer are the real ones.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

# SGLang's package root imports its server dependencies (pybase64, ...): installed by `make setup`.
from sglang.srt.utils.auth import AuthLevel, decide_request_auth

from tests.sglang_server import stand_in_server_info
from trace_core.records import Binding, token_digest
from trace_core.store import StepWriter, TrajectoryRecords, list_steps, parse_rollout_rid, write_failure
from trace_core.store_reader import RecordReader
from trace_rl.config import ConfigError, RLConfig
from trace_rl.controller import Controller, record_spec
from trace_rl.engine import EmbeddedEngine
from trace_rl.launch import main
from trace_rl.sglang_worker import SGLangError, SGLangWorker, StaleRolloutHandle
from trace_rl.task import VOCAB
from trace_rl.warmup import HF_DIR, load_megatron_state
from trace_rl.workers import Request

SMALL = dict(prompts_per_step=4, group_size=4, max_new_tokens=4, steps=2, mode="trace", rollout_backend="sglang")
AUTH_LEVELS = {  # sglang 0.5.15.post1 http_server.py
    "/generate": AuthLevel.NORMAL,
    "/model_info": AuthLevel.NORMAL,
    "/server_info": AuthLevel.NORMAL,
    "/update_weights_from_disk": AuthLevel.ADMIN_OPTIONAL,
}


def _truncate(tr: TrajectoryRecords, rows: int) -> TrajectoryRecords:
    """Records of the first `rows` positions (SGLang never feeds back the last sampled token)."""
    recs = {
        site: dataclasses.replace(
            r,
            low_bits=r.low_bits[:rows],
            scales=r.scales[:rows],
            global_scale=r.global_scale[:rows]
            if r.global_scale is not None and r.global_scale.dim()
            else r.global_scale,
        )
        for site, r in tr.records.items()
    }
    return TrajectoryRecords(rows, recs, None if tr.routes is None else tr.routes[:rows])


class StandIn:
    """A patched SGLang server's HTTP protocol over an `EmbeddedEngine` (see the module docstring)."""

    def __init__(self, model_dir: str, store: Path, *, weight_version: str = "0", step_offset: int = 0):
        tiny, _, _ = load_megatron_state(model_dir)
        cfg = RLConfig(model_dir=model_dir)
        self.engine = EmbeddedEngine(
            str(Path(model_dir) / HF_DIR), fp4=True, spec=record_spec(tiny.layers, cfg), max_batch=16, max_len=32
        )
        self.store, self.weight_version, self.step_offset = store, weight_version, step_offset
        self.policy: dict[str, object] = {}  # --trace-* fields /server_info reports beyond the defaults
        self.fail_update = self.ignore_version = self.drop_records = self.fail_records = False
        self.delay = 0.0  # seconds /generate takes before answering
        self.api_key: str | None = None
        self.admin_api_key: str | None = None
        self.tamper = None  # called with the answers of every /generate before they are sent
        self.legacy_handle = False  # meta_info["trace"] as the handle dict itself (TRACE on SGLang 0.5.10)
        self.updates: list[dict] = []
        self.seed = 0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _allowed(self, method: str) -> bool:
                decision = decide_request_auth(
                    method=method,
                    path=self.path,
                    authorization_header=self.headers.get("Authorization"),
                    api_key=stand_in.api_key,
                    admin_api_key=stand_in.admin_api_key,
                    auth_level=AUTH_LEVELS[self.path],
                )
                if not decision.allowed:
                    self._send(decision.error_status_code, {"error": "Unauthorized"})
                return decision.allowed

            def do_GET(self) -> None:
                assert self.path in ("/model_info", "/server_info"), self.path
                if not self._allowed("GET"):
                    return
                if self.path == "/server_info":
                    self._send(200, stand_in_server_info(trace_store=str(stand_in.store), **stand_in.policy))
                    return
                info = {"model_path": model_dir, "is_generation": True, "weight_version": stand_in.weight_version}
                self._send(200, info)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if not self._allowed("POST"):
                    return
                self._send(*getattr(stand_in, self.path.strip("/"))(body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def generate(self, body: dict) -> tuple[int, object]:
        sp = body["sampling_params"]
        assert body["return_logprob"] is True and len(body["rid"]) == len(body["input_ids"])
        self.seed += 1
        out = self.engine.generate(
            torch.tensor(body["input_ids"]),
            sp["max_new_tokens"],
            eos=sp["stop_token_ids"][0],
            seed=self.seed,
            temperature=sp["temperature"],
        )
        step = int(self.weight_version) + self.step_offset
        records, answers = {}, []
        for rid, t in zip(body["rid"], out, strict=True):
            length = len(t.tokens) - 1
            trajectory, attempt = parse_rollout_rid(rid)
            binding = Binding(step, step, trajectory, attempt, token_digest(t.tokens))
            records[trajectory] = dataclasses.replace(_truncate(t.records, length), binding=binding)
            handle = {
                "store": str(self.store),
                "step": step,
                "trajectory": trajectory,
                "attempt": attempt,
                "policy_version": step,
                "tokens": length,
            }
            meta = {
                "id": rid,
                "finish_reason": {"type": "length", "length": len(t.response)},
                "prompt_tokens": t.prompt_len,
                "completion_tokens": len(t.response),
                "weight_version": self.weight_version,
                "output_token_logprobs": [
                    [float(lp), int(tok), None] for lp, tok in zip(t.logprobs, t.response, strict=True)
                ],
                "trace": handle if self.legacy_handle else [None] * (len(t.response) - 1) + [handle],
            }
            answers.append({"output_ids": t.response.tolist(), "meta_info": meta})
        if self.tamper is not None:
            self.tamper(answers)
        if self.fail_records:  # the writer thread fails and leaves a failure marker
            for rid in body["rid"]:
                write_failure(self.store, step, *parse_rollout_rid(rid), "disk full (injected)")
        elif not self.drop_records:  # the capturer writes after the answer, on its writer thread
            writer = StepWriter(self.store, step)
            threading.Timer(0.2, writer.write, (records,)).start()
        time.sleep(self.delay)
        return 200, answers

    def update_weights_from_disk(self, body: dict) -> tuple[int, object]:
        self.updates.append(body)
        if self.fail_update:
            return 400, {"success": False, "message": "Failed to update weights: injected", "num_paused_requests": 0}
        self.engine.load_weights(load_file(Path(body["model_path"]) / "model.safetensors"), int(body["weight_version"]))
        if not self.ignore_version:
            self.weight_version = body["weight_version"]
        msg = f"Succeeded to update model weights. Weight version updated to {body['weight_version']}."
        return 200, {"success": True, "message": msg, "num_paused_requests": 0}


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
    bad = {
        "rollout_backend": ({"rollout_backend": "vllm"}, "is not one of"),
        "no urls": ({"rollout_backend": "sglang", "rollout_workers": 1}, "needs sglang_urls"),
        "urls unused": ({"sglang_urls": "http://a:1"}, "needs rollout_backend='sglang'"),
        "scheme": ({"rollout_backend": "sglang", "sglang_urls": "a:1,b:2"}, "must start with http"),
        "count": ({"rollout_backend": "sglang", "sglang_urls": "http://a:1"}, "rollout_workers=2 must equal"),
        "bf16": ({"rollout_backend": "sglang", "sglang_urls": "http://a:1,http://b:2", "mode": "bf16"}, "bf16"),
        "async": ({"rollout_backend": "sglang", "sglang_urls": "http://a:1,http://b:2", "async_lag": 1}, "async_lag"),
    }
    for kw, match in bad.values():
        with pytest.raises(ConfigError, match=match):
            RLConfig(**kw)


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
    server = StandIn(model_dir, tmp_path, step_offset=1)  # writes under a step the worker did not push
    worker = SGLangWorker(server.url, _cfg(model_dir, tmp_path, server), VOCAB)
    with pytest.raises(StaleRolloutHandle, match="records of step 1 .* pushed policy version 0"):
        worker.generate(_request(tmp_path))
    with pytest.raises(StaleRolloutHandle, match="rollout step 3 sent to http://127.0.0.1:\\d+, which serves"):
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
    ],
)
def test_a_server_capturing_another_policy_is_refused_by_name(model_dir, tmp_path, policy, named):
    """One capture policy: the pool reads each server's `--trace-*` settings from `/server_info` at start-up and
    refuses one whose record spec differs from the trainer's (its records would leave trainer sites to RTN)."""
    from trace_rl.policy import RolloutTask
    from trace_rl.sglang_worker import SGLangPool
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
