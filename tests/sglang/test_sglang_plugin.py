"""TRACE as an SGLang 0.5.15 general plugin: the entry point is installed, SGLang's own `load_plugins` applies every
hook, and a server whose plugin is filtered out (or not installed) is refused by name instead of running untraced."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
import types

import pytest

from tests.sglang_cpu import install_sgl_kernel_stand_in

install_sgl_kernel_stand_in()

from sglang.srt.plugins import load_plugins  # noqa: E402

from sglang_trace import plugin  # noqa: E402


def test_the_entry_point_is_installed() -> None:
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert [e.value for e in eps if e.name == "trace"] == ["sglang_trace.plugin:register"]


def test_sglang_load_plugins_applies_every_trace_hook() -> None:
    load_plugins()
    plugin.check_applied()  # raises naming any hook not in place
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    assert plugin._wraps(FusedMoE.run_moe_core, plugin._moe_input)


def test_a_head_size_on_the_fallback_rope_writes_its_kv_in_the_attention_call() -> None:
    """On CUDA, SGLang's RoPE takes its fallback kernel for head sizes other than 64 / 128 / 256 / 512, which cannot
    also write the KV cache; the hook on `Qwen3MoeAttention.__init__` leaves that write to the attention call."""
    load_plugins()
    from sglang.srt.models.qwen3_moe import Qwen3MoeAttention

    assert plugin._wraps(Qwen3MoeAttention.__init__, plugin._qwen3_moe_attention)
    for fallback in (True, False):
        rope = types.SimpleNamespace(use_fallback_kernel=fallback)  # RotaryEmbedding's flag: True for head size 16
        attn = types.SimpleNamespace(rotary_emb=rope, compatible_with_fused_kv_buffer=True)
        plugin._qwen3_moe_attention(None, attn)
        assert attn.compatible_with_fused_kv_buffer is not fallback


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    prelude = "from tests.sglang_cpu import install_sgl_kernel_stand_in; install_sgl_kernel_stand_in()\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.slow
def test_trace_on_without_the_plugin_is_refused_by_name() -> None:
    """SGLANG_PLUGINS without `trace`: SGLang skips the plugin (it only logs that); TRACE's server arguments refuse."""
    import os

    code = """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import prepare_server_args
        prepare_server_args(["--model-path", "dummy", "--trace-mode", "emulate", "--trace-store", "/tmp/s",
                             "--trace-sites", "moe_in"])
    """
    env = {**os.environ, "SGLANG_PLUGINS": "some-other-plugin"}
    done = _run(code, env)
    assert done.returncode != 0
    assert "TRACE's SGLang plugin hooks are not registered" in done.stderr, done.stderr[-2000:]
    env["SGLANG_PLUGINS"] = "trace"  # the same start with the plugin allowed goes through
    assert _run(code, env).returncode == 0
