"""Weight sync from the trainer to patched SGLang servers (`rollout_backend = "sglang"`): one of three transports,
chosen by `weight_sync`, each followed by the policy-version check (`/model_info` must report the new version).

- `disk`: the HF tensors go to `<out_dir>/weights/v<version>/` (`model.safetensors` + `config.json`) and every
  server gets `/update_weights_from_disk` with `weight_version`. The servers must see that directory.
- `tensor` (colocated, on the servers' host): the tensors go in buckets of at most `weight_sync_bucket_mb` (a tensor
  larger than that alone) to `/update_weights_from_tensor`: per server, one `serialized_named_tensors` entry per TP
  rank, each SGLang's `MultiprocessingSerializer` form of `[(name, tensor), ...]` (torch's `ForkingPickler`, base64):
  CUDA tensors travel as CUDA IPC handles (device named by UUID, SGLang's `monkey_patch_torch_reductions`), CPU
  tensors as shared-memory files (a staging copy of one bucket). The default `load_format` (None): TRACE refuses
  formats that bypass `FusedMoE.weight_loader` (`sglang_trace.hooks.refuse_weight_update`), where emulate mode
  fake-quantizes the expert weights as after a disk load.
- `distributed` (disaggregated): at start-up every server joins one torch.distributed group with this process
  (`/init_weights_update_group`: rank 0 is this process, the sender; server i's TP ranks follow, world size = 1 +
  every server's TP size; `weight_sync_backend` nccl, or gloo on CPU); per update and bucket every server gets
  `/update_weights_from_distributed` with the bucket's names, dtypes and shapes while rank 0 broadcasts its tensors
  in that order, as SGLang's `ModelRunner.update_weights_from_distributed` receives them; `/destroy_weights_update_
  group` at `close`. A group that does not form within `weight_sync_timeout_s` fails the start-up naming the
  servers that did not join.

Every bucket carries `weight_version` (TRACE's server files records under it from the first bucket on; an update
without one would make it refuse records) and only the last one `flush_cache`. Before any transport the trainer's
names and shapes are checked against the checkpoint the servers serve (`checkpoint_manifest`): SGLang's
`load_weights` skips a name its model lacks, so a renamed tensor would leave the old values under the new version.

A failing `tensor` or `distributed` sync raises, or with `weight_sync_disk_fallback` falls back to `disk`, said on
stderr and counted (`weight_sync/disk_fallbacks`); after a failed distributed sync the group is not used again (its
collectives may be out of step with a server's). Each sync reports `weight_sync/seconds`, `weight_sync/bytes`,
`weight_sync/buckets`, `weight_sync/disk_syncs`, `weight_sync/disk_fallbacks` and, for CUDA tensors,
`weight_sync/gpu_peak_extra_bytes`. The tensors are the trainer's whole HF export (`hf_weights()`), cut into buckets
(`trace_rl.weight_buckets`, with the name check and the tensor payload); streaming them bucket by bucket from the
shards is not done.
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trace_rl.weight_buckets import (
    MIB,
    Bucket,
    WeightSyncError,
    check_manifest,
    checkpoint_manifest,
    iter_buckets,
    nbytes,
    plan_buckets,
    stage,
    tensor_payload,
)

if TYPE_CHECKING:
    from trace_rl.config import RLConfig
    from trace_rl.rollout.sglang_worker import SGLangWorker

WEIGHT_SYNCS = ("disk", "tensor", "distributed")
BACKENDS = ("nccl", "gloo")
GROUP_NAME = "weight_update_group"  # SGLang's default group name
ENDPOINT_DISTRIBUTED = "/update_weights_from_distributed"
LOOPBACK = ("localhost", "127.0.0.1", "::1")


# ----------------------------------------------------------------- config
def parse_master(text: str) -> tuple[str, int]:
    """`weight_sync_master` as (host, port): "host", "host:port" or "[v6]:port" (port 0 or none: a free one);
    ValueError otherwise."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":") or "0"
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:  # a bare host name or address (an IPv6 address without brackets has no port)
        host, port = text, "0"
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"weight_sync_master={text!r}: port {port!r} is not a number") from None
    if not host or not 0 <= number <= 65535:
        raise ValueError(f"weight_sync_master={text!r} must be 'host' or 'host:port' (port 0..65535)")
    return host, number


