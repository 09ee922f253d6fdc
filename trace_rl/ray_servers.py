"""Patched SGLang servers as Ray actors in a placement group (`sglang_launch = "ray"`).

`RayServerGroup` is `trace_rl.servers.ServerGroup` with its processes on the Ray cluster: one placement-group bundle
per server (`{"GPU": sglang_tp, "CPU": sglang_cpus}`, strategy PACK, so a server's TP ranks share a node), one
`ServerActor` per bundle holding exactly that bundle's resources. Each actor runs the server process with the same
command line a local server gets (`trace_rl.servers.server_specs`: one definition, here with the GPU ids Ray gave
the actor and its node's address; loopback when the actor shares the launcher's node), in its own session, logging
to `<out_dir>/servers/server<i>.log` (a file system every node sees, as the record store already needs). Health
wait, the monitor, restarts (`sglang_max_restarts`: the actor starts the process again in its bundle) and the
signal handling are the base group's. Teardown stops every server's process group through its actor, kills the
actors and removes the placement group; each actor also starts a watchdog process that kills its server's process
group if the actor process dies (a `ray.kill`, a crashed driver), so no server outlives its actor.

The launcher joins the cluster `RAY_ADDRESS` names, else starts a local one (`trace_rl.rollout.workers.init_ray`);
a placement group the cluster cannot hold within `sglang_start_timeout_s` ends the launch naming the cluster's free
resources.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trace_rl.servers import (
    HOST,
    KILL_GRACE_S,
    LOG_TAIL_LINES,
    ServerGroup,
    ServerGroupError,
    ServerSpec,
    log_tail,
    port_in_use,
    server_specs,
)

if TYPE_CHECKING:
    from trace_rl.config import RLConfig

CALL_S = 60.0  # bound of one call to an actor (its own waits are shorter)
LOST = -9  # the exit status reported for a server whose actor is gone

# Kills the server's process group once the actor that started it is gone (this process is then re-parented);
# exits by itself when the group has gone.
WATCHDOG = """
import os, signal, sys, time
actor, pgid = int(sys.argv[1]), int(sys.argv[2])
while True:
    time.sleep(0.5)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        sys.exit(0)
    except PermissionError:
        pass
    if os.getppid() != actor:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)
"""


class ServerActor:
    """One server process on the node and GPUs Ray placed this actor on (a Ray actor: `ray.remote(ServerActor)`)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.watchdog: subprocess.Popen | None = None

    def where(self) -> tuple[str, list[int]]:
        """This node's address and the GPU ids Ray assigned (its CUDA_VISIBLE_DEVICES)."""
        import ray

        return ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()]

    def port_in_use(self, host: str, port: int) -> bool:
        return port_in_use(port, host)

    def spawn(self, argv: Sequence[str], env: dict[str, str], log: str, header: str) -> int:
        """Start the server (its log appended, `header` first) and its watchdog; the server's pid."""
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as f:
            f.write(header.encode())
            f.flush()
            self.proc = subprocess.Popen(
                list(argv),
                env=os.environ | env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(os.getpid()), str(self.proc.pid)],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float) -> None:
        """SIGTERM to the server's process group, SIGKILL to what is left after `grace_s`; reaps the leader."""
        for proc in (self.proc, self.watchdog):
            if proc is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace_s
        while self.proc is not None and time.monotonic() < end:
            self.proc.poll()
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        for proc in (self.proc, self.watchdog):
            if proc is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def tail(self, log: str, lines: int) -> str:
        return log_tail(Path(log), lines)


