"""Run by tests/sglang/test_sglang_model.py in a child process with `SGLANG_USE_CPU_ENGINE=1` (SGLang's CPU engine mode,
read when its modules are imported): TRACE's SGLang plugin loaded by SGLang's `load_plugins` before the model is
built (as a scheduler process does), SGLang's real `Qwen3MoeForCausalLM` (sglang 0.5.15.post1), built on CPU,
loaded through its own `load_weights` (the plugin's hook on the FusedMoE weight loader quantizes the experts), TRACE
installed by the plugin's hook around `ModelRunner.init_routed_experts_capturer` (`hooks.install_capturer`, the
model-load layer check included), and one prefill forward through SGLang's
`torch_native` attention backend and FP4 KV pool. The request's stored records must equal the reference
quantization of what each layer actually saw (observed with forward hooks on SGLang's modules): MoE inputs, K and
V, and the routes the model's top-k chose. A second case serves the same prefill with `--trace-sites none` (the
recipe's numerics, no records): its logits equal those of the capturing server bit for bit, and it allocates no
record rows and writes nothing.
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import torch

from tests.interpret import run_cases
from tests.sglang_cpu import init_cpu_parallel_state, load_trace_plugin

LAYERS, H, HEADS, KV_HEADS, HEAD_DIM, E, TOPK, INTER, VOCAB, T = 2, 64, 4, 2, 32, 4, 2, 32, 128, 7


def checkpoint(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A random Qwen3-MoE checkpoint in the Hugging Face names SGLang's `load_weights` maps."""

    def w(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    ckpt = {
        "model.embed_tokens.weight": w(VOCAB, H, scale=1.0),
        "model.norm.weight": 1 + w(H),
        "lm_head.weight": w(VOCAB, H),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        ckpt |= {
            p + "input_layernorm.weight": 1 + w(H),
            p + "post_attention_layernorm.weight": 1 + w(H),
            p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, H),
            p + "self_attn.k_proj.weight": w(KV_HEADS * HEAD_DIM, H),
            p + "self_attn.v_proj.weight": w(KV_HEADS * HEAD_DIM, H),
            p + "self_attn.o_proj.weight": w(H, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": 1 + w(HEAD_DIM),
            p + "self_attn.k_norm.weight": 1 + w(HEAD_DIM),
            p + "mlp.gate.weight": w(E, H),
        }
        for e in range(E):
            ckpt |= {
                p + f"mlp.experts.{e}.gate_proj.weight": w(INTER, H),
                p + f"mlp.experts.{e}.up_proj.weight": w(INTER, H),
                p + f"mlp.experts.{e}.down_proj.weight": w(H, INTER),
            }
    return ckpt


def model_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=E, num_experts_per_tok=TOPK,
                          moe_intermediate_size=INTER, intermediate_size=2 * INTER, vocab_size=VOCAB,
                          norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])  # fmt: skip


def server_args(**trace):
    """The CPU server's `ServerArgs` (FP4 KV, torch_native attention, TRACE emulate with `trace` fields), set as the
    scheduler's global arguments."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(model_path="dummy", device="cpu", kv_cache_dtype="fp4_e2m1", attention_backend="torch_native",
                      trace_mode="emulate", **trace)  # fmt: skip
    set_global_server_args_for_scheduler(args)
    return args


def build_model(args, cfg):
    """SGLang's `Qwen3MoeForCausalLM` built under `args` and loaded through its own `load_weights` (the plugin's
    hook quantizes the experts as they load)."""
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM

    initialize_dp_attention(args, SimpleNamespace(hidden_size=H, dtype=torch.bfloat16, hf_config=cfg))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # SGLang's model loader builds the model under the checkpoint dtype
    try:
        model = Qwen3MoeForCausalLM(cfg, quant_config=None)
    finally:
        torch.set_default_dtype(default)
    model.load_weights(checkpoint(torch.Generator().manual_seed(0)).items())
    return model


def serve_prefill(args, cfg, model, slots: torch.Tensor, ids: torch.Tensor):
    """TRACE installed for `args` by the plugin's hook on `ModelRunner.init_routed_experts_capturer` over a fresh FP4
    pool, then one prefill of `ids` at KV `slots` and the forward's end, as ModelRunner runs them; returns the
    capturer, the runner, the request pool and the logits."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPoolFP4, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.state_capturer.routed_experts import get_global_experts_capturer

    from sglang_trace.capturer import TraceCapturer

    pool = MHATokenToKVPoolFP4(size=32, page_size=1, dtype=torch.float4_e2m1fn_x2, head_num=KV_HEADS,
                               head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                               enable_alt_stream=False)  # fmt: skip
    req_to_token = ReqToTokenPool(size=2, max_context_len=32, device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(32, torch.float4_e2m1fn_x2, "cpu", pool, need_sort=False)
    runner = SimpleNamespace(server_args=args, model_config=SimpleNamespace(hf_config=cfg, context_len=32),
                             model=model, token_to_kv_pool=pool, token_to_kv_pool_allocator=allocator,
                             max_running_requests=2, max_total_num_tokens=32,
                             page_size=1, device="cpu", is_draft_worker=False, tp_size=1,
                             req_to_token_pool=req_to_token)  # fmt: skip
    assert ModelRunner.init_routed_experts_capturer(runner) is None  # the plugin's hook installs TRACE's capturer
    capturer = get_global_experts_capturer()
    assert isinstance(capturer, TraceCapturer)
    req_to_token.req_to_token[0, :T] = slots.int()
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=1,
        input_ids=ids,
        req_pool_indices=torch.tensor([0]),
        seq_lens=torch.tensor([T]),
        seq_lens_cpu=torch.tensor([T]),
        out_cache_loc=slots,
        seq_lens_sum=T,
        positions=torch.arange(T),
        extend_prefix_lens=torch.tensor([0]),
        extend_seq_lens=torch.tensor([T]),
        extend_prefix_lens_cpu=[0],
        extend_seq_lens_cpu=[T],
        extend_num_tokens=T,
        capture_hidden_mode=CaptureHiddenMode.NULL,
    )
    # SGLang 0.5.15 reaches the attention backend and its pools through the forward context, as ModelRunner sets it
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=TorchNativeAttnBackend(runner))):
        out = model.forward(ids, batch.positions, batch)
    # as ModelRunner.forward does after the model's forward
    assert (
        capturer.on_forward_end(forward_batch=batch, can_run_graph=False, cuda_graph_batch=None, no_copy_to_cpu=False)
        is None
    )
    return capturer, runner, req_to_token, out.next_token_logits


