"""A patched SGLang server as a subprocess for the GPU tests: started on a free port, waited for with a deadline,
torn down with its whole process group; its log tail is part of every failure."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

BASE_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none")


def stand_in_server_info(**trace_fields: object) -> dict:
    """The `--trace-*` part of a patched server's `/server_info`, for HTTP stand-ins: emulate mode with TRACE's
    defaults (the project's default capture policy) unless overridden."""
    from sglang_trace.config import SERVER_ARGS_FIELDS

    return {**SERVER_ARGS_FIELDS, "trace_mode": "emulate", **trace_fields}


def free_port() -> int:
    """A free port in [20000, 40000): SGLang derives further ports from it (e.g. its gRPC port), which must stay
    below 65536."""
    for port in random.sample(range(20000, 40000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in [20000, 40000)")


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
        """Until `/health_generate` answers 200; RuntimeError with the log tail if the server exits or the
        deadline passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.tail()}")

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
