"""Fault injection, SGLang boundary (docs/reliability.md items 1, 5 and 7), against the protocol stand-in of
`test_rl_sglang_worker` behind SGLang's own --api-key / --admin-api-key decision: keys from the environment or a
file, never on disk in the run directory; malformed answers (meta_info, NaN / inf / positive log-probs, token ids
outside the vocabulary) are errors naming the server; a stale shard of an earlier attempt does not count as the
records of this one; waiting for records reads each shard header once."""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import pytest

from tests.core.test_store import trajectory
from tests.rl.test_rl_sglang_worker import StandIn, _cfg, _request
from trace_core.records.layout import TrajectoryRecords
from trace_core.records.reader import FailedRecordError, RecordReader
from trace_core.records.spec import Binding
from trace_core.records.store import StepWriter
from trace_rl.controller import Controller
from trace_rl.rollout.sglang_worker import SGLangError, SGLangWorker
from trace_rl.rollout.workers import RolloutTimeout
from trace_rl.task import VOCAB

pytestmark = pytest.mark.faults
KEY, ADMIN = "sk-run-7f3a9c1e5b", "sk-admin-04d2e8b6a1"


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    out = tiny_model(4)
    return str(out)


def test_api_keys_end_to_end_and_never_on_disk(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    server = StandIn(model_dir, (out / "records").resolve())
    server.api_key, server.admin_api_key = KEY, ADMIN
    (tmp_path / "admin.key").write_text(ADMIN + "\n")
    monkeypatch.setenv("TRACE_SGLANG_KEY", KEY)
    keys = dict(sglang_api_key="env:TRACE_SGLANG_KEY", sglang_admin_api_key=f"file:{tmp_path / 'admin.key'}")
    cfg = _cfg(model_dir, out, server, rollout_workers=1, steps=1, **keys)
    with pytest.raises(SGLangError, match=f"{server.url}/model_info: HTTP 401: .*no key was sent.*sglang_api_key"):
        SGLangWorker(server.url, cfg.replace(sglang_api_key="", sglang_admin_api_key=""), VOCAB)
    worker = SGLangWorker(server.url, cfg.replace(sglang_admin_api_key=""), VOCAB)  # API key on an admin endpoint
    with pytest.raises(SGLangError, match="update_weights_from_disk: HTTP 401: .*a key was sent.*--admin-api-key"):
        worker.update_weights(tmp_path, 1)
    monkeypatch.delenv("TRACE_SGLANG_KEY")
    with pytest.raises(SGLangError, match="environment variable TRACE_SGLANG_KEY is not set") as e:
        SGLangWorker(server.url, cfg, VOCAB)
    assert KEY not in str(e.value)
    monkeypatch.setenv("TRACE_SGLANG_KEY", KEY)
    with Controller(cfg) as ctrl:
        history = ctrl.run()
    assert history[0]["rollout/records_missing"] == 0 and server.updates[-1]["weight_version"] == "1"
    for path in out.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert KEY.encode() not in data and ADMIN.encode() not in data, path


def _nan(answers):
    answers[1]["meta_info"]["output_token_logprobs"][0][0] = math.nan


def _inf(answers):
    answers[0]["meta_info"]["output_token_logprobs"][-1][0] = -math.inf


def _positive(answers):
    answers[0]["meta_info"]["output_token_logprobs"][0][0] = 0.5


def _oov(answers):
    answers[0]["output_ids"][0] = VOCAB + 3
    answers[0]["meta_info"]["output_token_logprobs"][0][1] = VOCAB + 3


def _no_meta(answers):
    del answers[0]["meta_info"]


def _abort(answers):
    answers[1]["meta_info"]["finish_reason"] = {"type": "abort", "message": "client disconnected"}


def _prompt_count(answers):
    answers[0]["meta_info"]["prompt_tokens"] = 3


def _token_mismatch(answers):
    answers[0]["meta_info"]["output_token_logprobs"][0][1] = (answers[0]["output_ids"][0] + 1) % VOCAB


def _no_id(answers):
    del answers[0]["meta_info"]["id"]


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (_nan, r"trajectory 5: log-prob of output token 0 is nan, not a finite value <= 0"),
        (_inf, r"trajectory 4: log-prob of output token \d is -inf"),
        (_positive, r"trajectory 4: log-prob of output token 0 is 0.5"),
        (_oov, rf"trajectory 4: output_ids \[{VOCAB + 3}\] are not token ids of the vocabulary \(0..{VOCAB - 1}\)"),
        (_no_meta, r"trajectory 4: answer lacks meta_info"),
        (_abort, r"trajectory 5: request did not finish normally: .*abort"),
        (_prompt_count, r"trajectory 4: meta_info counts prompt_tokens=3"),
        (_token_mismatch, r"trajectory 4: output_token_logprobs\[0\] = .* does not name token"),
        (_no_id, r"trajectory 4: answer for request id None, not '4#"),
    ],
)
def test_malformed_answers_are_errors_naming_the_server(model_dir, tmp_path, tamper, message):
    server = StandIn(model_dir, tmp_path)
    server.tamper = tamper
    worker = SGLangWorker(server.url, _cfg(model_dir, tmp_path, server), VOCAB)
    with pytest.raises(SGLangError, match=f"SGLang server {server.url}/generate, {message}"):
        worker.generate(_request(tmp_path))


