"""Emulated NVFP4 W4A4 routed experts (`--trace-mode emulate`) in SGLang's real `FusedMoE` on CPU.

What runs for real: `FusedMoE` (sglang 0.5.15.post1, TRACE's plugin hooks applied by SGLang's `load_plugins`)
built on a one-process gloo TP group, its `weight_loader` with the plugin's AFTER hook (the path the initial load
and every `update_weights_from_*` take), its `forward_impl` with the standard dispatcher, the plugin's BEFORE hook
on `run_moe_core` (the MoE-input site) and SGLang's CPU expert path (`moe_forward_native`, patch 0003: the FC2-input
site). The layer module imports the compiled `sgl_kernel`; where it is absent `tests/sglang_cpu.py` installs an
import stand-in whose placeholders raise if called — none is called on these paths.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.sglang_cpu import load_trace_plugin

load_trace_plugin()

import sglang.srt.layers.moe.fused_moe_triton.layer as layer_mod  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.server_args import set_global_server_args_for_scheduler  # noqa: E402
from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer  # noqa: E402

from sglang_trace import hooks  # noqa: E402
from sglang_trace.moe import ExpertWeights, emulate_moe_input, native_moe_input  # noqa: E402
from tests.sglang_cpu import cpu_capturer, init_cpu_parallel_state, trace_server_args  # noqa: E402
from trace_core.numerics.quant import dequantize, nvfp4_global_scale, quantize  # noqa: E402
from trace_core.records.capture import RecordCapturer  # noqa: E402
from trace_core.records.spec import ModelShape, Record, RecordSpec  # noqa: E402

E, H, INTER, TOPK = 4, 64, 32, 2


@pytest.fixture(scope="module")
def emulate_args():
    init_cpu_parallel_state()
    args = trace_server_args("/unused", trace_sites="moe_in")
    set_global_server_args_for_scheduler(args)
    yield args
    set_global_experts_capturer(None)


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = {}
    for e in range(E):
        w[f"{e}.gate"] = (torch.randn(INTER, H, generator=gen) * 0.05).to(torch.bfloat16)
        w[f"{e}.up"] = (torch.randn(INTER, H, generator=gen) * 0.02 * (e + 1)).to(torch.bfloat16)
        w[f"{e}.down"] = (torch.randn(H, INTER, generator=gen) * 0.03).to(torch.bfloat16)
    return w


def load(layer, ckpt, experts=range(E), parts=("gate", "up", "down")) -> None:
    """What Qwen3MoeForCausalLM.load_weights does per expert tensor: the FusedMoE weight loader."""
    shard = {"gate": ("w13_weight", "w1"), "up": ("w13_weight", "w3"), "down": ("w2_weight", "w2")}
    for e in experts:
        for part in parts:
            name, sid = shard[part]
            layer.weight_loader(getattr(layer, name), ckpt[f"{e}.{part}"], f"experts.{e}.{name}", sid, e)


def nvfp4_qdq(w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    q = quantize(w, "nvfp4", global_scale=nvfp4_global_scale(amax))
    return dequantize(q, w.dtype)


def make_layer(layer_id: int = 3):
    return layer_mod.FusedMoE(
        num_experts=E,
        hidden_size=H,
        intermediate_size=INTER,
        layer_id=layer_id,
        top_k=TOPK,
        params_dtype=torch.bfloat16,
    )


def test_expert_weights_are_nvfp4_at_load_and_after_every_update(emulate_args):
    layer = make_layer()
    before = hooks.EXPERT_WEIGHTS.stats.w13
    for seed in (0, 1):  # initial load, then a weight update through the same loader
        ckpt = checkpoint(seed)
        load(layer, ckpt)
        for e in range(E):
            gate_up = torch.cat([ckpt[f"{e}.gate"], ckpt[f"{e}.up"]])
            assert torch.equal(layer.w13_weight.data[e], nvfp4_qdq(gate_up, gate_up.abs().amax().float()))
            down = ckpt[f"{e}.down"]
            assert torch.equal(layer.w2_weight.data[e], nvfp4_qdq(down, down.abs().amax().float()))
    assert hooks.EXPERT_WEIGHTS.stats.w13 - before == 2 * E


def test_dummy_initialized_experts_are_quantized_as_a_load_would(emulate_args):
    """`--load-format dummy` writes the experts without the weight loader; `quantize_dummy_experts` gives what
    loading the same values through the loader gives, and refuses sharded experts."""
    ckpt = checkpoint(3)
    loaded, dummy = make_layer(layer_id=6), make_layer(layer_id=7)
    for e in range(E):  # the dummy loader's random fill, here the checkpoint's values written directly
        dummy.w13_weight.data[e] = torch.cat([ckpt[f"{e}.gate"], ckpt[f"{e}.up"]])
        dummy.w2_weight.data[e] = ckpt[f"{e}.down"]
    load(loaded, ckpt)
    hooks.quantize_dummy_experts(torch.nn.ModuleList([dummy]), 1, hooks.EXPERT_WEIGHTS.role)
    assert torch.equal(dummy.w13_weight, loaded.w13_weight) and torch.equal(dummy.w2_weight, loaded.w2_weight)
    with pytest.raises(ValueError, match="--load-format dummy at MoE TP 2: the experts' global scales need whole"):
        hooks.quantize_dummy_experts(torch.nn.ModuleList([dummy]), 2, hooks.EXPERT_WEIGHTS.role)


def test_half_updated_expert_is_reported_and_refused(emulate_args):
    layer = make_layer(layer_id=5)
    weights = ExpertWeights()
    ckpt = checkpoint(2)
    layer.w13_weight.data[1, :INTER] = ckpt["1.gate"]
    weights.on_loaded(layer, layer.w13_weight, ckpt["1.gate"], "w1", 1)
    assert weights.pending() == [(5, 1)]
    with pytest.raises(RuntimeError, match=r"half updated .*\(5, 1\)"):
        weights.check_complete()
    layer.w13_weight.data[1, INTER:] = ckpt["1.up"]
    weights.on_loaded(layer, layer.w13_weight, ckpt["1.up"], "w3", 1)
    assert weights.pending() == [] and weights.stats.w13 == 1


def test_emulated_input_site_equals_reference_and_writes_record():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(7, H, generator=gen) * torch.logspace(-3, 3, 7).view(-1, 1)).to(torch.bfloat16)
    spec = RecordSpec(bits=1, moe_layers=(3,))
    cap = RecordCapturer(spec, ModelShape(hidden=H, num_kv_heads=1, head_dim=16), max_tokens=16, num_slots=32)
    out = emulate_moe_input(x, 1, cap.staging_rows((3, "moe_in"), 7))
    q = quantize(x, "nvfp4", per_token=True)
    assert torch.equal(out, dequantize(q, x.dtype))
    cap.on_forward_end(torch.arange(10, 17))
    rec = cap.gather(torch.arange(10, 17), 7).records[(3, "moe_in")]
    ref = Record.from_quantized(q, 1)
    assert torch.equal(rec.low_bits, ref.low_bits) and torch.equal(rec.scales, ref.scales)
    assert torch.equal(rec.global_scale, ref.global_scale)
    assert torch.equal(emulate_moe_input(x, 1, None), out)  # uncaptured layers: same numerics, no record


def test_patched_forward_impl_runs_experts_on_the_nvfp4_input(emulate_args, tmp_path):
    """FusedMoE.forward_impl with TRACE on equals the reference: NVFP4 MoE input, NVFP4 FC2 input per (token,
    expert) row (`trace_core.numerics.fc2`), the top-k weight applied to each expert's BF16 FC2 output in FP32 and
    summed in FP32 (SGLang's CPU expert path, `moe_forward_native`)."""
    from sglang_trace.config import ModelLayout

    layer = make_layer(layer_id=1)
    load(layer, checkpoint(4))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(6)]).to(torch.int32)
    topk = StandardTopKOutput(topk_weights=torch.rand(6, TOPK, generator=gen), topk_ids=ids, router_logits=None)

    xq = dequantize(quantize(x, "nvfp4", per_token=True), x.dtype)
    rows = []
    for t in range(6):
        for k in range(TOPK):
            e = int(ids[t, k])
            gate, up = F.linear(xq[t : t + 1], layer.w13_weight[e]).chunk(2, dim=-1)
            h = dequantize(quantize(F.silu(gate) * up, "nvfp4", per_token=True), x.dtype)
            rows.append(F.linear(h, layer.w2_weight[e])[0].float() * topk.topk_weights[t, k])
    reference = torch.stack(rows).view(6, TOPK, H).sum(dim=1).to(x.dtype)
    # TRACE on without its capturer (the plugin's capturer hook did not run): the FC2-input site refuses to run on
    with pytest.raises(RuntimeError, match="without TRACE's capturer"):
        layer.forward_impl(x, topk)
    set_global_server_args_for_scheduler(trace_server_args(str(tmp_path), trace_mode="off"))
    try:
        unquantized = layer.forward_impl(x, topk)  # TRACE off: SGLang's own expert path
    finally:
        set_global_server_args_for_scheduler(emulate_args)
    layout = ModelLayout("Qwen3MoeForCausalLM", 2, (0, 1), (0, 1), H, 1, 16, TOPK)
    args = trace_server_args(str(tmp_path), trace_sites="moe_in", trace_record_bits=4)
    cap = cpu_capturer(args, layout, max_tokens=8, num_slots=16, max_request_tokens=8, weights=hooks.EXPERT_WEIGHTS)
    set_global_experts_capturer(cap)
    try:
        traced = layer.forward_impl(x, topk)
    finally:
        set_global_experts_capturer(None)
    assert torch.equal(traced, reference)
    assert not torch.equal(traced, unquantized)
    staged = cap.records.site_buffers((1, "moe_in"))
    ref = Record.from_quantized(quantize(x, "nvfp4", per_token=True), 4)
    assert torch.equal(staged.low_bits[:6], ref.low_bits) and torch.equal(staged.scales[:6], ref.scales)


