"""The command lines of the SGLang servers the launcher starts (`sglang_launch = "local"` or `"ray"`), one definition
for both placements, and the checks of the launch keys.

Each server is `python -m sglang.launch_server --model-path <hf dir> --host H --port P --tp N --skip-tokenizer-init`
with the trainer's capture policy (`capture_flags`: `--trace-*` derived from the RLConfig, so that the pool's
start-up check `SGLangWorker.check_policy` finds them equal), `--enable-memory-saver` with `colocate`, the keys
(read from their `env:` / `file:` references, redacted from every message) and `sglang_args` (which may not set a
flag the launcher derives). `trace_rl.servers` supervises them as local processes, `trace_rl.ray_servers` as Ray
actors.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trace_core.records.spec import CapturePolicy, recipe_layout

if TYPE_CHECKING:
    from trace_rl.config import RLConfig

LAUNCH_MODES = ("off", "local", "ray")
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
MEMORY_SAVER_FLAG = "--enable-memory-saver"  # colocate: SGLang's release / resume of its GPU memory


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


def cuda_devices(gpus: Sequence[int], visible: str | None, host_gpus: int) -> tuple[str, ...]:
    """The CUDA_VISIBLE_DEVICES entries of a local server on GPU indices `gpus`: indices into the launcher's own
    `visible` CUDA_VISIBLE_DEVICES when it has one (a scheduler's allocation: 0 is its first GPU), else among the
    host's `host_gpus` GPUs. ValueError naming an index beyond them."""
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible is not None else None
    count = len(entries) if entries is not None else host_gpus
    missing = [g for g in gpus if g >= count]
    if missing:
        where = f"CUDA_VISIBLE_DEVICES={visible!r} of the launcher" if entries is not None else "this host"
        raise ValueError(f"GPU {missing[0]} does not exist: {where} has {count} GPU(s), indices 0..{count - 1}")
    return tuple(entries[g] for g in gpus) if entries is not None else tuple(map(str, gpus))


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
    errors = []
    if cfg.sglang_max_restarts < 0:
        errors.append(f"sglang_max_restarts={cfg.sglang_max_restarts} must be >= 0")
    if cfg.colocate and cfg.rollout_backend != "sglang":
        errors.append(f"colocate=true needs rollout_backend='sglang' (got {cfg.rollout_backend!r})")
    if cfg.sglang_launch != "ray":
        errors += [
            f"{k}={getattr(cfg, k)} needs sglang_launch='ray' (local servers take their GPUs from sglang_gpus)"
            for k in ("sglang_tp", "sglang_cpus")
            if getattr(cfg, k) != 1
        ]
    if cfg.sglang_launch == "off":
        return errors + [
            f"{k}={getattr(cfg, k)!r} needs sglang_launch='local' or 'ray'"
            for k in ("sglang_gpus", "sglang_args")
            if getattr(cfg, k)
        ]
    if cfg.rollout_backend != "sglang":
        errors.append(
            f"sglang_launch={cfg.sglang_launch!r} needs rollout_backend='sglang' (got {cfg.rollout_backend!r})"
        )
    servers = cfg.rollout_workers
    if cfg.sglang_launch == "local":
        try:
            gpus = parse_gpus(cfg.sglang_gpus)
        except ValueError as e:
            errors.append(str(e))
            gpus = []
        if gpus and cfg.rollout_workers != len(gpus):
            errors.append(f"rollout_workers={cfg.rollout_workers} must equal the {len(gpus)} servers of sglang_gpus")
        servers = len(gpus)
    else:
        if cfg.sglang_gpus:
            errors.append(
                f"sglang_gpus={cfg.sglang_gpus!r} with sglang_launch='ray': Ray assigns the GPUs (set sglang_tp, the "
                "GPUs of each server's bundle, and rollout_workers, the number of servers)"
            )
        errors += [f"{k}={getattr(cfg, k)} must be >= 1" for k in ("sglang_tp", "sglang_cpus") if getattr(cfg, k) < 1]
    if not 1024 <= cfg.sglang_port_base <= 65535 - max(servers, 1) + 1:
        errors.append(f"sglang_port_base={cfg.sglang_port_base} must leave ports 1024..65535 for {servers} servers")
    try:
        parse_args(cfg.sglang_args)
    except ValueError as e:
        errors.append(str(e))
    urls = cfg.sglang_url_list()
    if urls and servers and cfg.sglang_launch == "local" and urls != group_urls(cfg.sglang_port_base, servers):
        errors.append(
            f"sglang_urls={cfg.sglang_urls!r} with sglang_launch='local' must be empty (the launcher sets them to "
            f"{','.join(group_urls(cfg.sglang_port_base, servers))})"
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


ROUTES_FLAG = "--enable-return-routed-experts"  # bf16: SGLang's own R3 capture, the routes in each answer


def capture_flags(cfg: RLConfig) -> list[str]:
    """The `--trace-*` flags of the trainer's capture policy (`trace_rl.controller.capture_spec`): the record store
    (`RLConfig.record_store_dir`), bits and layers (4 bits at every layer with `measure_all_sites`), the sites the
    recipe records, and the FP4 KV pool when K / V are recorded. In `bf16` mode the server is SGLang unchanged
    (TRACE off, BF16 experts and KV cache) returning each answer's routes, which the worker stores for R3."""
    if cfg.mode == "bf16":
        return ["--trace-mode", "off", "--weight-version", "0", ROUTES_FLAG]
    policy = CapturePolicy(4, "all") if cfg.measure_all_sites else cfg.capture_policy()
    layers = policy.layers if isinstance(policy.layers, str) else ",".join(map(str, policy.layers))
    layout = recipe_layout(cfg.recipe)
    sites = (["moe_in"] if layout["moe_format"] else []) + (["k", "v"] if layout["kv_format"] else [])
    flags = ["--trace-mode", "emulate", "--trace-store", str(cfg.record_store_dir())]
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
    host: str = HOST  # where it listens: loopback on this host, a Ray node's address elsewhere
    devices: tuple[str, ...] = ()  # its CUDA_VISIBLE_DEVICES entries (`cuda_devices`; empty: the ids in `gpus`)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What its environment adds to the launcher's: its GPUs."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.devices or map(str, self.gpus))}

    @property
    def name(self) -> str:
        return f"server{self.index} ({self.url}, GPUs {','.join(map(str, self.gpus))})"

    def shown(self) -> str:
        """The command line as messages show it: keys redacted."""
        text = shlex.join(self.argv)
        for s in self.secrets:
            text = text.replace(s, "<redacted>")
        return f"CUDA_VISIBLE_DEVICES={self.env['CUDA_VISIBLE_DEVICES']} {text}"


def server_specs(
    cfg: RLConfig,
    command: Sequence[str] | None = None,
    *,
    gpus: Sequence[tuple[int, ...]] | None = None,
    hosts: Sequence[str] | None = None,
) -> list[ServerSpec]:
    """The group's servers for `cfg` (its `out_dir` is the run directory whose `records/` they write), each a
    `command` (default `SERVER_COMMAND`) with the model, port, TP size, capture policy, keys, `--enable-memory-saver`
    with `colocate`, and `sglang_args`. `gpus` (default: `sglang_gpus`) and `hosts` (default: loopback) per server:
    what Ray assigned to the actors of a `RayServerGroup`."""
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
    layout = parse_gpus(cfg.sglang_gpus) if gpus is None else list(gpus)
    specs = []
    for i, ids in enumerate(layout):
        port, host = cfg.sglang_port_base + i, HOST if hosts is None else hosts[i]
        argv = prefix + ["--model-path", str(hf_dir(cfg.model_dir)), "--host", host, "--port", str(port)]
        argv += [
            "--tp",
            str(len(ids)),
            "--skip-tokenizer-init",
            *capture_flags(cfg),
            *([MEMORY_SAVER_FLAG] if cfg.colocate else []),
            *keys,
            *parse_args(cfg.sglang_args),
        ]
        specs.append(ServerSpec(i, tuple(ids), port, tuple(argv), logs / f"server{i}.log", tuple(secrets), host))
    return specs
