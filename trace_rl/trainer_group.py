"""A group of trainer ranks as Ray actors: one placement group (a bundle of CPUs and, on GPU machines, GPUs per
rank), torch.distributed initialised across the actors (NCCL on GPU, gloo on CPU) and Megatron's process groups on
top of it (`megatron_trace.parallel.Layout.init` inside each rank).

Each actor gets the torchrun environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK` = 0 since Ray gives each actor its own
`CUDA_VISIBLE_DEVICES`, `MASTER_ADDR` / `MASTER_PORT` of rank 0's node and a free port there), so code written for
torchrun runs unchanged: `run(fn, ...)` calls `fn` on every rank at once (a collective), `start(cls, ...)` builds one
object per rank and `call(name, ...)` calls its method on every rank. Results come back in rank order.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable


class _Rank:
    """One trainer rank (a Ray actor process)."""

    def __init__(self):
        self.obj = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (rank 0 hosts the rendezvous)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def setup(self, rank: int, world: int, addr: str, port: int) -> None:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", MASTER_ADDR=addr, MASTER_PORT=str(port)
        )

    def run(self, fn: Callable, *args, **kwargs):
        return fn(*args, **kwargs)

    def start(self, cls: type, *args, **kwargs) -> None:
        self.obj = cls(*args, **kwargs)

    def call(self, name: str, *args, **kwargs):
        return getattr(self.obj, name)(*args, **kwargs)


class TrainerGroup:
    """`world` trainer ranks in one Ray placement group, `cpus_per_rank` CPUs and `gpus_per_rank` GPUs each."""

    def __init__(
        self,
        world: int,
        *,
        cpus_per_rank: float = 1,
        gpus_per_rank: float = 0,
        strategy: str = "PACK",
        placement_timeout_s: float = 120,
    ):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from trace_rl.rollout.workers import init_ray

        if world < 1:
            raise ValueError(f"a trainer group needs at least one rank, got {world}")
        init_ray()
        bundle = {"CPU": cpus_per_rank} | ({"GPU": gpus_per_rank} if gpus_per_rank else {})
        self.placement = placement_group([dict(bundle) for _ in range(world)], strategy=strategy)
        try:
            ray.get(self.placement.ready(), timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.placement)
            raise RuntimeError(
                f"the trainer group's {world} ranks of {bundle} were not placed within {placement_timeout_s} s; the "
                f"Ray cluster has {ray.cluster_resources()} (free: {ray.available_resources()}): start Ray on more "
                "GPUs / nodes (RAY_ADDRESS) or choose a smaller layout (tp * pp * dp ranks)"
            ) from None
        actor = ray.remote(_Rank)
        self.ranks = [
            actor.options(
                num_cpus=cpus_per_rank,
                num_gpus=gpus_per_rank,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=i),
            ).remote()
            for i in range(world)
        ]
        addr, port = ray.get(self.ranks[0].address.remote())
        ray.get([r.setup.remote(i, world, addr, port) for i, r in enumerate(self.ranks)])

    def run(self, fn: Callable, *args, **kwargs) -> list:
        """`fn(*args, **kwargs)` on every rank at once; the results in rank order."""
        import ray

        return ray.get([r.run.remote(fn, *args, **kwargs) for r in self.ranks])

    def start(self, cls: type, *args, **kwargs) -> None:
        """Build `cls(*args, **kwargs)` on every rank (its constructor may initialise the process groups)."""
        import ray

        ray.get([r.start.remote(cls, *args, **kwargs) for r in self.ranks])

    def call(self, name: str, *args, **kwargs) -> list:
        """Method `name` of every rank's object, called at once; the results in rank order."""
        import ray

        return ray.get([r.call.remote(name, *args, **kwargs) for r in self.ranks])

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for r in self.ranks:
            ray.kill(r)
        remove_placement_group(self.placement)
