"""TRACE server arguments in the real, patched `sglang.srt.server_args` (sglang 0.5.15.post1 with
`patches/sglang/v0.5.15.post1` applied, as `make setup` does), and the record spec they select on real model configs.

`ServerArgs(model_path="dummy")` runs the patched `__post_init__` up to SGLang's dummy-model short-circuit, which is
after the first TRACE check, so validation runs without a model or a GPU. With `--trace-mode` on, the check also
needs TRACE's plugin hooks registered (`tests.sglang_cpu.load_trace_plugin`, as SGLang's `load_plugins` does in a
server's main process).
"""

import argparse
import dataclasses
import subprocess
import sys
import textwrap

import pytest

from tests.sglang_cpu import load_trace_plugin, trace_server_args

load_trace_plugin()

from sglang.srt.configs.qwen3_next import Qwen3NextConfig  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from transformers import Qwen2MoeConfig, Qwen3MoeConfig  # noqa: E402

from sglang_trace.config import SERVER_ARGS_FIELDS, TraceArgs, check_server_args, model_layout, model_spec  # noqa: E402


def make(**kw):
    return trace_server_args("/records", **({"kv_cache_dtype": "fp4_e2m1"} | kw))


def trace_args(**kw) -> TraceArgs:
    """The checked TRACE settings of `make(**kw)`."""
    return check_server_args(make(**kw))


def qwen3_moe(layers=8, **kw):
    return Qwen3MoeConfig(
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        architectures=["Qwen3MoeForCausalLM"],
        **kw,
    )


def test_patched_server_args_have_trace_fields_with_our_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    assert {k: fields[k] for k in SERVER_ARGS_FIELDS} == SERVER_ARGS_FIELDS
    assert ServerArgs(model_path="dummy").trace_mode == "off"


def test_cli_flags_parse_into_server_args():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", "dummy", "--kv-cache-dtype", "fp4_e2m1", "--trace-mode", "emulate"]
    argv += ["--trace-record-bits", "2", "--trace-layers", "4-7", "--trace-store", "/r", "--trace-step", "3"]
    sa = ServerArgs.from_cli_args(parser.parse_args(argv))
    assert (sa.trace_mode, sa.trace_record_bits, sa.trace_layers, sa.trace_store, sa.trace_step) == (
        "emulate",
        2,
        "4-7",
        "/r",
        3,
    )
    args = check_server_args(sa)
    assert args == TraceArgs("emulate", 2, (4, 5, 6, 7), ("moe_in", "k", "v"), "/r", 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "dummy", "--trace-mode", "fp4"])  # argparse choices


