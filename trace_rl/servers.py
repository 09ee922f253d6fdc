"""A supervised group of patched SGLang server processes (`sglang_launch = "local"`; `"ray"`:
`trace_rl.ray_servers.RayServerGroup`, the same group with the processes in Ray actors).

The launcher starts one server per entry of `sglang_gpus` on this host, each with the command line of
`trace_rl.server_command.server_specs` (the trainer's capture policy, so the pool's start-up check
`SGLangWorker.check_policy` finds them equal), `CUDA_VISIBLE_DEVICES` set to its GPUs (indices into the launcher's
own CUDA_VISIBLE_DEVICES when it has one; an index beyond the GPUs there fails the launch before anything starts),
in its own process group, logging to `<out_dir>/servers/server<i>.log`. `ServerGroup` waits for every `/health` within
`sglang_start_timeout_s` and tears the whole group down (SIGTERM to each process group, SIGKILL after a grace
period) on exit, on an exception and on SIGINT / SIGTERM of the launcher. A server that dies while the group runs is
started again by `restart` (same command, GPUs and port, its log appended) when the rollout pool next needs it, at
most `sglang_max_restarts` times per server; past that the run stops with its log tail. With `colocate` the servers
run with `--enable-memory-saver` (SGLang's memory release and resume, `trace_rl.rollout.colocate`).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import requests

from trace_rl.server_command import (  # noqa: F401  (re-exported: the launch API lives here too)
    HOST,
    LAUNCH_MODES,
    MEMORY_SAVER_FLAG,
    OWNED_FLAGS,
    ServerSpec,
    capture_flags,
    cuda_devices,
    group_urls,
    hf_dir,
    launch_errors,
    parse_args,
    parse_gpus,
    server_specs,
)

if TYPE_CHECKING:
    from trace_rl.config import RLConfig

LOG_TAIL_LINES = 40
KILL_GRACE_S = 10.0  # SIGTERM to SIGKILL
POLL_S = 0.2  # between looks at /health and at the processes
MONITOR_S = 1.0  # between looks at the running servers
EXIT_GRACE_S = 5.0  # after a failed call, how long a server's process may take to show that it has exited


class ServerGroupError(RuntimeError):
    """A launched SGLang server failed to start, or died while the run used it; the message names it, its command and
    its log tail."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a server log ("" if there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * lines))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def port_in_use(port: int, host: str = HOST) -> bool:
    """Whether something listens on (or holds) `host:port`: a bind there fails."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT leftover does not count
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def memory_saver_hint(cfg: RLConfig, tail: str) -> str:
    """With `colocate`, what a server log that shows SGLang refusing `--enable-memory-saver` means; else ""."""
    if not cfg.colocate or not any(w in tail for w in ("torch_memory_saver", "torch-memory-saver")):
        return ""
    return (
        "\n  colocate=true starts the servers with --enable-memory-saver, which needs the torch_memory_saver package "
        "where the server runs (pip install torch-memory-saver, CUDA only); install it there or set colocate=false"
    )


class ServerGroup:
    """The SGLang servers of one run, supervised: `with ServerGroup(cfg) as group:` starts them, waits for every
    `/health` within `sglang_start_timeout_s`, and on leaving kills every server's process group.

    While entered in the main thread, SIGINT raises KeyboardInterrupt and SIGTERM SystemExit(143) (the previous
    handlers come back on exit), and a monitor thread stops the main thread with a `ServerGroupError` naming a
    server that exits once its `sglang_max_restarts` are spent; one with restarts left is started again by
    `restart` when the pool next uses it. `command` replaces `SERVER_COMMAND` (tests run a stand-in server).

    The processes are local (`subprocess.Popen`, own session); `trace_rl.ray_servers.RayServerGroup` overrides the
    process hooks (`_specs`, `_spawn`, `_exit_code`, `_stop`, `_tail`, `_ports_taken`) to run them in Ray actors."""

    def __init__(self, cfg: RLConfig, *, command: Sequence[str] | None = None, kill_grace_s: float = KILL_GRACE_S):
        self.cfg = cfg
        self.command = command
        self.kill_grace_s = kill_grace_s
        self.specs: list[ServerSpec] = self._specs()
        n = len(self.specs)
        self.procs: list[subprocess.Popen] = []
        self.restarts = [0] * n  # restarts of each server so far (at most sglang_max_restarts)
        self.generations = [0] * n  # bumped by each restart: the pool re-syncs a server whose generation moved
        self.died: ServerGroupError | None = None
        self._closing = threading.Event()
        self._locks = [threading.Lock() for _ in range(n)]
        self._previous: dict[int, Any] = {}  # signal -> the handler it had
        self._monitor: threading.Thread | None = None

    # ----------------------------------------------------------------- process hooks (local processes)
    def _specs(self) -> list[ServerSpec]:
        return server_specs(self.cfg, self.command)

    def _ports_taken(self) -> list[ServerSpec]:
        return [s for s in self.specs if port_in_use(s.port)]

    def _assign_devices(self) -> list[str]:
        """Give each server its CUDA_VISIBLE_DEVICES (`cuda_devices`: `sglang_gpus` indexes the launcher's own
        CUDA_VISIBLE_DEVICES, else the host's GPUs); what is wrong, one line per server. CPU servers (a host without
        GPUs and a CPU trainer) keep their ids as given."""
        import torch

        host_gpus, visible = torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
        if host_gpus == 0 and self.cfg.device != "cuda":
            return []
        errors = []
        for i, spec in enumerate(self.specs):
            try:
                self.specs[i] = replace(spec, devices=cuda_devices(spec.gpus, visible, host_gpus))
            except ValueError as e:
                errors.append(f"{spec.name}: sglang_gpus={self.cfg.sglang_gpus!r}: {e}")
        return errors

    def _spawn(self, i: int, header: str) -> None:
        """Start server `i` (again), its log opened for appending with `header` first."""
        spec = self.specs[i]
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log, "ab") as log:
            log.write(f"# {header}{spec.shown()}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                spec.argv,
                env=os.environ | spec.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed as a whole, no terminal SIGINT
            )
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)

    def _exit_code(self, i: int) -> int | None:
        return self.procs[i].poll() if i < len(self.procs) else None

    def _stop(self, indices: Sequence[int]) -> None:
        """Kill the process groups of servers `indices`: SIGTERM, then SIGKILL to what is left after the kill grace;
        waits for the leaders."""
        procs = [self.procs[i] for i in indices if i < len(self.procs)]
        pgids = []
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                pgids.append(proc.pid)
            except ProcessLookupError:
                proc.poll()
        end = time.monotonic() + self.kill_grace_s
        while time.monotonic() < end:
            for proc in procs:
                proc.poll()  # reap the leader: a zombie would keep its group alive
            if not any(_group_alive(g) for g in pgids):
                break
            time.sleep(0.05)
        for g in pgids:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                print(f"launcher: SGLang server pid {proc.pid} survived SIGKILL", file=sys.stderr)

    def _tail(self, i: int) -> str:
        return log_tail(self.specs[i].log)

    # ----------------------------------------------------------------- the group
    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.specs]

    @property
    def pids(self) -> list[int]:
        """Process ids of the local servers' leaders (each also the id of its process group)."""
        return [p.pid for p in self.procs]

    def _failure(self, spec: ServerSpec, what: str) -> ServerGroupError:
        tail = self._tail(spec.index)
        return ServerGroupError(
            f"SGLang {spec.name} {what}\n  command: {spec.shown()}\n  log {spec.log} (last {LOG_TAIL_LINES} lines):\n"
            + (tail or "  (empty)")
            + memory_saver_hint(self.cfg, tail)
        )

    def start(self) -> ServerGroup:
        """Start every server and wait until each answers `/health` 200; on any failure tear the group down and
        raise `ServerGroupError` within `sglang_start_timeout_s` (plus the kill grace)."""
        try:
            wrong = self._assign_devices()
            if wrong:
                raise ServerGroupError("; ".join(wrong))
            taken = self._ports_taken()
            if taken:
                raise ServerGroupError(
                    "; ".join(f"port {s.port} of {s.name} is already in use" for s in taken)
                    + " (another server? set sglang_port_base)"
                )
            deadline = time.monotonic() + self.cfg.sglang_start_timeout_s
            for spec in self.specs:
                spec.log.parent.mkdir(parents=True, exist_ok=True)
                spec.log.write_bytes(b"")  # a fresh log per run; restarts append
                self._spawn(spec.index, "")
            self._wait_healthy(deadline, range(len(self.specs)))
        except BaseException:
            self.close()
            raise
        return self

    def _wait_healthy(self, deadline: float, indices: Sequence[int] | range, *, what: str = "") -> None:
        pending = {i: self.specs[i] for i in indices}
        from trace_rl.rollout.sglang_worker import read_secret

        key = read_secret(self.cfg.sglang_api_key, "sglang_api_key")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        while pending:
            for i, spec in list(pending.items()):
                if self._closing.is_set() and what:
                    raise ServerGroupError(f"SGLang {spec.name}: the group is closing; {what} abandoned")
                code = self._exit_code(i)
                if code is not None:
                    raise self._failure(spec, f"exited with status {code} before it was healthy{what}")
                left = deadline - time.monotonic()
                try:
                    if requests.get(f"{spec.url}/health", timeout=max(0.1, min(2.0, left)), headers=headers).ok:
                        del pending[i]
                except requests.RequestException:
                    pass
            if not pending:
                return
            if time.monotonic() >= deadline:
                spec = next(iter(pending.values()))
                raise self._failure(
                    spec,
                    f"did not answer /health within sglang_start_timeout_s={self.cfg.sglang_start_timeout_s}{what}"
                    + (f" (nor did {[s.name for s in list(pending.values())[1:]]})" if len(pending) > 1 else ""),
                )
            time.sleep(POLL_S)

    def exited(self, i: int, grace_s: float = 0.0) -> int | None:
        """Server `i`'s exit status if its process has exited, waiting up to `grace_s` for it to show (a failed call
        can come before the exit is visible); None while it runs."""
        end = time.monotonic() + grace_s
        while True:
            code = self._exit_code(i)
            if code is not None or time.monotonic() >= end:
                return code
            time.sleep(0.05)

    def restart(self, i: int) -> bool:
        """Start server `i` again if its process has exited (False if it runs: another thread restarted it, or it
        never died): what is left of its process group is killed, the same command runs on the same GPUs and port,
        its log appended, and it must answer `/health` within `sglang_start_timeout_s`; its generation moves.
        `ServerGroupError` with its log tail once its `sglang_max_restarts` are spent, or when the restart fails."""
        with self._locks[i]:
            code = self._exit_code(i)
            if code is None:
                return False
            spec, limit = self.specs[i], self.cfg.sglang_max_restarts
            if self._closing.is_set():
                raise self._failure(spec, f"exited with status {code} while the group was closing")
            if self.restarts[i] >= limit:
                raise self._failure(
                    spec,
                    f"exited with status {code} while the run used it, after {self.restarts[i]} restarts "
                    f"(sglang_max_restarts={limit})",
                )
            self.restarts[i] += 1
            n = self.restarts[i]
            print(
                f"launcher: SGLang {spec.name} exited with status {code}; restarting it ({n} of "
                f"sglang_max_restarts={limit})",
                file=sys.stderr,
            )
            self._stop([i])  # whatever its process group left behind (children holding the GPU or the port)
            self._spawn(i, f"restart {n} of {limit} after exit status {code}: ")
            self._wait_healthy(time.monotonic() + self.cfg.sglang_start_timeout_s, [i], what=f" (restart {n})")
            self.generations[i] += 1
            return True

    def check(self, *, spent_only: bool = False) -> None:
        """Raise `ServerGroupError` (log tail) if a server of the group has exited (`spent_only`: one with no
        restart left)."""
        for spec in self.specs:
            if spent_only and self._locks[spec.index].locked():  # a restart under way: it decides
                continue
            code = self._exit_code(spec.index)
            if code is None or (spent_only and self.restarts[spec.index] < self.cfg.sglang_max_restarts):
                continue
            restarts = f" after {self.restarts[spec.index]} restarts" if self.restarts[spec.index] else ""
            raise self._failure(
                spec,
                f"exited with status {code} while the run used it{restarts} "
                f"(sglang_max_restarts={self.cfg.sglang_max_restarts})",
            )

    def _watch(self) -> None:
        while not self._closing.wait(MONITOR_S):
            try:
                self.check(spent_only=True)
            except ServerGroupError as e:
                self.died = e
                # a real signal to the main thread: it interrupts a blocking call, and our handler raises `died`
                main = threading.main_thread().ident
                assert main is not None  # the main thread runs
                signal.pthread_kill(main, signal.SIGTERM)
                return

    def _on_signal(self, signum: int, frame) -> None:
        if self._closing.is_set():  # the teardown is under way (bounded): let it finish, leaving no orphan
            return
        if signum == signal.SIGTERM and self.died is not None:
            raise self.died
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        print(f"launcher: signal {signum}: stopping the SGLang servers", file=sys.stderr)
        raise SystemExit(128 + signum)

    def close(self) -> None:
        """Kill every server's process group (a restart under way notices and stops within a poll); safe to call
        twice."""
        self._closing.set()
        held = [lock.acquire(timeout=self.kill_grace_s + 5.0) for lock in self._locks]
        try:
            self._stop(range(len(self.specs)))
        finally:
            for lock, ok in zip(self._locks, held, strict=True):
                if ok:
                    lock.release()

    def __enter__(self) -> ServerGroup:
        main = threading.current_thread() is threading.main_thread()
        if main:  # handlers first: a signal during the start-up tears the group down too
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self.start()
        except BaseException:
            self._restore()
            raise
        if main:
            self._monitor = threading.Thread(target=self._watch, name="sglang-servers", daemon=True)
            self._monitor.start()
        return self

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._closing.set()
            if self._monitor is not None:
                self._monitor.join()
            died = self.died
            if died is None and exc is not None and not isinstance(exc, ServerGroupError):
                try:
                    self.check()  # a failed HTTP call: name the server that died behind it
                except ServerGroupError as e:
                    died = e
            self.close()
        finally:
            self._restore()
        if died is not None and exc is not died:
            raise died from exc