def test_a_stale_shard_of_an_earlier_attempt_is_not_taken(model_dir, tmp_path):
    server = StandIn(model_dir, tmp_path)
    worker = SGLangWorker(server.url, _cfg(model_dir, tmp_path, server, sglang_timeout_s=2.0), VOCAB)
    earlier = _request(tmp_path)  # an attempt that wrote its records, then timed out at the client
    worker.generate(earlier)
    server.drop_records = True  # this attempt's answer arrives, its records never do
    with pytest.raises(SGLangError, match=r"records of trajectories \['4', '5'\] did not reach .*other attempts"):
        worker.generate(earlier.next_attempt())


def test_records_the_server_could_not_store_fail_fast_with_its_message(model_dir, tmp_path):
    server = StandIn(model_dir, tmp_path)
    server.fail_records = True
    worker = SGLangWorker(server.url, _cfg(model_dir, tmp_path, server, sglang_timeout_s=300.0), VOCAB)
    start = time.monotonic()
    with pytest.raises(SGLangError, match=f"{server.url}: could not store the records of trajectories .*disk full"):
        worker.generate(_request(tmp_path))
    assert time.monotonic() - start < 60  # not the 300 s record wait
    with pytest.raises(FailedRecordError, match="trajectory '4' has no records .*disk full"):
        RecordReader(tmp_path, 0).load([("4", 0, 1)])


def test_a_rollout_step_past_its_deadline_fails(model_dir, tmp_path):
    server = StandIn(model_dir, tmp_path / "records")
    server.delay = 30.0
    cfg = _cfg(model_dir, tmp_path, server, rollout_workers=1, rollout_call_timeout_s=2.0, rollout_step_timeout_s=2.0)
    with Controller(cfg) as ctrl:
        start = time.monotonic()
        with pytest.raises(RolloutTimeout, match="step 0: SGLang rollout did not finish within rollout_step_timeout_s"):
            ctrl.rollout(0)
        assert time.monotonic() - start < 25


def test_waiting_for_records_reads_each_shard_header_once(model_dir, tmp_path):
    server = StandIn(model_dir, tmp_path)
    writer = StepWriter(tmp_path, 0)
    for i in range(40):  # other trajectories' shards already in the step
        tr = trajectory(i, 2)
        writer.write({f"x{i}": TrajectoryRecords(2, tr.records, tr.routes, Binding(0, 0, f"x{i}", "a", "d"))})
    worker = SGLangWorker(server.url, _cfg(model_dir, tmp_path, server), VOCAB)
    trajs = worker.generate(_request(tmp_path))  # the server writes 0.2 s after answering: the worker looks many times
    assert len(trajs) == 2 and worker.headers_read == 41


def test_the_image_rollout_role_passes_key_files_and_refuses_an_open_server(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"  # stands in for the server: prints the arguments it was started with
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    (tmp_path / "api.key").write_text(KEY + "\n")
    (tmp_path / "admin.key").write_text(ADMIN)
    entry = Path(__file__).resolve().parents[2] / "docker" / "entrypoint.sh"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    args = [str(entry), "rollout", "--host", "0.0.0.0", "--port", "30000"]
    refused = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "needs TRACE_API_KEY_FILE and TRACE_ADMIN_API_KEY_FILE" in refused.stderr
    files = {"TRACE_API_KEY_FILE": str(tmp_path / "api.key"), "TRACE_ADMIN_API_KEY_FILE": str(tmp_path / "admin.key")}
    started = subprocess.run(args, env=env | files, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    assert started.stdout.split("\n")[:6] == ["-m", "sglang.launch_server", "--api-key", KEY, "--admin-api-key", ADMIN]