def test_a_recording_server_sleeps_on_idle_so_the_writer_thread_gets_the_gil():
    """The patched ServerArgs checks its final settings at the end of __post_init__, which sets it."""
    assert make().sleep_on_idle
    assert not make(trace_sites="none").sleep_on_idle


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(trace_record_bits=5), "--trace-record-bits"),
        (dict(trace_recipe="fp3-w3"), "--trace-recipe"),
        (dict(trace_record_bits=0), "--trace-record-bits"),
        (dict(trace_layers="a-b"), "--trace-layers 'a-b'"),
        (dict(trace_layers="7-3"), "ascending"),
        (dict(trace_layers="1,1"), "more than once"),
        (dict(trace_sites="moe_in,q"), "--trace-sites"),
        (dict(trace_sites="none,moe_in"), "or 'none' alone"),
        (dict(trace_sites=""), "--trace-sites ''"),
        (dict(trace_sites="none", trace_debug_layer=1, trace_store=None), "--trace-debug-layer writes under"),
        (dict(trace_store=None), "--trace-store is required"),
        (dict(kv_cache_dtype="auto"), "--kv-cache-dtype fp4_e2m1"),
        (dict(trace_mode="native"), "--quantization modelopt_fp4"),
        (dict(trace_mode="native", quantization="modelopt_fp4"), "--moe-runner-backend flashinfer_cutlass"),
        (dict(trace_mode="fp8"), "--trace-mode 'fp8'"),
        (dict(quantization="fp8"), "BF16 checkpoint"),
        (dict(enable_dp_attention=True), "--enable-dp-attention"),
        (dict(ep_size=2), "expert parallelism"),
        (dict(trace_step=-1), "--trace-step"),
        (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
        (dict(disaggregation_mode="prefill"), "--disaggregation-mode prefill"),
        (dict(enable_pdmux=True), "--enable-pdmux"),
        (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap"),
        (dict(load_format="sharded_state"), "--load-format sharded_state"),
        (dict(load_format="remote_instance"), "--load-format remote_instance"),
        (dict(moe_runner_backend="flashinfer_trtllm"), "--moe-runner-backend flashinfer_trtllm"),
        (dict(moe_runner_backend="triton_kernel"), "--moe-runner-backend triton_kernel"),
        (dict(enable_torch_compile=True), "--enable-torch-compile"),
        (dict(custom_weight_loader=["my.loader"]), "--custom-weight-loader"),
        (dict(speculative_algorithm="EAGLE"), "speculative decoding"),
        (dict(pp_size=2), "pipeline parallelism"),
        (dict(enable_lmcache=True), "--enable-lmcache"),
        (dict(moe_a2a_backend="deepep"), "--moe-a2a-backend"),
        (dict(enable_single_batch_overlap=True), "--enable-single-batch-overlap"),
        (dict(disaggregation_mode="decode"), "--disaggregation-mode decode"),
        (dict(load_format="direct"), "--load-format direct"),
        *[
            (dict(moe_runner_backend=runner), f"--moe-runner-backend {runner}")
            for runner in ("flashinfer_cutlass", "flashinfer_mxfp4", "cutlass", "deep_gemm", "marlin", "aiter")
        ],
        # modes new in SGLang 0.5.15, refused by name
        (dict(dcp_size=2), "--dcp-size 2"),
        (dict(attn_cp_size=2), "--attn-cp-size 2"),
        (dict(moe_dp_size=2), "--moe-dp-size 2"),
        (dict(enable_prefill_cp=True), "--enable-prefill-cp"),
        (dict(enable_unified_memory=True), "--enable-unified-memory"),
        (dict(enable_page_major_kv_layout=True), "--enable-page-major-kv-layout"),
        (dict(enable_hisparse=True), "--enable-hisparse"),
        (dict(elastic_ep_backend="mooncake"), "--elastic-ep-backend mooncake"),
        (dict(enable_fused_moe_sum_all_reduce=True), "--enable-fused-moe-sum-all-reduce"),
        (dict(enable_flashinfer_allreduce_fusion=True, tp_size=2), "FlashInfer all-reduce fusion at TP > 1"),
        (dict(trace_debug_layer=-3), "--trace-debug-layer must be a layer id or -1"),
        (dict(trace_host_ring_gb=0.0), "--trace-host-ring-gb must be a positive number of GiB, got 0.0"),
        (dict(trace_host_ring_gb=-2), "--trace-host-ring-gb must be a positive number of GiB, got -2"),
        (
            dict(trace_debug_layer=1, trace_mode="native", quantization="modelopt_fp4"),
            "--trace-debug-layer needs --trace-mode emulate",
        ),
    ],
)
def test_bad_trace_args_fail_naming_the_problem(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make(**kw)


def test_flashinfer_allreduce_fusion_at_one_rank_and_the_debug_tap_are_accepted():
    assert trace_args(enable_flashinfer_allreduce_fusion=True).mode == "emulate"
    assert trace_args(trace_debug_layer=3).debug_layer == 3 and trace_args().debug_layer is None
    assert trace_args(trace_host_ring_gb=0.5).host_ring_gb == 0.5 and trace_args().host_ring_gb is None


@pytest.mark.slow
def test_trace_on_is_refused_unless_the_plugin_hooks_are_registered():
    """A fresh process that never loaded TRACE's plugin (or whose `SGLANG_PLUGINS` filters it out) refuses
    `--trace-mode` on when the server arguments are built, naming the fix; SGLang's own `load_plugins` finds the
    installed `sglang.srt.plugins` entry point `trace`, after which the same settings validate. TRACE off needs no
    plugin."""
    script = textwrap.dedent(
        """
        import os
        from tests.sglang_cpu import install_sgl_kernel_stand_in
        install_sgl_kernel_stand_in()
        import sglang.srt.plugins as plugins
        from sglang.srt.server_args import ServerArgs
        kw = dict(model_path="dummy", device="cpu", trace_mode="emulate", trace_store="/r", trace_sites="moe_in")
        assert ServerArgs(model_path="dummy", device="cpu").trace_mode == "off"
        for filtered in (None, "some_other_plugin"):
            if filtered:
                os.environ["SGLANG_PLUGINS"] = filtered
                plugins.load_plugins()
            try:
                ServerArgs(**kw)
            except RuntimeError as e:
                assert "plugin hooks are not registered" in str(e) and "SGLANG_PLUGINS" in str(e), e
            else:
                raise AssertionError("accepted without the plugin")
        del os.environ["SGLANG_PLUGINS"]
        plugins._plugins_loaded = False  # load_plugins runs once per process; this one saw the filter
        plugins.load_plugins()
        assert ServerArgs(**kw).trace_mode == "emulate"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_native_mode_accepts_the_observable_blackwell_setup():
    args = check_server_args(
        make(trace_mode="native", quantization="modelopt_fp4", moe_runner_backend="flashinfer_cutlass")
    )
    assert args.mode == "native"


def test_moe_only_sites_need_no_fp4_kv_and_off_checks_nothing_else():
    assert make(trace_sites="moe_in", kv_cache_dtype="auto").trace_sites == "moe_in"
    assert ServerArgs(model_path="dummy", trace_store=None, kv_cache_dtype="auto").trace_mode == "off"


@pytest.mark.parametrize("r3", [False, True])
def test_sites_none_is_the_recipes_numerics_without_records(r3):
    """`--trace-sites none` (a QAT-only rollout): TRACE on, no site recorded, no record store required, the K/V pool
    free to be BF16, in emulate and native alike; no record-store shard on any rank, except rank 0's routes when R3
    answers (`--enable-return-routed-experts`); a trainer reading the server's policy refuses it by name."""
    from sglang_trace.capturer import record_bytes_per_slot, record_shards
    from sglang_trace.config import served_spec
    from tests.sglang_server import stand_in_server_info

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", "dummy", "--device", "cpu", "--trace-mode", "emulate", "--trace-sites", "none"]
    args = check_server_args(ServerArgs.from_cli_args(parser.parse_args(argv)))
    assert args == TraceArgs("emulate", 1, "all", (), None, 0)
    assert args.enabled and not args.records and not args.kv_sites
    assert trace_args(trace_sites="none", trace_store=None, kv_cache_dtype="auto").sites == ()
    native = dict(trace_mode="native", quantization="modelopt_fp4", moe_runner_backend="flashinfer_cutlass")
    assert not trace_args(trace_sites="none", trace_store=None, **native).records
    layout = model_layout(qwen3_30b_a3b())
    assert model_spec(args, layout).sites() == []
    shards = record_shards(args, layout, 4, routes_on_first=r3)
    assert all(not s.sites and not s.marks for s in shards)
    assert [s.routes for s in shards] == [tuple(layout.moe_layers) if r3 else (), (), (), ()]
    assert record_bytes_per_slot(args, layout, 4, r3) == (shard_row_bytes(0, 0, 48) if r3 else 0)
    with pytest.raises(ValueError, match=r"trace_sites='none': the server runs the FP4 numerics .* records nothing"):
        served_spec(stand_in_server_info(trace_sites="none"), qwen3_30b_a3b())
    assert served_spec(stand_in_server_info(), qwen3_30b_a3b()) == model_spec(trace_args(), layout)


def test_model_spec_latter_half_and_explicit_layers():
    layout = model_layout(qwen3_moe(layers=8, mlp_only_layers=[0]))
    assert layout.moe_layers == (1, 2, 3, 4, 5, 6, 7) and layout.attn_layers == tuple(range(8))
    assert (layout.hidden, layout.num_kv_heads, layout.head_dim, layout.topk) == (64, 2, 32, 2)
    spec = model_spec(trace_args(), layout)  # the default: every layer (RecordSpec.default's policy)
    assert spec.bits == 1 and spec.moe_layers == layout.moe_layers and spec.attn_layers == layout.attn_layers
    spec = model_spec(trace_args(trace_layers="latter-half"), layout)
    assert spec.bits == 1 and spec.moe_layers == (4, 5, 6, 7) and spec.attn_layers == (4, 5, 6, 7)
    spec = model_spec(trace_args(trace_layers="0,6-7", trace_record_bits=4), layout)
    assert spec.bits == 4 and spec.moe_layers == (6, 7) and spec.attn_layers == (0, 6, 7)
    with pytest.raises(ValueError, match=r"layers \[8\]"):
        model_spec(trace_args(trace_layers="6-8"), layout)
    spec = model_spec(trace_args(trace_sites="moe_in"), layout)
    assert spec.attn_layers == ()


def test_unsupported_model_is_refused_and_hybrid_records_full_attention_kv():
    with pytest.raises(ValueError, match="does not support architecture"):
        model_layout(Qwen3MoeConfig(architectures=["DeepseekV3ForCausalLM"]))
    hybrid = Qwen3NextConfig(num_hidden_layers=8, full_attention_interval=4, architectures=["Qwen3NextForCausalLM"])
    layout = model_layout(hybrid)
    assert layout.attn_layers == (3, 7) and layout.moe_layers == tuple(range(8))
    spec = model_spec(trace_args(trace_layers="latter-half"), layout)
    assert spec.attn_layers == (7,) and spec.moe_layers == (4, 5, 6, 7)
    with pytest.raises(ValueError, match=r"layers \[9\]"):
        model_spec(trace_args(trace_layers="7,9"), layout)


def test_qwen2_moe_layout_follows_sparse_step_and_mlp_only_layers():
    cfg = Qwen2MoeConfig(
        hidden_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        decoder_sparse_step=2,
        mlp_only_layers=[5],
        num_experts_per_tok=2,
        architectures=["Qwen2MoeForCausalLM"],
    )
    layout = model_layout(cfg)
    assert layout.moe_layers == (1, 3) and layout.attn_layers == tuple(range(6)) and layout.head_dim == 16


def test_final_settings_are_validated_after_sglang_defaults(tmp_path):
    """The patched `__post_init__` runs the TRACE check again as its last statement, after every `_handle_*` step
    and after `materialize_declarations`, which applies SGLang 0.5.15's per-model / per-GPU declarations (e.g.
    `flashinfer_trtllm` for Qwen3-MoE on SM100). No such default fires on a CPU machine, so the placement is checked
    on the installed source, and the full `__post_init__` (real model directory, CPU) is run once with a refused
    setting to see the check fire there."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(ServerArgs.__post_init__)))
    body = tree.body[0].body
    calls = [ast.unparse(n.value.func) for n in body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
    handlers = [i for i, c in enumerate(calls) if c.startswith("self._handle_")]
    assert calls[-1] == "check_trace_args" and handlers and handlers[-1] < len(calls) - 1
    assert calls[-2] == "materialize_declarations" and calls.count("check_trace_args") == 2
    qwen3_moe(layers=2).save_pretrained(tmp_path / "qwen3-moe-tiny")
    model = dict(model_path=str(tmp_path / "qwen3-moe-tiny"), trace_sites="moe_in")
    assert trace_server_args("/r", **model).load_format == "auto"
    with pytest.raises(ValueError, match="--enable-pdmux"):
        trace_server_args("/r", **model, enable_pdmux=True)


def qwen3_30b_a3b() -> Qwen3MoeConfig:
    """Qwen3-30B-A3B's shape (its published config.json): the model docs/sglang.md sizes the record store for."""
    return Qwen3MoeConfig(
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        architectures=["Qwen3MoeForCausalLM"],
    )


def shard_row_bytes(sites: int, marks: int, routes: int, hidden: int = 2048, topk: int = 8, bits: int = 1) -> int:
    """A record-store row by its definition (docs/sglang.md "Memory"): per MoE-input site the packed low bits, one
    E4M3 scale per 16 elements and the FP32 token scale; topk bytes of routes per route layer (uint8 ids: 128
    experts), padded to 4 bytes; one hook-marker byte per marked layer, padded to 4 bytes; the weight version (4)
    and the written byte; rounded up to 8 bytes."""
    row = sites * (hidden * bits // 8 + hidden // 16 + 4) + -(-routes * topk // 4) * 4 + -(-marks // 4) * 4 + 4 + 1
    return -(-row // 8) * 8


@pytest.mark.parametrize("layers", ["all", "latter-half"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("r3", [False, True])
def test_record_store_shards_split_the_moe_layers_over_tp_ranks(layers, tp, r3):
    """Each attention-TP rank keeps the MoE-input records, markers and routes of its share of the MoE layers: the
    shards partition them (rank 0 keeps every route when R3 answers at finish), every rank's row is the row of its
    share, and what every rank adds to its KV cell (the largest shard) is about 1 / tp of one rank's."""
    from sglang_trace.capturer import record_bytes_per_slot, record_shards, shard_reader
    from trace_core.records.capture import shard_layers

    args = trace_args(trace_layers=layers)
    layout = model_layout(qwen3_30b_a3b())
    spec = model_spec(args, layout)
    shards = record_shards(args, layout, tp, routes_on_first=r3)
    assert len(shards) == tp
    sites = [site for shard in shards for site in shard.sites]
    assert sorted(sites) == sorted(s for s in spec.sites() if s[1] == "moe_in")
    mine = shard_layers(layout.moe_layers, [layer for layer, kind in spec.sites() if kind == "moe_in"], tp)
    for shard, owned in zip(shards, mine, strict=True):  # a marker byte only where the rank keeps no routes
        assert shard.marks == tuple(layer for layer in owned if layer not in shard.routes)
    routes = [layer for shard in shards for layer in shard.routes]
    assert routes == list(layout.moe_layers) if r3 else sorted(routes) == list(layout.moe_layers)
    assert max(len(s.sites) for s in shards) - min(len(s.sites) for s in shards) <= 1
    rows = [shard_reader(args, layout, shard).row.row_bytes for shard in shards]
    assert rows == [shard_row_bytes(len(s.sites), len(s.marks), len(s.routes)) for s in shards]
    assert record_bytes_per_slot(args, layout, tp, r3) == max(rows)
    one = record_bytes_per_slot(args, layout)
    assert one == shard_row_bytes(len(spec.moe_layers), 0, 48)
    if not r3:
        assert max(rows) <= one / tp + 16


def test_docs_record_store_sizes():
    """The numbers docs/sglang.md ("Memory") gives for Qwen3-30B-A3B at b = 1, against the code."""
    from sglang_trace.capturer import record_bytes_per_slot

    layout = model_layout(qwen3_30b_a3b())
    kv_tp4 = 48 * 2 * 1 * (128 // 2 + 128 // 16)  # one KV head per rank at TP 4: 6,912 bytes per token
    sizes = {
        (layers, tp, r3): record_bytes_per_slot(trace_args(trace_layers=layers), layout, tp, r3)
        for layers in ("all", "latter-half")
        for tp in (1, 4)
        for r3 in (False, True)
    }
    assert (kv_tp4, sizes["all", 1, False], sizes["latter-half", 1, False]) == (6912, 19016, 9704)
    assert (sizes["all", 4, False], sizes["all", 4, True], sizes["latter-half", 4, False]) == (4760, 5048, 2432)
    share = {k: round(100 * kv_tp4 / (kv_tp4 + v)) for k, v in sizes.items() if k[1] == 4}
    assert (share["all", 4, False], share["all", 4, True], share["latter-half", 4, False]) == (59, 58, 74)
    # the smallest capture policy (b = 1 MoE-input records of one layer), no capture, and no capture with R3 on
    smallest = record_bytes_per_slot(trace_args(trace_layers="47", trace_sites="moe_in"), layout)
    none, none_r3 = (record_bytes_per_slot(trace_args(trace_sites="none"), layout, 1, r3) for r3 in (False, True))
    assert (smallest, none, none_r3) == (784, 0, 392)
    int32 = record_bytes_per_slot(
        trace_args(trace_layers="47", trace_sites="moe_in"), dataclasses.replace(layout, num_experts=None)
    )
    assert int32 == 1936  # the same row with int32 routes (an expert count the layout does not know)
