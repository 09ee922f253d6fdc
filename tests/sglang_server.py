"""A patched SGLang server as a subprocess for the GPU tests: started on a free port, waited for with a deadline,
torn down with its whole process group; its log tail is part of every failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import requests

from bench.serve_server import free_port, wait_healthy

BASE_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none")

SERVED_MODEL = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    moe_intermediate_size=128,
    num_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=2048,
)
"""The random Qwen3-MoE the GPU tests serve (`tests.hf_tiny.make_hf_checkpoint` overrides): 4 layers, 16 experts,
top-4."""
CHUNK = 128  # prefill chunk of the served tests: a prompt of 3 * CHUNK + 17 tokens takes several


def served_flags(
    store: Path | None,
    kv: str,
    *,
    recipe: str = "nvfp4-w4a4-kv4",
    sites: str = "moe_in",
    debug_layer: int | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """Server flags of the GPU tests: a small pool, chunked prefill, CUDA graphs up to batch 16 (SGLang's defaults
    otherwise), R3 routes returned; with a `store`, TRACE in emulate mode capturing `sites` of every layer at b = 4
    under `recipe` (None: TRACE off, a BF16 server)."""
    flags = [
        "--mem-fraction-static", "0.25", "--max-total-tokens", "32768", "--chunked-prefill-size", str(CHUNK),
        "--max-running-requests", "16", "--cuda-graph-max-bs-decode", "16", "--skip-server-warmup",
        "--page-size", "1", "--kv-cache-dtype", kv, "--enable-return-routed-experts",
    ]  # fmt: skip
    if store is not None:
        flags += [
            "--trace-mode", "emulate", "--trace-store", str(store), "--trace-record-bits", "4", "--trace-layers",
            "all", "--trace-sites", sites, "--trace-recipe", recipe,
        ]  # fmt: skip
        if debug_layer is not None:
            flags += ["--trace-debug-layer", str(debug_layer)]
    return [*flags, *extra]


def stand_in_server_info(**trace_fields: object) -> dict:
    """The `--trace-*` part of a patched server's `/server_info`, for HTTP stand-ins: emulate mode with TRACE's
    defaults (the project's default capture policy) unless overridden."""
    from sglang_trace.config import SERVER_ARGS_FIELDS

    return {**SERVER_ARGS_FIELDS, "trace_mode": "emulate", **trace_fields}


def stand_in_model(hf_dir: str | Path) -> tuple[list[str], dict]:
    """What a patched server reports of the model it serves, for HTTP stand-ins: the architectures of its
    `/model_info` and the layout TRACE's capturer reports in `/server_info` (`stand_in_internal_states`)."""
    from transformers import AutoConfig

    from sglang_trace.config import layout_fields, model_layout

    hf = AutoConfig.from_pretrained(hf_dir)
    return list(hf.architectures), layout_fields(model_layout(hf))


def stand_in_internal_states(layout: dict) -> list[dict]:
    """`/server_info`'s `internal_states` of a TRACE server running the model of `layout` (`TraceCapturer.counters`
    reports it under "trace")."""
    return [{"trace": {"model": layout}}]


class Server:
    """`python -m sglang.launch_server --model-path MODEL FLAGS...` in its own process group, logging to `log`."""

    def __init__(self, model: Path, flags: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(self.port)]
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                [*cmd, *BASE_FLAGS, *flags],
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout_s: float) -> None:
        wait_healthy(self.proc, self.url, timeout_s, self.tail)

    def wait_exit(self, timeout_s: float) -> int:
        """The return code once the server exits by itself within `timeout_s` (RuntimeError otherwise)."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"server still running after {timeout_s} s:\n{self.tail()}") from None

    def generate(self, payload: dict, timeout_s: float = 120) -> dict:
        resp = requests.post(f"{self.url}/generate", json=payload, timeout=timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"/generate {resp.status_code}: {resp.text[:2000]}\n{self.tail()}")
        return resp.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
