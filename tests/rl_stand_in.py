"""A protocol stand-in of a patched SGLang server for the RL tests (`tests/rl/test_rl_sglang_worker.py`,
`tests/rl/test_weight_sync.py`), in a thread of the test or as a process of its own (`tests/stand_in_sglang.py
--stand-in rl`, as the launcher starts servers).

A real SGLang server cannot run here (no sglang-kernel, no CUDA), so `StandIn` is a stdlib `http.server` that
speaks the JSON of sglang 0.5.15.post1's endpoints as read from the installed source:
`/generate` (`GenerateReqInput`: batched `input_ids`, `rid`, `sampling_params`, `return_logprob`; each output
`{"output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version",
"output_token_logprobs": [[logprob, token_id, None], ...], "trace": [None, ..., handle]}}`: TRACE's handle rides
SGLang's per-output-token `customized_info` channel, so `meta_info["trace"]` is a list with the handle at the last
output token; the pre-0.5.15 dict form is still read, `legacy_handle`), `/update_weights_from_disk`
(`UpdateWeightFromDiskReqInput.model_path` / `weight_version` -> `{"success", "message", "num_paused_requests"}`,
HTTP 400 on failure), `/model_info` (`weight_version`) and `/server_info`, behind SGLang's own `--api-key` /
`--admin-api-key` decision (`sglang.srt.utils.auth.decide_request_auth`, with the endpoints' auth levels of
`http_server.py`). It samples with the real `EmbeddedEngine` (the same FP4 numerics) and, like `sglang_trace`'s
capturer, writes each request's records of positions [0, seqlen - 1) with a `trace_core.records.store.StepWriter` under
the step of its integer weight version, bound to the trajectory and attempt of the request id, on a background thread
after answering. Its knobs inject the server faults the worker must catch.

The weight-update endpoints (`/update_weights_from_tensor`, `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`) run SGLang's own receiving code
(`tests.sglang_weights.WeightReceiver`), the runner's model being the stand-in's weights. A server joins the
trainer's torch.distributed group there as SGLang does, so the distributed protocol needs the stand-in in a process
of its own (one process cannot hold two ranks of the group).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# SGLang's package root imports its server dependencies (pybase64, ...): installed by `make setup`.
from sglang.srt.utils.auth import AuthLevel, decide_request_auth

from tests.sglang_server import stand_in_server_info
from tests.sglang_weights import REQUESTS, WeightReceiver
from trace_core.records.layout import TrajectoryRecords
from trace_core.records.spec import Binding, token_digest
from trace_core.records.store import StepWriter, parse_rollout_rid, write_failure
from trace_rl.config import RLConfig
from trace_rl.controller import record_spec
from trace_rl.rollout.engine import EmbeddedEngine
from trace_rl.warmup import HF_DIR, load_megatron_state

AUTH_LEVELS = {  # sglang 0.5.15.post1 http_server.py
    "/generate": AuthLevel.NORMAL,
    "/model_info": AuthLevel.NORMAL,
    "/server_info": AuthLevel.NORMAL,
    "/update_weights_from_disk": AuthLevel.ADMIN_OPTIONAL,
    "/update_weights_from_tensor": AuthLevel.ADMIN_OPTIONAL,
    "/init_weights_update_group": AuthLevel.ADMIN_OPTIONAL,
    "/update_weights_from_distributed": AuthLevel.ADMIN_OPTIONAL,
    "/destroy_weights_update_group": AuthLevel.ADMIN_OPTIONAL,
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

    def __init__(self, model_dir: str, store: Path, *, weight_version: str = "0", step_offset: int = 0, port: int = 0):
        tiny, _, _ = load_megatron_state(model_dir)
        cfg = RLConfig(model_dir=model_dir)
        self.engine = EmbeddedEngine(
            str(Path(model_dir) / HF_DIR), fp4=True, spec=record_spec(tiny.layers, cfg), max_batch=16, max_len=32
        )
        self.weights = load_file(Path(model_dir) / HF_DIR / "model.safetensors")  # what the server holds
        self.pending = False  # weights updated by tensor / distributed since the engine last loaded them
        self.store, self.weight_version, self.step_offset = store, weight_version, step_offset
        self.policy: dict[str, object] = {}  # --trace-* fields /server_info reports beyond the defaults
        self.fail_update = self.ignore_version = self.drop_records = self.fail_records = False
        self.fail_tensor_update = False  # /update_weights_from_tensor answers a failure
        self.fail_distributed_update = False  # /update_weights_from_distributed answers a failure, receiving nothing
        self.join = "yes"  # /init_weights_update_group: "yes", "refuse" (answers a failure), "never" (hangs)
        self.delay = 0.0  # seconds /generate takes before answering
        self.api_key: str | None = None
        self.admin_api_key: str | None = None
        self.tamper = None  # called with the answers of every /generate before they are sent
        self.legacy_handle = False  # meta_info["trace"] as the handle dict itself (TRACE on SGLang 0.5.10)
        self.updates: list[dict] = []
        self.dump: Path | None = None  # each completed update's weights go to <dump>/v<version>.safetensors
        self.log = False  # print each weight-update call (a server process's log)
        self.seed = 0
        self.receiver = WeightReceiver(self._load)
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
                if self.path == "/health":
                    self._send(200, {})
                    return
                assert self.path in ("/model_info", "/server_info"), self.path
                if not self._allowed("GET"):
                    return
                if self.path == "/server_info":
                    info = stand_in_server_info(trace_store=str(stand_in.store), **stand_in.policy)
                    self._send(200, {"tp_size": 1, "dp_size": 1, "pp_size": 1} | info)
                    return
                info = {"model_path": model_dir, "is_generation": True, "weight_version": stand_in.weight_version}
                self._send(200, info)

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                if not self._allowed("POST"):
                    return
                if self.path in REQUESTS:
                    self._send(*stand_in.weight_update(self.path, raw))
                    return
                self._send(*getattr(stand_in, self.path.strip("/"))(json.loads(raw)))

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def generate(self, body: dict) -> tuple[int, object]:
        if self.pending:  # the engine takes the weights the last tensor / distributed updates left
            self.engine.load_weights(self.weights, int(self.weight_version))
            self.pending = False
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
        self.weights = load_file(Path(body["model_path"]) / "model.safetensors")
        self.engine.load_weights(self.weights, int(body["weight_version"]))
        self.pending = False
        if not self.ignore_version:
            self.weight_version = body["weight_version"]
        self._dump()
        msg = f"Succeeded to update model weights. Weight version updated to {body['weight_version']}."
        return 200, {"success": True, "message": msg, "num_paused_requests": 0}

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """The runner's `model.load_weights`: stricter than SGLang's Qwen3-MoE, which skips a name it lacks."""
        unknown = [n for n, _ in named if n not in self.weights]
        if unknown:
            raise KeyError(f"no parameter for {unknown[:3]}")
        for name, t in named:
            if t.shape != self.weights[name].shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, parameter {tuple(self.weights[name].shape)}")
        for name, t in named:
            self.weights[name] = t.clone()  # a shared-memory or IPC tensor goes when the call returns
        self.pending = True

    def weight_update(self, endpoint: str, raw: bytes) -> tuple[int, object]:
        """One of the four weight-update routes: SGLang's receiving code (`WeightReceiver`), then what the
        tokenizer manager does with a successful update's `weight_version`."""
        if endpoint == "/init_weights_update_group" and self.join != "yes":
            if self.join == "never":
                threading.Event().wait()
            return 400, {"success": False, "message": "Failed to initialize custom process group: injected."}
        if endpoint == "/update_weights_from_tensor" and self.fail_tensor_update:
            return 400, {"success": False, "message": "Failed to update weights from tensor: injected"}
        if endpoint == "/update_weights_from_distributed" and self.fail_distributed_update:
            return 400, {"success": False, "message": "Failed to update parameter online: injected"}
        try:
            ok, msg, req = self.receiver.handle(endpoint, raw)
        except Exception as e:  # a body SGLang's route would refuse
            return 400, {"success": False, "message": f"{type(e).__name__}: {e}"}
        if self.log:
            fields = ("rank_offset", "world_size", "backend", "weight_version", "flush_cache")
            shown = " ".join(f"{k}={getattr(req, k)}" for k in fields if hasattr(req, k))
            print(f"{endpoint} {shown} -> {ok} {msg}", flush=True)
        if ok and getattr(req, "weight_version", None) is not None:
            self.updates.append({"endpoint": endpoint, "weight_version": req.weight_version})
            if not self.ignore_version:
                self.weight_version = req.weight_version
            if req.flush_cache:  # the last bucket of an update
                self._dump()
        return (200 if ok else 400), {"success": ok, "message": msg}

    def _dump(self) -> None:
        if self.dump is not None:
            self.dump.mkdir(parents=True, exist_ok=True)
            save_file(dict(self.weights), self.dump / f"v{self.weight_version}.safetensors")


