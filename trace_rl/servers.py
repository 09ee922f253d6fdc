"""A supervised group of local patched SGLang server processes (`sglang_launch = "local"`).

The launcher starts one server per entry of `sglang_gpus` on this host, each with the trainer's capture policy
(`--trace-record-bits`, `--trace-layers`, `--trace-sites`, `--trace-recipe` derived from the RLConfig, so the pool's
start-up check `SGLangWorker.check_policy` finds them equal), `CUDA_VISIBLE_DEVICES` set to its GPUs, in its own
process group, logging to `<out_dir>/servers/server<i>.log`. `ServerGroup` waits for every `/health` within
`sglang_start_timeout_s` and tears the whole group down (SIGTERM to each process group, SIGKILL after a grace
period) on exit, on an exception and on SIGINT / SIGTERM of the launcher. A server that dies while the group runs
stops the run with its log tail; nothing is restarted.
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import requests

from trace_core.records.spec import CapturePolicy, recipe_layout

if TYPE_CHECKING:
    from trace_rl.config import RLConfig

LAUNCH_MODES = ("off", "local")
HOST = "127.0.0.1"  # local servers listen on loopback only
# The server executable: `python -m sglang.launch_server`; tests put a stand-in here (or pass `command=`).
SERVER_COMMAND: list[str] = [sys.executable, "-m", "sglang.launch_server"]
# Flags the launcher derives itself (model, port, layout, capture policy, versions, keys): refused in sglang_args.
OWNED_FLAGS = (
    "--model-path",
    "--model",
    "--host",
    "--port",
    "--tp",
    "--tp-size",
    "--tensor-parallel-size",
    "--trace-mode",
    "--trace-store",
    "--trace-record-bits",
    "--trace-layers",
    "--trace-sites",
    "--trace-recipe",
    "--trace-step",
    "--weight-version",
    "--api-key",
    "--admin-api-key",
    "--base-gpu-id",
)
LOG_TAIL_LINES = 40
KILL_GRACE_S = 10.0  # SIGTERM to SIGKILL
POLL_S = 0.2  # between looks at /health and at the processes
MONITOR_S = 1.0  # between looks at the running servers


class ServerGroupError(RuntimeError):
    """A local SGLang server failed to start, or died while the run used it; the message names it, its command and
    its log tail."""


def parse_gpus(text: str) -> list[tuple[int, ...]]:
    """`sglang_gpus` as one tuple of GPU ids per server: servers separated by `;`, a server's GPUs (its TP ranks) by
    `,`, e.g. "0;1" (two servers, TP 1) or "0,1;2,3" (two servers, TP 2). ValueError saying what is wrong."""
    servers = [s.strip() for s in text.split(";")] if text.strip() else []
    if not servers or any(not s for s in servers):
        raise ValueError(f"sglang_gpus={text!r} must list GPU ids per server, e.g. '0;1' or '0,1;2,3'")
    out = []
    for s in servers:
        try:
            ids = tuple(int(g) for g in s.split(","))
        except ValueError:
            raise ValueError(f"sglang_gpus={text!r}: {s!r} is not a comma-separated list of GPU ids") from None
        if any(g < 0 for g in ids):
            raise ValueError(f"sglang_gpus={text!r}: GPU ids must be >= 0")
        out.append(ids)
    flat = [g for ids in out for g in ids]
    if len(set(flat)) != len(flat):
        raise ValueError(f"sglang_gpus={text!r} gives a GPU to two servers (or twice to one)")
    return out


def parse_args(text: str) -> list[str]:
    """`sglang_args` as argv words (shell quoting); ValueError naming a flag the launcher sets itself."""
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"sglang_args={text!r}: {e}") from None
    owned = sorted({w.split("=", 1)[0] for w in words if w.split("=", 1)[0] in OWNED_FLAGS})
    if owned:
        raise ValueError(
            f"sglang_args sets {owned}, which the launcher derives from the config (model_dir, sglang_gpus, "
            "sglang_port_base, record_bits / record_all_layers / recipe, out_dir, the key references)"
        )
    return words


def launch_errors(cfg: RLConfig) -> list[str]:
    """What is wrong with the launch keys of `cfg` (one line each, naming the key); [] with `sglang_launch = "off"`
    and the launch keys unset."""
    if cfg.sglang_launch not in LAUNCH_MODES:
        return [f"sglang_launch={cfg.sglang_launch!r} is not one of {LAUNCH_MODES} (or a boolean)"]
    if cfg.sglang_launch == "off":
        return [
            f"{k}={getattr(cfg, k)!r} needs sglang_launch='local'"
            for k in ("sglang_gpus", "sglang_args")
            if getattr(cfg, k)
        ]
    errors = []
    if cfg.rollout_backend != "sglang":
        errors.append(f"sglang_launch='local' needs rollout_backend='sglang' (got {cfg.rollout_backend!r})")
    try:
        gpus = parse_gpus(cfg.sglang_gpus)
    except ValueError as e:
        errors.append(str(e))
        gpus = []
    if gpus and cfg.rollout_workers != len(gpus):
        errors.append(f"rollout_workers={cfg.rollout_workers} must equal the {len(gpus)} servers of sglang_gpus")
    if not 1024 <= cfg.sglang_port_base <= 65535 - max(len(gpus), 1) + 1:
        errors.append(f"sglang_port_base={cfg.sglang_port_base} must leave ports 1024..65535 for {len(gpus)} servers")
    try:
        parse_args(cfg.sglang_args)
    except ValueError as e:
        errors.append(str(e))
    urls = cfg.sglang_url_list()
    if urls and gpus and urls != group_urls(cfg.sglang_port_base, len(gpus)):
        errors.append(
            f"sglang_urls={cfg.sglang_urls!r} with sglang_launch='local' must be empty (the launcher sets them to "
            f"{','.join(group_urls(cfg.sglang_port_base, len(gpus)))})"
        )
    return errors


def group_urls(port_base: int, servers: int) -> list[str]:
    """The URLs of a local group: server i on port `port_base + i` of the loopback address."""
    return [f"http://{HOST}:{port_base + i}" for i in range(servers)]


def hf_dir(model_dir: str | Path) -> Path:
    """The HF checkpoint the servers load: `<model_dir>/hf` of a tiny model, else `model_dir` itself (as
    `trace_rl.policy.load_policy` resolves it)."""
    from trace_rl.warmup import HF_DIR, MEGATRON_STATE

    path = Path(model_dir)
    return (path / HF_DIR if (path / MEGATRON_STATE).exists() else path).resolve()


def capture_flags(cfg: RLConfig) -> list[str]:
    """The `--trace-*` flags of the trainer's capture policy (`trace_rl.controller.capture_spec`): the record store
    `<out_dir>/records`, bits and layers (4 bits at every layer with `measure_all_sites`), the sites the recipe
    records, and the FP4 KV pool when K / V are recorded."""
    policy = CapturePolicy(4, "all") if cfg.measure_all_sites else cfg.capture_policy()
    layers = policy.layers if isinstance(policy.layers, str) else ",".join(map(str, policy.layers))
    layout = recipe_layout(cfg.recipe)
    sites = (["moe_in"] if layout["moe_format"] else []) + (["k", "v"] if layout["kv_format"] else [])
    flags = ["--trace-mode", "emulate", "--trace-store", str((Path(cfg.out_dir) / "records").resolve())]
    flags += ["--trace-record-bits", str(policy.bits), "--trace-layers", layers, "--trace-sites", ",".join(sites)]
    flags += ["--trace-recipe", cfg.recipe, "--trace-step", "0", "--weight-version", "0"]
    if layout["kv_format"]:
        flags += ["--kv-cache-dtype", "fp4_e2m1"]
    return flags


@dataclass(frozen=True)
class ServerSpec:
    """One server of the group: what runs, where, and where it logs."""

    index: int
    gpus: tuple[int, ...]
    port: int
    argv: tuple[str, ...]
    log: Path
    secrets: tuple[str, ...] = ()  # key values on argv, redacted from every message

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def name(self) -> str:
        return f"server{self.index} ({self.url}, GPUs {','.join(map(str, self.gpus))})"

    def shown(self) -> str:
        """The command line as messages show it: keys redacted."""
        text = shlex.join(self.argv)
        for s in self.secrets:
            text = text.replace(s, "<redacted>")
        return f"CUDA_VISIBLE_DEVICES={','.join(map(str, self.gpus))} {text}"


def server_specs(cfg: RLConfig, command: Sequence[str] | None = None) -> list[ServerSpec]:
    """The group's servers for `cfg` (its `out_dir` is the run directory whose `records/` they write), each a
    `command` (default `SERVER_COMMAND`) with the model, port, TP size, capture policy, keys and `sglang_args`."""
    from trace_rl.rollout.sglang_worker import read_secret

    prefix = list(SERVER_COMMAND if command is None else command)
    keys: list[str] = []
    secrets = []
    for flag, key in (("--api-key", "sglang_api_key"), ("--admin-api-key", "sglang_admin_api_key")):
        value = read_secret(getattr(cfg, key), key)
        if value is not None:
            keys += [flag, value]
            secrets.append(value)
    logs = Path(cfg.out_dir) / "servers"
    specs = []
    for i, gpus in enumerate(parse_gpus(cfg.sglang_gpus)):
        port = cfg.sglang_port_base + i
        argv = prefix + ["--model-path", str(hf_dir(cfg.model_dir)), "--host", HOST, "--port", str(port)]
        argv += [
            "--tp",
            str(len(gpus)),
            "--skip-tokenizer-init",
            *capture_flags(cfg),
            *keys,
            *parse_args(cfg.sglang_args),
        ]
        specs.append(ServerSpec(i, gpus, port, tuple(argv), logs / f"server{i}.log", tuple(secrets)))
    return specs


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


class ServerGroup:
    """The local SGLang servers of one run, supervised: `with ServerGroup(cfg) as group:` starts them, waits for
    every `/health` within `sglang_start_timeout_s`, and on leaving kills every server's process group.

    While entered in the main thread, SIGINT raises KeyboardInterrupt and SIGTERM SystemExit(143) (the previous
    handlers come back on exit), and a monitor thread stops the main thread with a `ServerGroupError` naming a
    server that exits. `command` replaces `SERVER_COMMAND` (tests run a stand-in server)."""

    def __init__(self, cfg: RLConfig, *, command: Sequence[str] | None = None, kill_grace_s: float = KILL_GRACE_S):
        self.cfg = cfg
        self.specs = server_specs(cfg, command)
        self.kill_grace_s = kill_grace_s
        self.procs: list[subprocess.Popen] = []
        self.died: ServerGroupError | None = None
        self._closing = threading.Event()
        self._previous: dict[int, object] = {}
        self._monitor: threading.Thread | None = None

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.specs]

    @property
    def pids(self) -> list[int]:
        """Process ids of the servers' leaders (each also the id of its process group)."""
        return [p.pid for p in self.procs]

    def _failure(self, spec: ServerSpec, what: str) -> ServerGroupError:
        tail = log_tail(spec.log)
        return ServerGroupError(
            f"SGLang {spec.name} {what}\n  command: {spec.shown()}\n  log {spec.log} (last {LOG_TAIL_LINES} lines):\n"
            + (tail or "  (empty)")
        )

    def start(self) -> ServerGroup:
        """Start every server and wait until each answers `/health` 200; on any failure tear the group down and
        raise `ServerGroupError` within `sglang_start_timeout_s` (plus the kill grace)."""
        taken = [s for s in self.specs if port_in_use(s.port)]
        if taken:
            raise ServerGroupError(
                "; ".join(f"port {s.port} of {s.name} is already in use" for s in taken)
                + " (another server? set sglang_port_base)"
            )
        deadline = time.monotonic() + self.cfg.sglang_start_timeout_s
        try:
            for spec in self.specs:
                spec.log.parent.mkdir(parents=True, exist_ok=True)
                env = os.environ | {"CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.gpus))}
                with open(spec.log, "wb") as log:
                    log.write(f"# {spec.shown()}\n".encode())
                    log.flush()
                    self.procs.append(
                        subprocess.Popen(
                            spec.argv,
                            env=env,
                            stdin=subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,  # its own process group: killed as a whole, no terminal SIGINT
                        )
                    )
            self._wait_healthy(deadline)
        except BaseException:
            self.close()
            raise
        return self

    def _wait_healthy(self, deadline: float) -> None:
        pending = dict(enumerate(self.specs))
        from trace_rl.rollout.sglang_worker import read_secret

        key = read_secret(self.cfg.sglang_api_key, "sglang_api_key")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        while pending:
            for i, spec in list(pending.items()):
                code = self.procs[i].poll()
                if code is not None:
                    raise self._failure(spec, f"exited with status {code} before it was healthy")
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
                    f"did not answer /health within sglang_start_timeout_s={self.cfg.sglang_start_timeout_s}"
                    + (f" (nor did {[s.name for s in list(pending.values())[1:]]})" if len(pending) > 1 else ""),
                )
            time.sleep(POLL_S)

    def check(self) -> None:
        """Raise `ServerGroupError` (log tail) if a server of the group has exited."""
        for spec, proc in zip(self.specs, self.procs, strict=False):
            code = proc.poll()
            if code is not None:
                raise self._failure(spec, f"exited with status {code} while the run used it")

    def _watch(self) -> None:
        while not self._closing.wait(MONITOR_S):
            try:
                self.check()
            except ServerGroupError as e:
                self.died = e
                # a real signal to the main thread: it interrupts a blocking call, and our handler raises `died`
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
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
        """Kill every server's process group: SIGTERM, then SIGKILL to what is left after `kill_grace_s`; waits for
        the leaders. Safe to call twice."""
        self._closing.set()
        pgids = []
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                pgids.append(proc.pid)
            except ProcessLookupError:
                proc.poll()
        end = time.monotonic() + self.kill_grace_s
        while time.monotonic() < end:
            for proc in self.procs:
                proc.poll()  # reap the leader: a zombie would keep its group alive
            if not any(_group_alive(g) for g in pgids):
                break
            time.sleep(0.05)
        for g in pgids:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                print(f"launcher: SGLang server pid {proc.pid} survived SIGKILL", file=sys.stderr)

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
            if died is None and exc is not None:
                try:
                    self.check()  # a failed HTTP call: name the server that died behind it
                except ServerGroupError as e:
                    died = e
            self.close()
        finally:
            self._restore()
        if died is not None and exc is not died:
            raise died from exc