def prefill_records_equal_what_the_layers_saw() -> None:
    load_trace_plugin()
    init_cpu_parallel_state()
    from trace_core.numerics.formats import KV_FP4
    from trace_core.numerics.quant import quantize
    from trace_core.records.reader import RecordReader
    from trace_core.records.spec import Record

    store = tempfile.mkdtemp()
    args, cfg = server_args(trace_store=store), model_config()
    model = build_model(args, cfg)
    seen: dict = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.experts.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__((i, "moe_in"), a[0].clone()))
        layer.mlp.topk.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__((i, "routes"), out.topk_ids))
        layer.self_attn.attn.register_forward_pre_hook(
            lambda m, a, i=i: seen.update({(i, "k"): a[1].clone(), (i, "v"): a[2].clone()})
        )
    slots = torch.tensor([9, 4, 17, 3, 12, 5, 30])
    ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(1))
    capturer, _, req_to_token, logits = serve_prefill(args, cfg, model, slots, ids)
    assert bool(logits.isfinite().all())
    # the request: prompt of T - 1 tokens plus one sampled token, so positions [0, T - 1) have records
    handle = capturer.finish_request("req", 0, T, req_to_token, ids[: T - 1].tolist(), [int(ids[T - 1])])
    capturer.flush()
    assert capturer.stats.write_failures == 0 and handle["tokens"] == T - 1, (capturer.stats, handle)
    got = RecordReader(store, 0).load([("req", 0, T - 1)])
    n = T - 1
    for i in range(LAYERS):
        ref = Record.from_quantized(quantize(seen[(i, "moe_in")][:n], "nvfp4", per_token=True), 1)
        rec = got.records[(i, "moe_in")]
        assert torch.equal(rec.low_bits[0, :n], ref.low_bits) and torch.equal(rec.scales[0, :n], ref.scales), i
        assert torch.equal(rec.global_scale[0, :n], ref.global_scale), i
        assert torch.equal(got.routes[0, :n, i], seen[(i, "routes")][:n].int()), i
        for kind in ("k", "v"):
            x = seen[(i, kind)][:n].reshape(n, KV_HEADS, HEAD_DIM)
            q = quantize(x, KV_FP4)
            flat = type(q)(codes=q.codes.reshape(n, -1), scales=q.scales.reshape(n, -1), global_scale=None, fmt=KV_FP4)
            ref_kv, rec = Record.from_quantized(flat, 1), got.records[(i, kind)]
            assert torch.equal(rec.low_bits[0, :n], ref_kv.low_bits) and torch.equal(rec.scales[0, :n], ref_kv.scales)
    capturer.close()


def no_capture_serves_the_capturing_servers_logits() -> None:
    """One model, served by an emulate server recording every site and by one with `--trace-sites none`: the same
    prefill gives bit-identical logits (records do not change the numerics), and the second has no record rows, no
    host ring, adds nothing to the KV cell, returns no handle and writes nothing (the record store holds the
    capturing server's request only)."""
    load_trace_plugin()
    init_cpu_parallel_state()
    from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer

    from sglang_trace import hooks

    store = tempfile.mkdtemp()
    capture_args, cfg = server_args(trace_store=store), model_config()
    model = build_model(capture_args, cfg)
    slots = torch.tensor([9, 4, 17, 3, 12, 5, 30])
    ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, args in (("capture", capture_args), ("none", server_args(trace_sites="none"))):
        capturer, runner, req_to_token, logits[name] = serve_prefill(args, cfg, model, slots, ids)
        handle = capturer.finish_request(name, 0, T, req_to_token, ids[: T - 1].tolist(), [int(ids[T - 1])])
        capturer.flush()
        assert capturer.stats.write_failures == 0, capturer.stats
        if name == "none":
            assert handle is None and capturer.records is None and capturer.ring is None
            capturing = SimpleNamespace(server_args=capture_args, model_config=runner.model_config, tp_size=1)
            assert hooks.record_bytes_per_token(runner) == 0 < hooks.record_bytes_per_token(capturing)
        else:
            assert handle["tokens"] == T - 1
        capturer.close()
        set_global_experts_capturer(None)
    assert torch.equal(logits["none"], logits["capture"]) and bool(logits["none"].isfinite().all())
    from trace_core.records.store import read_header, shard_paths, step_dir

    assert {t for p in shard_paths(step_dir(store, 0)) for t in read_header(p)["trajectories"]} == {"capture"}


if __name__ == "__main__":
    run_cases(
        {
            "qwen3-moe-prefill": prefill_records_equal_what_the_layers_saw,
            "qwen3-moe-no-capture": no_capture_serves_the_capturing_servers_logits,
        }
    )