def serve(argv: list[str]) -> None:
    """`tests/stand_in_sglang.py --stand-in rl`: a `StandIn` on the launcher's `--host` / `--port`, serving
        `--model-path` (a tiny model's `hf/`) with `--trace-store` at `--weight-version`; torch.distributed initialized
        for one rank, as a TP = 1 server's is, so it can join a weight-update group. `--stand-in-dump DIR` writes each
        update's weights there, `--stand-in-join refuse|never` fails the group's formation,
    `--stand-in-fail-distributed` every distributed update (without receiving its broadcasts)."""
    ap = argparse.ArgumentParser(allow_abbrev=False)  # the launcher's other flags pass through
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--trace-store", required=True)
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--stand-in-dump", default="")
    ap.add_argument("--stand-in-join", default="yes")
    ap.add_argument("--stand-in-fail-distributed", action="store_true")
    args, _ = ap.parse_known_args(argv)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    server = StandIn(
        str(Path(args.model_path).parent), Path(args.trace_store), weight_version=args.weight_version, port=args.port
    )
    server.join = args.stand_in_join
    server.dump = Path(args.stand_in_dump) if args.stand_in_dump else None
    server.fail_distributed_update = args.stand_in_fail_distributed
    server.log = True
    print(f"stand-in rl server: {server.url}", flush=True)
    threading.Event().wait()
