"""Run megatron-core 0.19.2 on a CPU-only machine (gloo): the CUDA shims CI and the embedded default use, and the
process-group / parallel-state setup for one rank or a torchrun launch.

Megatron calls `torch.cuda.current_device()` and the CUDA RNG state functions in code paths that are otherwise
device-agnostic (rotary embedding, router gating, the RNG tracker forked by `DotProductAttention`), the alltoall
dispatcher copies its split sizes to the host on a CUDA side stream, and the pipeline schedules create their token
counter with `device="cuda"`, p2p calls `torch.cuda.synchronize()` after batched send / receive and DDP orders its
gradient reduction on `torch.cuda.current_stream()`. On a machine without CUDA these shims route them to the CPU
(the split sizes become numpy arrays, as the CUDA path makes them; streams have nothing to wait for); they are never
installed when CUDA is available. Megatron's optimizers need more than a shim (they sort parameters by CUDA tensor
type and allocate on 'cuda'): `patches/megatron` makes them allocate on `torch.cuda.current_device()`, which these
shims point at the CPU, and sort by dtype (`megatron_trace.parallel.make_optimizer` names the patch when it is
missing).
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

_INSTALLED = False


def install_cpu_shims() -> None:
    """Point Megatron's CUDA device / RNG calls at the CPU. Raises RuntimeError if CUDA is available."""
    global _INSTALLED
    if torch.cuda.is_available():
        raise RuntimeError("install_cpu_shims is for CPU-only machines; CUDA is available here")
    if _INSTALLED:
        return
    from megatron.core.tensor_parallel import random as tp_random

    # current_device and current_stream answer outside torch's annotations (a device name, a stream stand-in): they
    # are set through an untyped handle of torch.cuda, since these shims replace its typed functions on purpose
    cuda: Any = torch.cuda
    cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    tp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu"  # never a stream on CPU: skips torch.cuda.Stream()
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_split_sizes
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _TorchCudaOnCpu("torch")
    torch.cuda.synchronize = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: _NoStream()
    _INSTALLED = True


class _NoStream:
    """The CPU's stand-in for a CUDA stream: nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


class _TorchCudaOnCpu(types.ModuleType):
    """`torch` as Megatron's schedules see it on a CPU machine: `zeros(..., device="cuda")` is made on the CPU."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def _host_split_sizes(self, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
    """CPU twin of `MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`: the split sizes as numpy arrays."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def init_megatron(
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_pipeline: int | None = None,
    seed: int = 1234,
) -> None:
    """Initialise torch.distributed (gloo on CPU, nccl on GPU; torchrun's environment if present, else one rank)
    and Megatron's parallel state (data parallel = world / (TP * PP); EP is carved out of DP * TP) and
    model-parallel RNG. Idempotent."""
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as tp

    if not torch.cuda.is_available():
        install_cpu_shims()
    if not torch.distributed.is_initialized():
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, rank=rank, world_size=world)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_parallel,
            pipeline_parallel,
            virtual_pipeline_model_parallel_size=virtual_pipeline,
            expert_model_parallel_size=expert_parallel,
            expert_tensor_parallel_size=1,  # experts are never TP-split (per-matrix FP4 weight scales)
        )
    tp.model_parallel_cuda_manual_seed(seed)


def init_single_rank(seed: int = 1234) -> None:
    """`init_megatron` with TP = PP = EP = 1."""
    init_megatron(seed=seed)
