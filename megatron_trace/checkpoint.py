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
rank reads the slices of the global tensors it holds (`load`). The masters and AdamW state come from either
optimizer the trainers use, and either restores the other's checkpoint:

- a plain `torch.optim.AdamW` over full FP32 masters of the rank's shards (the single-rank trainer);
- Megatron's `DistributedOptimizer` (or its `ChainedOptimizer` of dense and expert parameters), where each DP rank
  holds a contiguous range of every parameter's flattened master and moments: saving and loading go through one
  full-shape FP32 tensor per parameter and field, assembled over the parameter's DP group (the expert DP group for
  experts) and scattered back into the ranges after a load. That costs, for the duration of the call, the memory
  of the non-distributed optimizer's masters and moments.

Saving writes Megatron's integrity manifest (`integrity.json`, SHA-256 of every file); `verify` checks it.
"""

from __future__ import annotations

import logging
import queue
import re
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
    out: list[tuple[str, object, int, tuple | None]] = []
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


def adam_state(params: Sequence[torch.nn.Parameter], optimizer) -> tuple[list[torch.Tensor], dict, int]:
    """FP32 master and AdamW moments of each of `params`, full shape (zeros before the first step), and the Adam
    step, from a torch AdamW over one master per parameter or from Megatron's distributed optimizer (assembled over
    DP: collective). The AdamW's masters are its own tensors; the distributed optimizer's are new."""
    if isinstance(optimizer, torch.optim.Optimizer):
        master = optimizer.param_groups[0]["params"]
        if len(optimizer.param_groups) != 1 or len(master) != len(params):
            raise ValueError("the trainer's AdamW must hold one group with one master per parameter")
        states = [optimizer.state[m] for m in master]
        moments = {
            name: [st.get(name, torch.zeros_like(m)) for st, m in zip(states, master, strict=True)] for name in MOMENTS
        }
    else:
        shards = _dp_shards(optimizer)
        states = [inner.state.get(s, {}) for inner, _, _, s in shards.values()]
        master = _assemble(params, shards, lambda inner, s: s)
        moments = {
            name: _assemble(params, shards, lambda inner, s, name=name: inner.state.get(s, {}).get(name))
            for name in MOMENTS
        }
    steps = {int(st["step"]) for st in states if "step" in st}
    if len(steps) > 1:
        raise ValueError(f"AdamW state at different steps per parameter: {sorted(steps)}")
    return master, moments, steps.pop() if steps else 0


def _dp_shards(optimizer) -> dict[int, tuple]:
    """Megatron's distributed optimizer: for each model parameter (by id) of which this DP rank holds a range, the
    inner torch optimizer, the range `[start, end)` in the flattened parameter and the FP32 master of that range."""
    out = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not hasattr(opt, "shard_fp32_from_float16_groups"):
            raise TypeError(f"{type(opt).__name__}: checkpoints hold a torch AdamW or Megatron's DistributedOptimizer")
        groups = [
            *zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups, strict=True),
            *zip(opt.model_fp32_groups, opt.shard_fp32_groups, strict=True),
        ]
        for models, mains in groups:
            for p, main in zip(models, mains, strict=True):
                r = opt._get_model_param_range_map(p)["param"]
                out[id(p)] = (opt.optimizer, r.start, r.end, main)
    return out


def _dp_group(p: torch.nn.Parameter):
    """The group the distributed optimizer shards `p` over: expert DP for experts, DP (with CP) for the rest."""
    from megatron.core import parallel_state as ps

    if getattr(p, "allreduce", True):
        return ps.get_data_parallel_group(with_context_parallel=True)
    return ps.get_expert_data_parallel_group()


def _assemble(params: Sequence[torch.nn.Parameter], shards: dict, pick) -> list[torch.Tensor]:
    """Full FP32 tensors from every DP rank's ranges (`pick(inner optimizer, master range)`; None: zeros), summed
    over the parameter's DP group, whose ranks hold disjoint ranges that cover the parameter."""
    out = []
    for p in params:
        full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if id(p) in shards:
            inner, lo, hi, main = shards[id(p)]
            part = pick(inner, main)
            if part is not None:
                full[lo:hi] = part
        torch.distributed.all_reduce(full, group=_dp_group(p))
        out.append(full.view(p.shape))
    return out