def _is_local(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host in (socket.gethostname(), socket.getfqdn())


def weight_sync_errors(cfg: RLConfig) -> list[str]:
    """What is wrong with the weight-sync keys of `cfg` (one line each, naming the key)."""
    errors = []
    if cfg.weight_sync not in WEIGHT_SYNCS:
        return [f"weight_sync={cfg.weight_sync!r} is not one of {WEIGHT_SYNCS}"]
    if cfg.weight_sync != "disk" and cfg.rollout_backend != "sglang":
        errors.append(
            f"weight_sync={cfg.weight_sync!r} needs rollout_backend='sglang' (embedded workers get the trainer's "
            "tensors directly)"
        )
    if not cfg.weight_sync_bucket_mb > 0:
        errors.append(f"weight_sync_bucket_mb={cfg.weight_sync_bucket_mb} must be > 0")
    if cfg.weight_sync_disk_fallback and cfg.weight_sync == "disk":
        errors.append(
            "weight_sync_disk_fallback=true needs weight_sync='tensor' or 'distributed' (disk is the fallback)"
        )
    if cfg.weight_sync_backend not in BACKENDS:
        errors.append(f"weight_sync_backend={cfg.weight_sync_backend!r} is not one of {BACKENDS}")
    elif cfg.weight_sync_backend != "nccl" and cfg.weight_sync != "distributed":
        errors.append(f"weight_sync_backend={cfg.weight_sync_backend!r} needs weight_sync='distributed'")
    if cfg.weight_sync_master:
        if cfg.weight_sync != "distributed":
            errors.append(f"weight_sync_master={cfg.weight_sync_master!r} needs weight_sync='distributed'")
        try:
            parse_master(cfg.weight_sync_master)
        except ValueError as e:
            errors.append(str(e))
    remote = (
        [u for u in cfg.sglang_url_list() if not _is_local(urllib.parse.urlsplit(u).hostname or "")]
        if cfg.weight_sync != "disk"
        else []
    )
    if cfg.weight_sync == "tensor" and remote:
        errors.append(
            f"weight_sync='tensor' hands the servers CUDA IPC / shared-memory handles, so they must run on this host "
            f"(colocated); {remote} are not local: use weight_sync='distributed'"
        )
    if cfg.weight_sync == "distributed" and remote and not cfg.weight_sync_master:
        errors.append(
            f"weight_sync='distributed' with servers on other hosts ({remote}) needs weight_sync_master: this host's "
            "address as the servers reach it ('host' or 'host:port')"
        )
    return errors


# ----------------------------------------------------------------- the distributed group
def init_group(backend: str, host: str, port: int, world_size: int, rank: int, timeout_s: float):
    """Join the weight-update group at `tcp://host:port` as `rank` of `world_size` with SGLang's own
    `init_custom_process_group` (what the servers' `init_weights_update_group` calls), every rendezvous and
    collective bounded by `timeout_s`."""
    from sglang.srt.utils.common import init_custom_process_group

    return init_custom_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{port}",
        world_size=world_size,
        rank=rank,
        group_name=GROUP_NAME,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def broadcast_bucket(tensors: Sequence[torch.Tensor], group, device: torch.device | None = None) -> None:
    """Rank 0 sends `tensors` in order, one broadcast each, as SGLang's receiver posts them (one per name, src 0);
    `device`: where the backend needs them (NCCL: this rank's GPU), copied one at a time."""
    for t in tensors:
        t = t if device is None or t.device == device else t.to(device)
        torch.distributed.broadcast(t.contiguous(), src=0, group=group)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------- transports
def _post_all(
    workers: Sequence[SGLangWorker], endpoint: str, payloads: Sequence[dict], deadline: float
) -> list[Future]:
    ex = ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="weight-sync")
    try:
        return [
            ex.submit(w.post_update, endpoint, p, deadline=deadline) for w, p in zip(workers, payloads, strict=True)
        ]
    finally:
        ex.shutdown(wait=False)


def _results(futures: Sequence[Future]) -> None:
    """Wait for every call (each bounded by its deadline), then raise the first failure."""
    errors = [f.exception() for f in futures]
    for e in errors:
        if e is not None:
            raise e