def test_native_site_reproduces_codes_under_the_static_input_scale():
    """native: the kernel quantizes with the layer's static `S_enc` (`w13_input_scale_quant`); the record must be the
    exact-math quantization under that scale, and the input is left as it is."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, H, generator=gen).to(torch.bfloat16)
    s_enc = nvfp4_global_scale(torch.tensor(3.5))
    spec = RecordSpec(bits=2, moe_layers=(0,))
    cap = RecordCapturer(spec, ModelShape(hidden=H, num_kv_heads=1, head_dim=16), max_tokens=8, num_slots=8)
    kept = x.clone()
    native_moe_input(x, 2, s_enc, cap.staging_rows((0, "moe_in"), 5))
    assert torch.equal(x, kept)
    cap.on_forward_end(torch.arange(5))
    rec = cap.gather(torch.arange(5), 5).records[(0, "moe_in")]
    ref = Record.from_quantized(quantize(x, "nvfp4", global_scale=s_enc), 2)
    assert torch.equal(rec.low_bits, ref.low_bits) and torch.equal(rec.scales, ref.scales)
    assert torch.equal(rec.global_scale, s_enc.expand(5, 1))


@pytest.mark.parametrize(
    "flag, where, message",
    [
        (None, None, None),
        ("use_intel_amx_backend", "layer", "CPU AMX fused_experts_cpu"),
        ("use_flashinfer_cutlass", "method", "use_flashinfer_cutlass"),
        ("use_triton_kernels", "method", "use_triton_kernels"),
    ],
)
def test_model_load_refuses_a_built_layer_whose_expert_path_is_not_hooked(emulate_args, flag, where, message):
    """`check_moe_layers` (run by `install_capturer` at model load, after SGLang resolved `--moe-runner-backend
    auto` per layer) passes SGLang's BF16 FusedMoE on the CPU path and refuses a layer built for an expert path
    without the FC2-input site, naming it: the flags SGLang's layer and quant method set when built for CPU AMX,
    flashinfer_cutlass or triton_kernels."""
    model = torch.nn.Module()
    model.mlp = make_layer()
    if flag is None:
        assert hooks.check_moe_layers(model, "emulate") == 1
        return
    setattr(model.mlp if where == "layer" else model.mlp.quant_method, flag, True)
    with pytest.raises(ValueError, match=f"MoE layer mlp runs .*{message}"):
        hooks.check_moe_layers(model, "emulate")


def test_model_load_refuses_native_routing_inside_flashinfer_trtllm(emulate_args):
    """native: a built layer whose runner is flashinfer_trtllm routes inside the kernel (routes never reach the
    capturer), so the model-load check refuses it; flashinfer_cutlass (standard top-k) passes."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    model = torch.nn.Module()
    model.mlp = make_layer()
    model.mlp.quant_method.runner = SimpleNamespace(runner_backend=MoeRunnerBackend.FLASHINFER_CUTLASS)
    assert hooks.check_moe_layers(model, "native") == 1
    model.mlp.quant_method.runner = SimpleNamespace(runner_backend=MoeRunnerBackend.FLASHINFER_TRTLLM)
    with pytest.raises(ValueError, match="MoE layer mlp routes inside flashinfer_trtllm"):
        hooks.check_moe_layers(model, "native")