def save(
    path: str | Path,
    chunks: Sequence[torch.nn.Module],
    params: Sequence[torch.nn.Parameter],
    optimizer,
    *,
    version: int,
    layout: str,
) -> None:
    """Save this rank's part of the trainer (collective: every rank calls it with the same `path`, a directory that
    every rank sees and that does not exist yet or is empty). `optimizer` is a torch AdamW whose i-th parameter is
    the FP32 master of `params[i]`, or Megatron's distributed optimizer over `chunks`."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    master, moments, step = adam_state(params, optimizer)
    state, _ = _sharded(chunks, params, master, moments)
    state["trainer"] = {"adam_step": step, "version": version, "layout": layout}
    Path(path).mkdir(parents=True, exist_ok=True)
    _in_process_results_queue()
    errors = _WriterErrors()
    writer_log = logging.getLogger(_WRITER_LOGGER)
    writer_log.addHandler(errors)
    try:
        dist_checkpointing.save(state, str(path), verify_integrity=True)
    except (Exception, CheckpointException) as e:
        found = errors.os_error()
        if found is None:
            raise
        code, reason = found  # Megatron's writer logs it and raises only "Worker failure ... <class 'OSError'>"
        raise OSError(code, f"{reason} (writing the trainer checkpoint)", str(path)) from e
    finally:
        writer_log.removeHandler(errors)


_WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_OS_ERROR = re.compile(r"\[Errno (\d+)\] ([^:'\n]+)")


class _WriterErrors(logging.Handler):
    """The errors Megatron's checkpoint writer logs: it reports a failed write (ENOSPC, EFBIG, ...) only there."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def os_error(self) -> tuple[int, str] | None:
        """(errno, reason) of the first OS error logged, if any."""
        for message in self.messages:
            m = _OS_ERROR.search(message)
            if m:
                return int(m.group(1)), m.group(2).strip()
        return None


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
    optimizer,
    *,
    lr: float | None = None,
) -> dict:
    """Load a checkpoint of `save` (any layout, either optimizer) into this rank's shards: parameters, masters and
    AdamW state (collective). `lr` replaces the saved learning rate. Every tensor must be in the checkpoint with the
    model's global shape (otherwise a ValueError naming the key). Returns the common part (`adam_step`, `version`,
    `layout`)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    local = isinstance(optimizer, torch.optim.Optimizer)
    if local:
        master = optimizer.param_groups[0]["params"]
        if len(optimizer.param_groups) != 1 or len(master) != len(params):
            raise ValueError("the trainer's AdamW must hold one group with one master per parameter")
    else:
        master = [torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in params]
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
    step = common["adam_step"]
    # (inner torch optimizer, its master tensor, parameter index, range [lo, hi) of the flattened parameter or None)
    slots: list[tuple[torch.optim.Optimizer, torch.Tensor, int, tuple[int, int] | None]]
    if local:
        optimizer.state.clear()
        slots = [(optimizer, m, i, None) for i, m in enumerate(master)]
    else:
        shards = _dp_shards(optimizer)
        index = {id(p): i for i, p in enumerate(params)}
        ranges = [(inner, main, index[k], lo, hi) for k, (inner, lo, hi, main) in shards.items()]
        with torch.no_grad():
            for inner, main, i, lo, hi in ranges:
                main.copy_(master[i].view(-1)[lo:hi])
                inner.state.pop(main, None)
        slots = [(inner, main, i, (lo, hi)) for inner, main, i, lo, hi in ranges]
    for inner, main, i, span in slots:
        if step:
            mine = {n: moments[n][i] for n in MOMENTS}
            if span is not None:
                lo, hi = span
                mine = {n: t.view(-1)[lo:hi].clone() for n, t in mine.items()}
            inner.state[main] = {"step": torch.tensor(float(step))} | mine
    if lr is not None:
        inners = [optimizer] if local else [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
        for group in (g for inner in inners for g in inner.param_groups):
            group["lr"] = lr
    return common


def verify(path: str | Path) -> None:
    """Check every file of a saved checkpoint against its SHA-256 in Megatron's `integrity.json` (raises
    `CheckpointingException` naming the files that differ or are missing)."""
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    verify_integrity_manifest(str(path))