class DiskTransport:
    """`<weights_root>/v<version>/` (safetensors + config.json), then `/update_weights_from_disk` on every server."""

    kind = "disk"

    def __init__(self, workers: Sequence[SGLangWorker], hf_config: Path, weights_root: Path):
        self.workers, self.hf_config, self.weights_root = list(workers), hf_config, weights_root
        self.latest: tuple[Path, int] | None = None  # the export kept on disk and its version

    def load(self, workers: Sequence[SGLangWorker], version: int, deadline: float) -> bool:
        """`workers` load the kept export of `version` (restarted servers catching up); False if there is none."""
        if self.latest is None or self.latest[1] != version or not self.latest[0].is_dir():
            return False
        path = self.latest[0]
        payload = {"model_path": str(path), "weight_version": str(version)}
        _results(_post_all(workers, "/update_weights_from_disk", [payload] * len(workers), deadline))
        return True

    def push(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        deadline: float,
        workers: Sequence[SGLangWorker] | None = None,
    ) -> int:
        from safetensors.torch import save_file

        workers = self.workers if workers is None else workers

        path = self.weights_root / f"v{version}"
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors")
        shutil.copy(self.hf_config, tmp / "config.json")
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
        self.latest = (path, version)
        self.load(workers, version, deadline)
        for old in self.weights_root.iterdir():
            if old != path:
                shutil.rmtree(old)
        return 0


class TensorTransport:
    """Buckets through `/update_weights_from_tensor` (CUDA IPC or shared memory; the servers on this host)."""

    kind = "tensor"

    def __init__(self, workers: Sequence[SGLangWorker], bucket_bytes: int):
        self.workers, self.bucket_bytes = list(workers), bucket_bytes

    def push(
        self,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        deadline: float,
        workers: Sequence[SGLangWorker] | None = None,
    ) -> int:
        workers = self.workers if workers is None else workers
        plan = plan_buckets(tensors, self.bucket_bytes)
        for i, bucket in enumerate(plan):
            staged = stage([tensors[n] for n in bucket.names])
            named = list(zip(bucket.names, staged, strict=True))
            last = i == len(plan) - 1
            payloads = [tensor_payload(named, w.tp_size, version, flush_cache=last) for w in workers]
            _results(_post_all(workers, "/update_weights_from_tensor", payloads, deadline))
            del staged, named, payloads  # the servers copied them: the shared memory / IPC handles may go
        if any(t.is_cuda for t in tensors.values()):
            torch.cuda.ipc_collect()
        return len(plan)