class RayServerGroup(ServerGroup):
    """`ServerGroup` whose servers run in `ServerActor`s of one placement group (module docstring)."""

    def __init__(self, cfg: RLConfig, *, command: Sequence[str] | None = None, kill_grace_s: float = KILL_GRACE_S):
        self.pg: Any = None
        self.actors: list[Any] = []
        self._pids: list[int] = []
        super().__init__(cfg, command=command, kill_grace_s=kill_grace_s)

    # ----------------------------------------------------------------- placement
    def _specs(self) -> list[ServerSpec]:
        """Until the actors are placed: loopback and GPUs 0..tp-1 per server (`start` puts in what Ray gave)."""
        tp = self.cfg.sglang_tp
        return server_specs(self.cfg, self.command, gpus=[tuple(range(tp))] * self.cfg.rollout_workers)

    def _bundles(self) -> list[dict[str, float]]:
        return [{"GPU": float(self.cfg.sglang_tp), "CPU": float(self.cfg.sglang_cpus)}] * self.cfg.rollout_workers

    def _actor(self, i: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
        return (
            ray.remote(ServerActor)
            .options(
                num_gpus=self.cfg.sglang_tp, num_cpus=self.cfg.sglang_cpus, max_restarts=0, scheduling_strategy=strategy
            )
            .remote()
        )

    def _place(self) -> None:
        """The placement group (within `sglang_start_timeout_s`), one actor per bundle, and the specs with the
        GPU ids and addresses Ray gave them."""
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group

        from trace_rl.rollout.workers import init_ray

        init_ray()
        bundles = self._bundles()
        self.pg = placement_group(bundles, strategy="PACK", name=f"trace-sglang-{os.getpid()}-{id(self):x}")
        timeout = self.cfg.sglang_start_timeout_s
        try:
            ray.get(self.pg.ready(), timeout=timeout)
        except GetTimeoutError:
            raise ServerGroupError(
                f"Ray could not place {len(bundles)} SGLang servers of {bundles[0]} each (sglang_tp="
                f"{self.cfg.sglang_tp}, sglang_cpus={self.cfg.sglang_cpus}) within sglang_start_timeout_s={timeout}: "
                f"the cluster has {ray.available_resources()} free of {ray.cluster_resources()}"
            ) from None
        self.actors = [self._actor(i) for i in range(len(bundles))]
        where = ray.get([a.where.remote() for a in self.actors], timeout=CALL_S)
        here = ray.util.get_node_ip_address()
        hosts = [HOST if ip == here else ip for ip, _ in where]
        self.specs = server_specs(self.cfg, self.command, gpus=[tuple(g) for _, g in where], hosts=hosts)

    def start(self) -> RayServerGroup:
        try:
            self._place()
        except BaseException:
            self.close()
            raise
        super().start()
        return self

    # ----------------------------------------------------------------- process hooks, through the actors
    @property
    def pids(self) -> list[int]:
        """Process ids of the servers' leaders, on their nodes."""
        return list(self._pids)

    def _assign_devices(self) -> list[str]:
        """Ray gave each server its GPUs (their ids on its node): nothing to assign or check."""
        return []

    def _ports_taken(self) -> list[ServerSpec]:
        import ray

        taken = ray.get([a.port_in_use.remote(s.host, s.port) for a, s in zip(self.actors, self.specs, strict=True)])
        return [s for s, t in zip(self.specs, taken, strict=True) if t]

    def _spawn(self, i: int, header: str) -> None:
        import ray

        if self._exit_code(i) == LOST:  # the actor is gone: a new one in the same bundle
            self.actors[i] = self._actor(i)
        spec = self.specs[i]
        pid = ray.get(
            self.actors[i].spawn.remote(spec.argv, spec.env, str(spec.log), f"# {header}{spec.shown()}\n"),
            timeout=CALL_S,
        )
        if i < len(self._pids):
            self._pids[i] = pid
        else:
            self._pids.append(pid)

    def _exit_code(self, i: int) -> int | None:
        import ray
        from ray.exceptions import RayActorError

        if i >= len(self.actors) or i >= len(self._pids):
            return None
        try:
            return ray.get(self.actors[i].poll.remote(), timeout=CALL_S)
        except RayActorError:
            return LOST

    def _stop(self, indices: Sequence[int]) -> None:
        import ray

        refs = [self.actors[i].stop.remote(self.kill_grace_s) for i in indices if i < len(self.actors)]
        for ref in refs:
            try:
                ray.get(ref, timeout=self.kill_grace_s + CALL_S)
            except Exception as e:  # a lost actor's server was killed by its watchdog
                print(f"launcher: stopping an SGLang server actor: {type(e).__name__}: {e}", file=sys.stderr)

    def _tail(self, i: int) -> str:
        import ray

        try:
            return ray.get(self.actors[i].tail.remote(str(self.specs[i].log), LOG_TAIL_LINES), timeout=CALL_S)
        except Exception:  # the actor is gone: the log on the shared file system
            return log_tail(self.specs[i].log)

    def close(self) -> None:
        """Stop every server, kill the actors, remove the placement group; safe to call twice."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            super().close()
        finally:
            for actor in self.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass
            self.actors = []
            if self.pg is not None:
                remove_placement_group(self.pg)
                self.pg = None
