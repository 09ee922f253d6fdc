"""SGLang's real Qwen3-MoE model class on CPU with TRACE on (`tests/sglang_model_cpu.py`, in a child process:
SGLang reads its CPU engine mode, `SGLANG_USE_CPU_ENGINE=1`, when its modules are imported).

The child loads TRACE's plugin through SGLang's `load_plugins`, builds `Qwen3MoeForCausalLM` (sglang 0.5.15.post1),
loads a random checkpoint through its own `load_weights`, installs TRACE through the plugin's hook on
`ModelRunner.init_routed_experts_capturer`, runs one prefill through the `torch_native` attention
backend and the FP4 KV pool, and checks the stored records of the finished request against the reference
quantization of what every layer saw; then serves the same prefill with `--trace-sites none` (logits equal to the
capturing server's bit for bit, no record rows, nothing written). `sgl_kernel` is replaced by the import stand-in
of `tests/sglang_cpu.py` (placeholders that raise if called); none is called.
"""

import pytest


@pytest.fixture(scope="module")
def served():
    from tests.interpret import interpret

    return interpret("tests.sglang_model_cpu", timeout=600, SGLANG_USE_CPU_ENGINE="1")


@pytest.mark.slow
def test_the_real_qwen3_moe_model_prefill_stores_what_its_layers_saw(served):
    served.check("qwen3-moe-prefill")


@pytest.mark.slow
def test_the_real_model_served_without_capture_gives_the_capturing_servers_logits(served):
    served.check("qwen3-moe-no-capture")
