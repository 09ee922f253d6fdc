#!/usr/bin/env python3
"""Apply, regenerate and check TRACE's megatron-core patch stack (`patches/megatron/v<version>/`).

Same format, checks and commands as the SGLang stack (`scripts/sglang_patches.py`, whose machinery this runs):
unified diffs of one file each in the upstream layout (`megatron/core/...`), pristine files proven by the wheel's
`dist-info/RECORD` digests, applied exactly.

    python scripts/megatron_patches.py apply            # patch the installed megatron-core (idempotent)
    python scripts/megatron_patches.py check            # apply to the pristine wheel files, regenerate identically
    python scripts/megatron_patches.py export TREE      # write the patched files into an upstream-layout tree
    python scripts/megatron_patches.py regenerate TREE  # rewrite the patches from an edited tree

The stack makes Megatron's optimizers (the distributed optimizer included) accept CPU parameters: they allocate
their small tensors on `torch.cuda.current_device()` (which `megatron_trace.cpu`'s shims point at the CPU) rather
than on `'cuda'`, and sort parameters by dtype rather than by CUDA tensor type. On CUDA nothing changes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_patches import REPO, Stack, main

MEGATRON_VERSION = "0.19.2"
MEGATRON = Stack("megatron-core", MEGATRON_VERSION, REPO / "patches" / "megatron" / f"v{MEGATRON_VERSION}")

if __name__ == "__main__":
    sys.exit(main(stack=MEGATRON, doc=__doc__))
