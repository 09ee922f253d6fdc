"""Trainer checkpoints through Megatron's distributed checkpointing (`megatron.core.dist_checkpointing`), readable
at any parallel layout.

What is saved is one sharded state dict per rank, every tensor under its global key with its global shape and this
rank's offsets (Megatron's `sharded_state_dict()` of each model chunk: TP splits, EP expert offsets, PP layer
offsets, replicas saved once):

- `model`: the model chunks' parameters (BF16 or the trainer's dtype), Megatron's own keys;
- `optimizer.master.*`: the FP32 master weights, sharded like the parameter they belong to
  (`make_sharded_optimizer_tensor`, as Megatron's optimizers do);
- `optimizer.state.exp_avg.*`, `optimizer.state.exp_avg_sq.*`: AdamW's moments, likewise;
- common (rank 0): `adam_step`, the policy `version`, and the layout it was saved at (for messages only).

A checkpoint saved at one layout (TP, EP, PP, virtual PP, DP) loads at any other that splits the same model: each
rank reads the slices of the global tensors it holds (`load`). The trainer's masters and AdamW state live in a
plain `torch.optim.AdamW` over the rank's shards; Megatron's `DistributedOptimizer` is not used here.
Saving writes Megatron's integrity manifest (`integrity.json`, SHA-256 of every file); `verify` checks it.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_trace.parallel import unwrap

MOMENTS = ("exp_avg", "exp_avg_sq")


def _entries(
    model: dict, params: Sequence[torch.nn.Parameter]
) -> tuple[list[tuple[str, object, int, tuple | None]], list[int]]:
    """Each sharded entry of the model's state dict that holds (part of) a parameter: `(key, entry, index of the
    parameter, view)`, `view` = `(size, stride, offset)` of the part within the parameter when the entry holds a
    view of it (the grouped experts' `weight[e]`), None when it is the parameter; and the elements of each parameter
    the entries cover (the caller requires all of them, once)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    index = {id(p): i for i, p in enumerate(params)}
    spans = sorted(
        (p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size(), i) for i, p in enumerate(params)
    )
    covered = [0] * len(params)
    out = []
    for n, e in enumerate(nested_values(extract_sharded_tensors_and_factories(model)[0])):
        t = e.data
        if id(t) in index:
            i = index[id(t)]
            out.append((str(i), e, i, None))
            covered[i] += t.numel()
            continue
        start = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        owner = [i for s, i in spans if s <= start < s + params[i].numel() * params[i].element_size()]
        if not owner:
            continue  # not a parameter (none in these models; buffers are not trained)
        i = owner[-1]
        p = params[i]
        if not p.is_contiguous():
            raise ValueError(f"parameter {i} {tuple(p.shape)} is not contiguous: its sharded views cannot be mapped")
        out.append((f"{i}.{n}", e, i, (tuple(t.shape), t.stride(), t.storage_offset() - p.storage_offset())))
        covered[i] += t.numel()
    return out, covered


def _sharded(
    chunks: Sequence[torch.nn.Module], params: Sequence[torch.nn.Parameter], master: Sequence[torch.Tensor], moments
) -> tuple[dict, list]:
    """The sharded state dict: the chunks' own, plus masters and `moments[name][i]` sharded like `params[i]` (the
    same views of them where the model's entries are views). Also returns the targets `(key, tensor)` of each."""
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    # `_extra_state` (TE's FP8 metadata; None for Megatron's local linears, absent in the grouped experts) is left out,
    # so checkpoints of SequentialMLP and the grouped experts interchange.
    model = {
        f"chunk{i}": {k: v for k, v in unwrap(c).sharded_state_dict().items() if not k.endswith("_extra_state")}
        for i, c in enumerate(chunks)
    }
    entries, covered = _entries(model, params)
    names = {id(p): n for c in chunks for n, p in unwrap(c).named_parameters()}
    bad = [names.get(id(p), "?") for i, p in enumerate(params) if covered[i] != p.numel()]
    if bad:
        raise ValueError(f"parameters not covered exactly once by the sharded state (cannot be checkpointed): {bad}")
    state: dict = {"model": model} | {name: {} for name in ("master", *MOMENTS)}
    targets = []
    for name, tensors in (("master", master), *((m, moments[m]) for m in MOMENTS)):
        prefix = "optimizer.master" if name == "master" else f"optimizer.state.{name}"
        for key, e, i, view in entries:
            t = (
                tensors[i]
                if view is None
                else tensors[i].as_strided(view[0], view[1], tensors[i].storage_offset() + view[2])
            )
            state[name][key] = make_sharded_optimizer_tensor(e, t, prefix)
            targets.append((name, key, t))
    return state, targets


def save(
    path: str | Path,
    chunks: Sequence[torch.nn.Module],
    params: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.AdamW,
    *,
    version: int,
    layout: str,
) -> None:
    """Save this rank's part of the trainer (collective: every rank calls it with the same `path`, a directory that
    every rank sees and that does not exist yet or is empty). `params[i]` is the model parameter whose FP32 master is
    `optimizer`'s i-th parameter."""
    from megatron.core import dist_checkpointing

    master = optimizer.param_groups[0]["params"]
    if len(optimizer.param_groups) != 1 or len(master) != len(params):
        raise ValueError("the trainer's AdamW must hold one group with one master per parameter")
    steps = {int(optimizer.state[m]["step"]) for m in master if "step" in optimizer.state[m]}
    if len(steps) > 1:
        raise ValueError(f"AdamW state at different steps per parameter: {sorted(steps)}")
    moments = {
        name: [optimizer.state[m][name] if name in optimizer.state[m] else torch.zeros_like(m) for m in master]
        for name in MOMENTS
    }
    state, _ = _sharded(chunks, params, master, moments)
    state["trainer"] = {"adam_step": steps.pop() if steps else 0, "version": version, "layout": layout}
    Path(path).mkdir(parents=True, exist_ok=True)
    _in_process_results_queue()
    dist_checkpointing.save(state, str(path), verify_integrity=True)


def _in_process_results_queue() -> None:
    """A synchronous save writes from threads of this process, but Megatron's writer reports through a queue of a
    spawned `multiprocessing.Manager` server (made for its asynchronous save), a process that outlives a killed
    trainer and keeps its stdout / stderr open. An in-process queue serves the same calls (`put`, `get_nowait`)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load(
    path: str | Path,
    chunks: Sequence[torch.nn.Module],
    params: Sequence[torch.nn.Parameter],
    optimizer: torch.optim.AdamW,
    *,
    lr: float | None = None,
) -> dict:
    """Load a checkpoint of `save` (any layout) into this rank's shards: parameters, masters and AdamW state
    (collective). `lr` replaces the saved learning rate. Every tensor must be in the checkpoint with the model's
    global shape (otherwise a ValueError naming the key). Returns the common part (`adam_step`, `version`, `layout`)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    master = optimizer.param_groups[0]["params"]
    moments = {name: [torch.empty_like(m) for m in master] for name in MOMENTS}
    state, targets = _sharded(chunks, params, master, moments)
    try:
        loaded = dist_checkpointing.load(state, str(path), strict=StrictHandling.RAISE_ALL)
    except (CheckpointingException, CheckpointException) as e:
        raise ValueError(f"checkpoint {path} does not fit this model at this layout: {e}") from e
    common = loaded["trainer"]
    with torch.no_grad():
        for i, c in enumerate(chunks):
            tensors = {k: v for k, v in loaded["model"][f"chunk{i}"].items() if torch.is_tensor(v)}
            missing, unexpected = unwrap(c).load_state_dict(tensors, strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise ValueError(f"checkpoint {path}: missing {missing}, unexpected {unexpected}")
        for name, key, t in targets:
            t.copy_(loaded[name][key])
    optimizer.state.clear()
    if common["adam_step"]:
        for i, m in enumerate(master):
            optimizer.state[m] = {"step": torch.tensor(float(common["adam_step"]))} | {
                name: moments[name][i] for name in MOMENTS
            }
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    return common


def verify(path: str | Path) -> None:
    """Check every file of a saved checkpoint against its SHA-256 in Megatron's `integrity.json` (raises
    `CheckpointingException` naming the files that differ or are missing)."""
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    verify_integrity_manifest(str(path))
