"""Run megatron-core 0.19.2 on a CPU-only machine (gloo): the CUDA shims CI and the embedded default use, and the
process-group / parallel-state setup for one rank or a torchrun launch.

Megatron calls `torch.cuda.current_device()` and the CUDA RNG state functions in code paths that are otherwise
device-agnostic (rotary embedding, router gating, the RNG tracker forked by `DotProductAttention`). On a machine
without CUDA these shims route them to the CPU; they are never installed when CUDA is available.
"""

from __future__ import annotations

import os

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

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = lambda s, *a, **k: torch.set_rng_state(s)
    tp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    tp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    _INSTALLED = True


def init_megatron(tensor_parallel: int = 1, expert_parallel: int = 1, seed: int = 1234) -> None:
    """Initialise torch.distributed (gloo on CPU, nccl on GPU; torchrun's environment if present, else one rank)
    and Megatron's parallel state and model-parallel RNG. Idempotent."""
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
        parallel_state.initialize_model_parallel(tensor_parallel, 1, expert_model_parallel_size=expert_parallel)
    tp.model_parallel_cuda_manual_seed(seed)


def init_single_rank(seed: int = 1234) -> None:
    """`init_megatron` with TP = PP = EP = 1."""
    init_megatron(seed=seed)
