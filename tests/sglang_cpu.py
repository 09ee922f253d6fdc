"""What the CPU tests of the SGLang side share: TRACE's SGLang plugin loaded as a server process loads it
(`load_trace_plugin`), SGLang's parallel groups on gloo (`init_cpu_parallel_state`), trace-mode `ServerArgs` and a
small `TraceCapturer`, and an import stand-in for SGLang's compiled kernel package (`sgl_kernel`) on machines
without it.

Some CPU-runnable SGLang code imports modules that import `sgl_kernel` at module level without calling it on the
paths tested here (e.g. `MHATokenToKVPoolFP4.set_kv_buffer` imports `cuda_graph_runner` for `get_is_capture_mode`).
The stand-in satisfies those imports only: every attribute is a placeholder that raises if it is called, so a
tested path that reaches a compiled kernel fails loudly instead of running a fake. Installed only when the real
package is not importable. SGLang itself is imported directly: a broken SGLang import fails the tests.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types


class KernelUnavailable(RuntimeError):
    """A compiled sgl_kernel function was called through the CPU import stand-in."""


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise KernelUnavailable(f"{self._name} was called, but sgl_kernel is an import stand-in on this machine")


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def install_sgl_kernel_stand_in() -> bool:
    """Install the stand-in unless the real sgl_kernel imports; True when the stand-in is in use."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return True
    try:
        import sgl_kernel  # noqa: F401

        return False
    except ImportError:
        sys.modules.pop("sgl_kernel", None)
    sys.meta_path.insert(0, _Finder())
    return True


def import_sglang_as_a_server() -> None:
    """SGLang's modules in the order a server imports them: the `sgl_kernel` stand-in where the real package is
    absent, then SGLang's communicator, and with it `flashinfer_comm_fusion`, before any MoE or runner module. That
    module tries `flashinfer.comm` and logs a fallback when it fails (flashinfer 0.6.12 needs `cuda.tile` there),
    which leaves `flashinfer.comm.mnnvl` imported for the token dispatchers; imported the other way round (a KV
    pool's `set_kv_buffer` on CUDA imports the runner, and with it the dispatchers), the import fails."""
    install_sgl_kernel_stand_in()
    import sglang.srt.layers.communicator  # noqa: F401


def load_trace_plugin() -> None:
    """TRACE's SGLang plugin in this process as a server process has it: SGLang imported as a server does
    (`import_sglang_as_a_server`), then SGLang's own `load_plugins` (the `sglang.srt.plugins` entry point `trace`
    registers the hooks, SGLang applies them) and `plugin.check_applied` (SGLang only logs a hook that failed to
    apply). Idempotent; call it before building layers (the FusedMoE weight loader is bound into the parameters
    then)."""
    import_sglang_as_a_server()
    # The FusedMoE module first: resolving a hook's target while its package is mid-import fails (SGLang only logs it).
    import sglang.srt.layers.moe.fused_moe_triton.layer  # noqa: F401
    from sglang.srt.plugins import load_plugins

    from sglang_trace.plugin import check_applied

    load_plugins()
    check_applied()


def init_cpu_parallel_state(world_size: int = 1, rank: int = 0, port: int | None = None) -> None:
    """SGLang's TP/PP/EP groups on CPU (gloo), so layers such as FusedMoE can be built; idempotent. With
    `world_size` > 1 every rank calls this with the same free `port`. SGLang would add a PyNccl communicator to
    every multi-rank group; there is no NCCL on CPU, so the groups are built without it (collectives then go
    through torch.distributed on the gloo groups, SGLang's own fallback)."""
    import socket

    from sglang.srt.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    build = ps.init_model_parallel_group
    ps.init_model_parallel_group = lambda *args, **kwargs: build(*args, **{**kwargs, "use_pynccl": False})
    try:
        ps.init_distributed_environment(
            world_size=world_size,
            rank=rank,
            local_rank=rank,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )
        ps.initialize_model_parallel(world_size)
    finally:
        ps.init_model_parallel_group = build


def trace_server_args(store: str, **overrides):
    """SGLang's `ServerArgs` of a CPU test with TRACE emulate on: the one setup block the SGLang tests share
    (`overrides` replace or add fields: sites, layers, recipe, KV dtype, R3)."""
    from sglang.srt.server_args import ServerArgs

    load_trace_plugin()  # trace mode on: the server arguments refuse to validate without the plugin's hooks
    base = dict(model_path="dummy", device="cpu", trace_mode="emulate", trace_store=store)
    return ServerArgs(**(base | overrides))


def cpu_capturer(server_args, layout, **overrides):
    """A `TraceCapturer` on CPU for `server_args` (checked) and `layout`, with small staging and store sizes;
    `overrides` replace `TraceCapturer`'s arguments (KV pool, sizes, R3, TP rank and group, weights)."""
    from sglang_trace.capturer import TraceCapturer
    from sglang_trace.config import check_server_args
    from sglang_trace.moe import ExpertWeights

    kwargs = dict(
        kv_pool=None,
        max_tokens=16,
        num_slots=32,
        max_request_tokens=16,
        device="cpu",
        return_routes=False,
        weights=ExpertWeights(),
    )
    return TraceCapturer(check_server_args(server_args), layout, **(kwargs | overrides))
