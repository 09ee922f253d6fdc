"""Fault injection, the SGLang worker's HTTP transport (docs/reliability.md), against `Trickle`, a stdlib server that
answers one byte at a time or echoes request headers in an error (no SGLang needed): every call (worker start-up,
`/model_info`, weight sync) ends at its wall-clock deadline, not when the server stops sending, and a key a server
echoes never reaches an error message."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tests.sglang_server import stand_in_internal_states, stand_in_model, stand_in_server_info
from trace_rl.config import RLConfig
from trace_rl.controller import record_spec
from trace_rl.policy import RolloutTask
from trace_rl.rollout.sglang_worker import SGLangError, SGLangPool, SGLangWorker
from trace_rl.task import EOS, VOCAB
from trace_rl.warmup import HF_DIR

pytestmark = pytest.mark.faults
KEY = "sk-run-7f3a9c1e5b"


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> str:
    return str(tiny_model(4))


class Trickle:
    """A server that answers `/model_info` at once (weight version 0) and every path of `slow` one byte every
    `pause` seconds after its headers (each read well inside any socket timeout); with `echo`, every answer is an
    HTTP 500 that echoes the request's headers, as a debugging proxy might."""

    def __init__(self, model_dir: str, slow: tuple[str, ...] = (), pause: float = 0.4, echo: bool = False):
        trickle = self
        architectures, layout = stand_in_model(Path(model_dir) / HF_DIR)  # the model it serves

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self) -> None:
                if trickle.echo:
                    body, code = json.dumps({"error": "bad request", "headers": dict(self.headers)}).encode(), 500
                elif self.path == "/model_info":
                    body, code = json.dumps({"weight_version": "0", "architectures": architectures}).encode(), 200
                elif self.path == "/server_info":
                    info = stand_in_server_info() | {"internal_states": stand_in_internal_states(layout)}
                    body, code = json.dumps(info).encode(), 200
                else:
                    body, code = json.dumps({"success": True, "message": "ok", "num_paused_requests": 0}).encode(), 200
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for i in range(len(body)):
                    if self.path in trickle.slow:
                        time.sleep(trickle.pause)
                    try:
                        self.wfile.write(body[i : i + 1])
                        self.wfile.flush()
                    except OSError:  # the client gave up
                        return

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                self._answer()

        self.slow, self.pause, self.echo = slow, pause, echo
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _trickle_cfg(model_dir: str, out: Path, server: Trickle, **kw) -> RLConfig:
    base = dict(model_dir=model_dir, out_dir=str(out), rollout_backend="sglang", sglang_urls=server.url)
    return RLConfig(**base | dict(rollout_workers=1, prompts_per_step=2, group_size=2) | kw)


def _pool(model_dir: str, cfg: RLConfig) -> SGLangPool:
    return SGLangPool(cfg, record_spec(2, cfg), RolloutTask(str(Path(model_dir) / HF_DIR), 16, (EOS,)))


def _checkpoint_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """The HF tensors of the served checkpoint (what a policy update sends: the same names and shapes)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted((Path(model_dir) / HF_DIR).glob("*.safetensors")):
        tensors |= load_file(path)
    return tensors


def test_every_sglang_call_has_a_wall_clock_deadline(model_dir, tmp_path):
    server = Trickle(model_dir, slow=("/model_info",))  # about 26 s for the 65 bytes of its answer
    try:
        start = time.monotonic()
        with pytest.raises(SGLangError, match=f"{server.url}/model_info: no complete answer within sglang_timeout_s=1"):
            SGLangWorker(server.url, _trickle_cfg(model_dir, tmp_path, server, sglang_timeout_s=1.0), VOCAB)
        assert time.monotonic() - start < 3
        start = time.monotonic()
        cfg = _trickle_cfg(model_dir, tmp_path, server, sglang_start_timeout_s=1.5)  # sglang_timeout_s: 600
        with pytest.raises(SGLangError, match="/model_info: no complete answer within sglang_start_timeout_s's"):
            _pool(model_dir, cfg)
        assert time.monotonic() - start < 3.5
        server.slow = ("/update_weights_from_disk",)
        pool = _pool(model_dir, cfg.replace(weight_sync_timeout_s=1.5))
        start = time.monotonic()
        with pytest.raises(
            SGLangError, match="/update_weights_from_disk: no complete answer within weight_sync_timeout_s's deadline"
        ):
            pool.load_weights(_checkpoint_tensors(model_dir), 1)  # the served names: the name check passes
        assert time.monotonic() - start < 3.5
    finally:
        server.close()


def test_a_key_echoed_by_a_server_never_reaches_an_error_message(model_dir, tmp_path, monkeypatch):
    server = Trickle(model_dir, echo=True)
    monkeypatch.setenv("TRACE_SGLANG_KEY", KEY)
    try:
        cfg = _trickle_cfg(model_dir, tmp_path, server, sglang_api_key="env:TRACE_SGLANG_KEY")
        with pytest.raises(SGLangError, match=r"/model_info: HTTP 500: .*Bearer <redacted>") as e:
            SGLangWorker(server.url, cfg, VOCAB)
        assert KEY not in str(e.value)
    finally:
        server.close()
