"""The policy's tensors as SGLang's weight-update requests carry them (`trace_rl.weight_sync`'s transports): cut
into buckets in the export's order, checked against the names and shapes of the checkpoint the servers serve, and
serialized for `/update_weights_from_tensor` as SGLang's `MultiprocessingSerializer` does (CUDA tensors as CUDA IPC
handles, CPU tensors as shared-memory files)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch

MIB = 2**20


class WeightSyncError(RuntimeError):
    """A weight sync could not be done; the message names the servers and what they answered."""


# ----------------------------------------------------------------- buckets
def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as SGLang's receivers read it (`getattr(torch, name)`): "bfloat16", "float32", ..."""
    return str(dtype).removeprefix("torch.")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class Bucket:
    """One update request's tensors: names in sending order, their dtypes (SGLang's spelling) and shapes."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    nbytes: int

    def metadata(self) -> dict:
        """The `names` / `dtypes` / `shapes` fields of `/update_weights_from_distributed`."""
        return {"names": list(self.names), "dtypes": list(self.dtypes), "shapes": [list(s) for s in self.shapes]}


def plan_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[Bucket]:
    """`tensors` in their order (the export's, deterministic) cut into consecutive buckets of at most `bucket_bytes`
    each; a tensor larger than that is a bucket of its own. Every tensor is in exactly one bucket."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    groups: list[list[str]] = []
    size = 0
    for name, t in tensors.items():
        n = nbytes(t)
        if not groups or size + n > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return [
        Bucket(
            tuple(g),
            tuple(dtype_name(tensors[n].dtype) for n in g),
            tuple(tuple(tensors[n].shape) for n in g),
            sum(nbytes(tensors[n]) for n in g),
        )
        for g in groups
    ]


def iter_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> Iterator[tuple[Bucket, list[torch.Tensor]]]:
    """Each bucket of `plan_buckets` with its tensors (contiguous), in order."""
    for bucket in plan_buckets(tensors, bucket_bytes):
        yield bucket, [tensors[n].contiguous() for n in bucket.names]


def checkpoint_manifest(hf_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the HF checkpoint in `hf_dir` (its safetensors headers only)."""
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise WeightSyncError(f"{hf_dir} holds no *.safetensors: cannot check the trainer's weights against it")
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


def check_manifest(tensors: Mapping[str, torch.Tensor], manifest: Mapping[str, tuple[int, ...]], where: str) -> None:
    """WeightSyncError unless `tensors` has exactly the names of `manifest`, each of its shape."""
    missing = [n for n in manifest if n not in tensors]
    extra = [n for n in tensors if n not in manifest]
    shapes = [
        f"{n} {tuple(t.shape)}, checkpoint {manifest[n]}"
        for n, t in tensors.items()
        if n in manifest and tuple(t.shape) != manifest[n]
    ]
    if missing or extra or shapes:
        parts = [
            f"{len(missing)} of the checkpoint's tensors not sent (first {missing[:3]})" if missing else "",
            f"{len(extra)} not in the checkpoint (first {extra[:3]})" if extra else "",
            f"{len(shapes)} of another shape (first {shapes[:3]})" if shapes else "",
        ]
        raise WeightSyncError(
            f"the trainer's weights do not match the checkpoint the servers serve ({where}): "
            + "; ".join(p for p in parts if p)
            + ". SGLang's load_weights skips a name its model lacks, so the servers would keep old values under the "
            "new weight_version"
        )


# ----------------------------------------------------------------- the tensor payload
@contextmanager
def _file_system_sharing() -> Iterator[None]:
    """CPU tensors pickled inside are shared as named shared-memory files, which any local process can open (the
    default file-descriptor strategy hands descriptors over a socket that only this process's children may use)."""
    old = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(old)


def stage(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What the payload shares: CUDA tensors as they are (IPC handles of their memory), CPU tensors copied into fresh
    shared memory (sharing a trainer tensor would move its storage into shared memory)."""
    out = []
    with _file_system_sharing():
        for t in tensors:
            if t.is_cuda:
                out.append(t)
            else:
                copy = torch.empty(t.shape, dtype=t.dtype).share_memory_()
                out.append(copy.copy_(t))
    return out


def _reduce_tensor(t: torch.Tensor):
    """torch's tensor reduction for sharing: a CUDA tensor through SGLang's `monkey_patch_torch_reductions` (its
    device as a UUID, which the server maps to its own index under its CUDA_VISIBLE_DEVICES), a CPU tensor through
    torch's own (SGLang's patched one assumes a CUDA tensor's arguments)."""
    from torch.multiprocessing import reductions

    if t.is_cuda:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        return reductions.reduce_tensor(t)
    return getattr(reductions, "_reduce_tensor_original", reductions.reduce_tensor)(t)


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """`named` in the form of SGLang's `MultiprocessingSerializer.serialize(named, output_str=True)`: torch's
    `ForkingPickler` (tensors as CUDA IPC handles or shared-memory files, `_reduce_tensor`), base64."""
    pickler_buf = io.BytesIO()
    pickler = ForkingPickler(pickler_buf)
    pickler.dispatch_table[torch.Tensor] = pickler.dispatch_table[torch.nn.Parameter] = _reduce_tensor
    with _file_system_sharing():
        pickler.dump(list(named))
    return base64.b64encode(pickler_buf.getvalue()).decode()


def tensor_payload(named: Sequence[tuple[str, torch.Tensor]], tp_size: int, version: int, *, flush_cache: bool) -> dict:
    """The JSON body of `/update_weights_from_tensor` for one bucket: one serialization per TP rank (as SGLang's
    `Engine.update_weights_from_tensor`), the default load format, the policy version, the flush on the last one."""
    return {
        "serialized_named_tensors": [serialize_named_tensors(named) for _ in range(tp_size)],
        "flush_cache": flush_cache,
        "weight_version": str(version),
    }