class DistributedTransport:
    """One torch.distributed group of this process (rank 0) and every server's TP ranks, formed by `open`."""

    kind = "distributed"

    def __init__(self, workers: Sequence[SGLangWorker], cfg: RLConfig):
        self.workers, self.cfg = list(workers), cfg
        self.bucket_bytes = int(cfg.weight_sync_bucket_mb * MIB)
        self.group = None
        self.broken: str | None = None  # why the group may not be used again (a failed sync)

    def open(self) -> None:
        """Form the group within `weight_sync_timeout_s`: every server's `/init_weights_update_group` and this
        process's rendezvous at once; WeightSyncError naming each server that answered an error or did not join."""
        cfg = self.cfg
        for w in self.workers:
            for key in ("dp_size", "pp_size"):
                if int(w.server_info.get(key) or 1) != 1:
                    raise WeightSyncError(
                        f"SGLang server {w.url}: weight_sync='distributed' needs {key}=1 (its group ranks are "
                        f"rank_offset + tp_rank), the server has {w.server_info.get(key)}"
                    )
        host, port = parse_master(cfg.weight_sync_master) if cfg.weight_sync_master else ("127.0.0.1", 0)
        port = port or free_port(host)
        sizes = [w.tp_size for w in self.workers]
        self.world = 1 + sum(sizes)
        self.offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        payloads = [
            {
                "master_address": host,
                "master_port": port,
                "rank_offset": offset,
                "world_size": self.world,
                "group_name": GROUP_NAME,
                "backend": cfg.weight_sync_backend,
            }
            for offset in self.offsets
        ]
        timeout = cfg.weight_sync_timeout_s
        deadline = time.monotonic() + timeout
        futures = _post_all(self.workers, "/init_weights_update_group", payloads, deadline)
        try:  # rank 0 hosts the group's store and waits for every server's ranks, at most `timeout`
            self.group = init_group(cfg.weight_sync_backend, host, port, self.world, 0, timeout)
        except Exception as e:  # the rendezvous timed out or failed: name who did not join, and why
            raise WeightSyncError(self._not_formed(futures, deadline, f"{type(e).__name__}: {e}")) from None
        problems = self._answers(futures, deadline)
        if problems:
            self.close()
            raise WeightSyncError(self._message(problems, "formed, but"))

    def _answers(self, futures: Sequence[Future], deadline: float) -> list[str]:
        problems = []
        for w, f, offset in zip(self.workers, futures, self.offsets, strict=True):
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
            except TimeoutError:
                problems.append(f"{w.url} (ranks {offset}..{offset + w.tp_size - 1}) did not answer")
            except Exception as e:
                problems.append(f"{w.url} (ranks {offset}..{offset + w.tp_size - 1}): {e}")
        return problems

    def _not_formed(self, futures: Sequence[Future], deadline: float, cause: str) -> str:
        return self._message(self._answers(futures, deadline) or ["every server answered"], f"not formed ({cause}):")

    def _message(self, problems: list[str], what: str) -> str:
        return (
            f"weight-update group of {self.world} ranks ({self.cfg.weight_sync_backend}) {what} "
            + "; ".join(problems)
            + f" (weight_sync_timeout_s={self.cfg.weight_sync_timeout_s})"
        )

    def push(self, tensors: Mapping[str, torch.Tensor], version: int, deadline: float) -> int:
        if self.broken:
            raise WeightSyncError(f"the weight-update group is not used again after a failed sync: {self.broken}")
        device = torch.device("cuda", torch.cuda.current_device()) if self.cfg.weight_sync_backend == "nccl" else None
        plan = list(iter_buckets(tensors, self.bucket_bytes))
        try:
            for i, (bucket, ts) in enumerate(plan):
                self._bucket(i, bucket, ts, last=i == len(plan) - 1, version=version, device=device, deadline=deadline)
        except Exception as e:  # the group's collectives may be out of step with a server's now: not used again
            self.broken = f"version {version}: {type(e).__name__}: {e}"
            raise
        return len(plan)

    def _bucket(self, i: int, bucket: Bucket, ts: list, *, last: bool, version: int, device, deadline: float) -> None:
        """Every server's `/update_weights_from_distributed` of `bucket` while rank 0 broadcasts its tensors."""
        payload = bucket.metadata() | {"group_name": GROUP_NAME, "flush_cache": last, "weight_version": str(version)}
        futures = _post_all(self.workers, ENDPOINT_DISTRIBUTED, [payload] * len(self.workers), deadline)
        try:
            broadcast_bucket(ts, self.group, device)
        except Exception as e:
            answers = [
                f"{w.url}: {f.exception()}"
                for w, f in zip(self.workers, futures, strict=True)
                if f.done() and f.exception()
            ]
            raise WeightSyncError(
                f"broadcast of bucket {i} ({len(ts)} tensors) failed: {type(e).__name__}: {e}"
                + (f"; the servers answered: {'; '.join(answers)}" if answers else "")
            ) from e
        _results(futures)

    def close(self, skip: Sequence[int] = ()) -> None:
        """`/destroy_weights_update_group` on every server but those of `skip` (restarted: they hold no group; best
        effort, problems said on stderr), then this process's side of the group."""
        if self.group is None:
            return
        deadline = time.monotonic() + min(self.cfg.weight_sync_timeout_s, 60.0)
        payload = {"group_name": GROUP_NAME}
        members = [w for i, w in enumerate(self.workers) if i not in skip]
        futures = _post_all(members, "/destroy_weights_update_group", [payload] * len(members), deadline)
        for w, f in zip(members, futures, strict=True):
            if f.exception() is not None:
                print(f"weight sync: {w.url}: destroying the weight-update group: {f.exception()}", file=sys.stderr)
        try:
            torch.distributed.destroy_process_group(self.group)
        finally:
            self.group = None

    def reopen(self, restarted: Sequence[int]) -> None:
        """Form the group again after the servers of `restarted` were started again (a restarted server left the
        old group with its process): the others leave the old one, then every server joins a new one."""
        self.close(skip=restarted)
        self.broken = None
        self.open()


