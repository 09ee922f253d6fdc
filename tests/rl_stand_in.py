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
HTTP 400 on failure), `/model_info` (`weight_version`, `architectures`) and `/server_info` (with TRACE on, the
model layout its capturer reports under `internal_states`), behind SGLang's own `--api-key` /
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
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pydantic
import torch
from safetensors.torch import load_file, save_file

# SGLang's package root imports its server dependencies (pybase64, ...): installed by `make setup`.
from sglang.srt.constants import GPU_MEMORY_ALL_TYPES, GPU_MEMORY_TYPE_WEIGHTS
from sglang.srt.managers import io_struct
from sglang.srt.utils.auth import AuthLevel, decide_request_auth

from tests.sglang_server import stand_in_internal_states, stand_in_model, stand_in_server_info
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
    "/release_memory_occupation": AuthLevel.ADMIN_OPTIONAL,
    "/resume_memory_occupation": AuthLevel.ADMIN_OPTIONAL,
}
MEMORY_REQUESTS = {  # the routes' body types
    "/release_memory_occupation": io_struct.ReleaseMemoryOccupationReqInput,
    "/resume_memory_occupation": io_struct.ResumeMemoryOccupationReqInput,
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
        self.architectures, layout = stand_in_model(Path(model_dir) / HF_DIR)  # the model it serves
        self.layout: dict | None = layout  # None: reports no layout
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
        self.memory_saver = False  # started with --enable-memory-saver: /server_info says so, release / resume work
        self.offloaded: set[str] = set()  # memory tags released (SGLang's weight_updater.offload_tags)
        self.weights_lost = False  # weights resumed without CPU backup: undefined until a complete weight update
        self.generating = 0  # /generate calls in flight (a release needs an idle server)
        self.events: list[str] = []  # generate / release / resume / update, in arrival order
        self.die_on_generate: int | None = None  # the process exits (status 9) on this /generate call (1 = first)
        self.generate_calls = 0
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
                    sizes = {"tp_size": 1, "dp_size": 1, "pp_size": 1, "enable_memory_saver": stand_in.memory_saver}
                    if info["trace_mode"] != "off" and stand_in.layout is not None:  # TRACE reports its model
                        sizes["internal_states"] = stand_in_internal_states(stand_in.layout)
                    self._send(200, sizes | info)
                    return
                info = {"model_path": model_dir, "is_generation": True, "weight_version": stand_in.weight_version}
                self._send(200, info | {"architectures": stand_in.architectures})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                if not self._allowed("POST"):
                    return
                if self.path in REQUESTS:
                    self._send(*stand_in.weight_update(self.path, raw))
                    return
                if self.path in MEMORY_REQUESTS:
                    self._send(*stand_in.memory(self.path, raw))
                    return
                self._send(*getattr(stand_in, self.path.strip("/"))(json.loads(raw)))

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def generate(self, body: dict) -> tuple[int, object]:
        self.generate_calls += 1
        if self.die_on_generate is not None and self.generate_calls >= self.die_on_generate:
            print(f"stand-in: exiting during /generate call {self.generate_calls} (injected)", flush=True)
            os._exit(9)
        self.events.append("generate")
        if self.offloaded or self.weights_lost:  # SGLang would run on unmapped or undefined memory
            what = f"memory of {sorted(self.offloaded)} released" if self.offloaded else "weights resumed, not updated"
            return 400, {"error": {"message": f"stand-in: /generate with {what}"}}
        self.generating += 1
        try:
            return self._generate(body)
        finally:
            self.generating -= 1

    def memory(self, endpoint: str, raw: bytes) -> tuple[int, object]:
        """`/release_memory_occupation` / `/resume_memory_occupation` as SGLang 0.5.15's route and
        `WeightUpdater` treat them: the body parsed as the route parses it, no tags = every type, a release only on
        an idle server, a resume only of released tags; the weights' contents are lost on release (no CPU
        backup), so after their resume the server must get a complete weight update before it generates. Success:
        200 with an empty body (the route returns None)."""
        if not self.memory_saver:  # SGLang answers success, but its no-op adapter frees nothing
            return 400, {"error": {"message": "stand-in: started without --enable-memory-saver"}}
        req = pydantic.TypeAdapter(MEMORY_REQUESTS[endpoint]).validate_json(raw)
        tags = list(req.tags or GPU_MEMORY_ALL_TYPES)
        self.events.append(f"{endpoint.strip('/').split('_')[0]} {','.join(sorted(tags))}")
        if self.log:
            print(f"{endpoint} tags={tags}", flush=True)
        if endpoint == "/release_memory_occupation":
            if self.generating:
                return 400, {"error": {"message": "release_memory_occupation should be called only when idle"}}
            self.offloaded |= set(tags)
        else:
            if not set(tags) <= self.offloaded:
                return 400, {"error": {"message": f"KeyError: {sorted(set(tags) - self.offloaded)} not released"}}
            self.offloaded -= set(tags)
            if GPU_MEMORY_TYPE_WEIGHTS in tags:
                self.weights_lost = True
        return 200, None

    def _generate(self, body: dict) -> tuple[int, object]:
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
        version = int(self.weight_version) + self.step_offset  # the capturer's step (weight version)
        records, answers, steps = {}, [], set()
        for rid, t in zip(body["rid"], out, strict=True):
            length = len(t.tokens) - 1
            trajectory, attempt, rollout_step = parse_rollout_rid(rid)
            step = version if rollout_step is None else rollout_step
            steps.add(step)
            binding = Binding(step, version, trajectory, attempt, token_digest(t.tokens))
            records[trajectory] = dataclasses.replace(_truncate(t.records, length), binding=binding)
            handle = {
                "store": str(self.store),
                "step": step,
                "trajectory": trajectory,
                "attempt": attempt,
                "policy_version": version,
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
                trajectory, attempt, rollout_step = parse_rollout_rid(rid)
                step = version if rollout_step is None else rollout_step
                write_failure(self.store, step, trajectory, attempt, "disk full (injected)")
        elif not self.drop_records:  # the capturer writes after the answer, on its writer thread
            if len(steps) != 1:
                raise AssertionError(f"one /generate call of the worker holds one rollout step, got {sorted(steps)}")
            writer = StepWriter(self.store, steps.pop())
            threading.Timer(0.2, writer.write, (records,)).start()
        time.sleep(self.delay)
        return 200, answers

    def update_weights_from_disk(self, body: dict) -> tuple[int, object]:
        self.updates.append(body)
        self.events.append(f"update disk v{body['weight_version']}")
        if GPU_MEMORY_TYPE_WEIGHTS in self.offloaded:
            return 400, {"success": False, "message": "stand-in: weight update into released memory"}
        self.weights_lost = False
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
        if endpoint != "/destroy_weights_update_group" and GPU_MEMORY_TYPE_WEIGHTS in self.offloaded:
            return 400, {"success": False, "message": "stand-in: weight update into released memory"}
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
                self.events.append(f"update {endpoint.rsplit('_', 1)[1]} v{req.weight_version}")
                self.weights_lost = False
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
    ap.add_argument("--stand-in-die-at", type=int, default=0)  # exit (status 9) on this /generate call
    ap.add_argument("--stand-in-die-once", default="")  # ... only if this file is absent (it is created first)
    ap.add_argument("--stand-in-die-port", type=int, default=0)  # ... only the server on this port (0: every one)
    ap.add_argument("--enable-memory-saver", action="store_true")
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
    server.memory_saver = args.enable_memory_saver
    dies = args.stand_in_die_at and args.stand_in_die_port in (0, args.port)
    if dies and not (args.stand_in_die_once and Path(args.stand_in_die_once).exists()):
        if args.stand_in_die_once:
            Path(args.stand_in_die_once).touch()
        server.die_on_generate = args.stand_in_die_at
    server.log = True
    print(f"stand-in rl server: {server.url}", flush=True)
    threading.Event().wait()
