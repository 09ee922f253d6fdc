"""Which sglang 0.5.15.post1 modules import without the compiled kernel package (`sgl_kernel`), and where each
failing one first needs it. Run in an environment without sgl_kernel (no stand-in installed):

    python bench/sglang_imports.py > docs/measurements/sglang_cpu_imports.txt
"""

from __future__ import annotations

import importlib
import traceback

MODULES = (
    "sglang.srt.server_args",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.state_capturer.routed_experts",
    "sglang.srt.layers.moe.topk",
    "sglang.srt.layers.moe.fused_moe_triton.layer",
    "sglang.srt.layers.moe.moe_runner.triton",
    "sglang.srt.layers.moe.fused_moe_native",
    "sglang.srt.layers.attention.torch_native_backend",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.model_executor.forward_batch_info",
    "sglang.srt.model_executor.pool_configurator",
    "sglang.srt.plugins",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.model_executor.model_runner_kv_cache_mixin",
    "sglang.srt.models.qwen3_moe",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.scheduler_components.batch_result_processor",
    "sglang.srt.managers.scheduler_components.output_streamer",
    "sglang.srt.managers.scheduler_components.weight_updater",
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe",
)


def main() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
            print(f"OK   {name}")
        except Exception as e:
            frames = [f for f in traceback.extract_tb(e.__traceback__) if "sglang" in f.filename]
            where = f"{frames[-1].filename.split('sglang/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
            print(f"FAIL {name}: {type(e).__name__}: {e} (first at sglang/{where})")


if __name__ == "__main__":
    main()