class WeightSync:
    """The pool's weight sync: the configured transport, the disk fallback, the checks and the metrics."""

    def __init__(self, cfg: RLConfig, workers: Sequence[SGLangWorker], hf_dir: Path, weights_root: Path):
        self.cfg, self.workers = cfg, list(workers)
        self.hf_dir = Path(hf_dir)
        self.manifest = checkpoint_manifest(self.hf_dir)
        self.disk = DiskTransport(self.workers, self.hf_dir / "config.json", weights_root)
        self.transport: DiskTransport | TensorTransport | DistributedTransport
        if cfg.weight_sync == "tensor":
            self.transport = TensorTransport(self.workers, int(cfg.weight_sync_bucket_mb * MIB))
        elif cfg.weight_sync == "distributed":
            self.transport = DistributedTransport(self.workers, cfg)
            self.transport.open()
        else:
            self.transport = self.disk
        self.disk_fallbacks = 0  # over the run

    def push(self, tensors: Mapping[str, torch.Tensor], version: int) -> dict[str, float]:
        """Every server serves `tensors` as policy `version` (its `/model_info` says so), or an error; the metrics
        of the sync."""
        if not tensors:
            raise WeightSyncError("no tensors to sync (the trainer's first pipeline stage exports them)")
        check_manifest(tensors, self.manifest, str(self.hf_dir))
        cuda = next((t.device for t in tensors.values() if t.is_cuda), None)
        if cuda is not None:
            torch.cuda.synchronize(cuda)
            torch.cuda.reset_peak_memory_stats(cuda)
            base = torch.cuda.memory_allocated(cuda)
        start = time.perf_counter()
        fallback = False
        buckets = self._push(self.transport, tensors, version)
        if buckets is None:  # the transport failed and the config allows disk: counted, said
            fallback = True
            buckets = self._push(self.disk, tensors, version)
        metrics = {
            "weight_sync/seconds": time.perf_counter() - start,
            "weight_sync/bytes": float(sum(nbytes(t) for t in tensors.values())),
            "weight_sync/buckets": float(buckets),
            "weight_sync/disk_syncs": float(fallback or self.transport is self.disk),
            "weight_sync/disk_fallbacks": float(fallback),
        }
        if cuda is not None:
            metrics["weight_sync/gpu_peak_extra_bytes"] = float(torch.cuda.max_memory_allocated(cuda) - base)
        return metrics

    def _push(self, transport, tensors: Mapping[str, torch.Tensor], version: int) -> int | None:
        """`transport`'s sync and the version check; None when it failed and the disk fallback may follow."""
        deadline = time.monotonic() + self.cfg.weight_sync_timeout_s
        try:
            buckets = transport.push(tensors, version, deadline)
            for w in self.workers:
                w.check_version(version, deadline=deadline)
            return buckets
        except Exception as e:
            if transport is self.disk or not self.cfg.weight_sync_disk_fallback:
                raise
            self.disk_fallbacks += 1
            print(
                f"weight sync of policy version {version}: weight_sync={transport.kind!r} failed ({e}); falling back "
                f"to disk (weight_sync_disk_fallback; {self.disk_fallbacks} so far)",
                file=sys.stderr,
            )
            return None

    def rejoin(self, restarted: Sequence[int]) -> None:
        """The servers of `restarted` were started again: a `distributed` group (not broken) is formed anew with
        every server; nothing for the other transports."""
        transport = self.transport
        if restarted and isinstance(transport, DistributedTransport) and transport.broken is None:
            transport.reopen(restarted)

    def catch_up(
        self, indices: Sequence[int], version: int, policy: Callable[[], Mapping[str, torch.Tensor]] | None
    ) -> None:
        """Bring the restarted servers of `indices` to policy `version`, which the others serve: by disk from the
        kept export, else with `policy()` (the trainer's current tensors) by the configured transport (a
        `distributed` group formed anew, every server updated through it; disk once the group is broken); then the
        version check on each."""
        workers = [self.workers[i] for i in indices]
        deadline = time.monotonic() + self.cfg.weight_sync_timeout_s
        transport = self.transport
        if not self.disk.load(workers, version, deadline):
            if policy is None:
                raise WeightSyncError(
                    f"restarted servers {[w.url for w in workers]} cannot be given policy version {version}: no "
                    "export on disk and no source of the trainer's weights"
                )
            tensors = policy()
            check_manifest(tensors, self.manifest, str(self.hf_dir))
            if isinstance(transport, DistributedTransport) and transport.broken is None:
                transport.reopen(indices)
                transport.push(tensors, version, deadline)
                workers = self.workers
            elif isinstance(transport, TensorTransport):
                transport.push(tensors, version, deadline, workers)
            else:
                self.disk.push(tensors, version, deadline, workers)
        for w in workers:
            w.check_version(version, deadline=deadline)
        print(f"weight sync: restarted servers {[self.workers[i].url for i in indices]} serve policy version {version}")

    def close(self) -> None:
        if isinstance(self.transport, DistributedTransport):
            self.transport.close()
