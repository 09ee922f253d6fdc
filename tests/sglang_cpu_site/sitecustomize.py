"""Imported at start-up by every Python process of a CPU SGLang server (`tests/sglang_cpu_server.py` puts this folder
first on PYTHONPATH, so the scheduler and detokenizer processes SGLang spawns get it too). It makes the pinned
SGLang 0.5.15.post1 serve on a CPU without its GPU stack, changing nothing that computes:

- import stand-ins for the compiled `sgl_kernel` package (`tests.sglang_cpu.install_sgl_kernel_stand_in`: every
  attribute raises if called) and for `soundfile` and `python_multipart`, which SGLang's audio and form routes
  import at module level (neither route is used);
- SGLang refuses an FP4 (E2M1) KV cache off CUDA (`ServerArgs._handle_kv4_compatibility`) and tells the FP4 KV
  dtype apart only on CUDA (`sglang.srt.utils.common.is_float4_e2m1fn_x2`); both are lifted, so the server builds
  its `MHATokenToKVPoolFP4` as on a GPU (the pool's torch code runs on CPU: tests/sglang/test_sglang_model.py);
- SGLang's routed-experts capturer (R3 routes returned with `--enable-return-routed-experts`) allocates its host
  buffer with `pin_memory=True`, which needs a CUDA driver: on CPU it is allocated unpinned.
"""

import importlib.machinery
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # the checkout, for tests.sglang_cpu

from tests.sglang_cpu import _StandInModule, install_sgl_kernel_stand_in

install_sgl_kernel_stand_in()
for _name in ("soundfile", "python_multipart"):
    try:
        __import__(_name)
    except ImportError:
        _module = _StandInModule(_name)
        _module.__spec__ = importlib.machinery.ModuleSpec(_name, None)
        _module.__version__ = "0.0.20"  # FastAPI checks python_multipart's version when it builds a form route
        sys.modules[_name] = _module

import sglang.srt.server_args as _server_args  # noqa: E402
import sglang.srt.utils as _utils  # noqa: E402
import sglang.srt.utils.common as _common  # noqa: E402
import torch  # noqa: E402


def _is_fp4(dtype) -> bool:
    return dtype == getattr(torch, "float4_e2m1fn_x2", None)


_server_args.ServerArgs._handle_kv4_compatibility = lambda self: None
_common.is_float4_e2m1fn_x2 = _utils.is_float4_e2m1fn_x2 = _is_fp4


class _Unpinned:
    """`torch` for `sglang.srt.state_capturer.base`, whose host buffer asks for pinned memory."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, pin_memory=False, **kwargs):
        return torch.zeros(*args, **kwargs)


import sglang.srt.state_capturer.base as _capturer_base  # noqa: E402

_capturer_base.torch = _Unpinned()
