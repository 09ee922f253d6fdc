"""The SGLang server `bench/serve.py` starts for each configuration, and what it reports: the process (its own
process group, killed with everything it started; a leftover of a killed run found through `PID_FILE`), the log
lines the bench counts per point and SGLang's decode step timer in `/server_info`."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import requests

SERVER_ENV = {"SGLANG_RECORD_STEP_TIME": "1"}  # SGLang's step timer: step_time_dict in /server_info


PID_FILE = "serve.server.json"  # next to --out: the process group and record store of the server running now


def free_port() -> int:
    """A free port in [20000, 40000): SGLang derives further ports from it, which must stay below 65536."""
    for port in random.sample(range(20000, 40000), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in [20000, 40000)")


def kill_leftover(pid_file: Path) -> None:
    """Clean up after an earlier run of this bench that was killed: kill the process group it left running (its id
    in `pid_file`) if its leader is still an SGLang server, and remove that server's record store."""
    try:
        left = json.loads(pid_file.read_text())
    except (OSError, ValueError):
        pid_file.unlink(missing_ok=True)
        return
    try:
        alive = b"sglang.launch_server" in Path(f"/proc/{left['pgid']}/cmdline").read_bytes()
    except OSError:
        alive = False
    if alive:
        print(f"serve: killing the leftover server process group {left['pgid']}", file=sys.stderr)
        try:
            os.killpg(left["pgid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        time.sleep(5)
    if left.get("store"):
        shutil.rmtree(left["store"], ignore_errors=True)
    pid_file.unlink(missing_ok=True)


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, tail: Callable[[], str]) -> None:
    """Until the server `proc` at `url` answers `/health` with 200; RuntimeError with `tail()` (its log tail) if it
    exits or `timeout_s` runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail()}")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise RuntimeError(f"server not ready after {timeout_s} s:\n{tail()}")


class Server:
    """One SGLang server in its own process group, logging to `log`; `stop` kills the group (SIGTERM, then
    SIGKILL)."""

    def __init__(self, argv: list[str], url: str, log: Path, pid_file: Path, store: Path | None) -> None:
        self.argv, self.url, self.log, self.pid_file = argv, url, log, pid_file
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            f.write(f"# {' '.join(argv)}\n")
            f.flush()
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                env={**os.environ, **SERVER_ENV},
                start_new_session=True,
            )
        pid_file.write_text(json.dumps({"pgid": self.proc.pid, "store": str(store) if store else None}))

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout_s: float) -> None:
        wait_healthy(self.proc, self.url, timeout_s, self.tail)

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")

    def info(self) -> dict:
        resp = requests.get(f"{self.url}/server_info", timeout=60)
        resp.raise_for_status()
        return resp.json()

    def log_size(self) -> int:
        return self.log.stat().st_size

    def log_since(self, offset: int) -> str:
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        """Kill the server's process group; a SIGTERM to this bench meanwhile waits (no orphan is left)."""
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the scheduler processes too, whatever the leader did
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        finally:
            self.pid_file.unlink(missing_ok=True)
            signal.signal(signal.SIGTERM, previous)


DECODE_LINE = re.compile(r"Decode batch.*?#running-req: (\d+),.*?cuda graph: (True|False)")


PREFILL_LINE = re.compile(r"Prefill batch.*?#running-req: (\d+),")


RETRACT_LINE = "KV cache pool is full. Retract requests."


SLOW_FINISH_LINE = re.compile(
    r"TRACE finish: (\d+) requests, (\d+) tokens in ([\d.]+) s on the scheduler thread "
    r"\(host ring waits \d+, ([\d.]+) s\)"
)  # sglang_trace.capturer: a result batch whose record transfers held the scheduler longer than SLOW_FINISH_S


def parse_log(text: str) -> dict:
    """Peak running requests, decode lines in CUDA graphs, retractions and TRACE's slow finishes (scheduler seconds,
    host-ring waits) in a span of the server log. A prefill line counts the requests running before the batch it
    adds, so the peak comes from the decode lines too."""
    decode = [(int(n), flag == "True") for n, flag in DECODE_LINE.findall(text)]
    running = [n for n, _ in decode] + [int(n) for n in PREFILL_LINE.findall(text)]
    slow = SLOW_FINISH_LINE.findall(text)
    return {
        "peak_running_requests": max(running, default=0),
        "decode_log_lines": len(decode),
        "cuda_graph_decode_fraction": sum(g for _, g in decode) / len(decode) if decode else None,
        "retractions": text.count(RETRACT_LINE),
        "slow_finish_s": sum(float(took) for *_, took, _ in slow),
        "slow_finish_ring_wait_s": sum(float(wait) for *_, wait in slow),
        "slow_finish_requests": sum(int(n) for n, *_ in slow),
    }


def step_time_dict(info: dict) -> dict[int, list[float]]:
    """SGLang's step timer (`step_time_dict`: running requests -> seconds per decode step of each log window)."""
    states = info.get("internal_states") or [{}]
    return {int(k): list(v) for k, v in (states[0].get("step_time_dict") or {}).items()}


def new_step_times(before: dict[int, list[float]], after: dict[int, list[float]], batch: int) -> list[float]:
    """The windows at `batch` running requests timed since `before`, less the first (it spans the gap since the
    previous point's last window, and the prefill)."""
    return after.get(batch, [])[len(before.get(batch, [])) :][1:]
