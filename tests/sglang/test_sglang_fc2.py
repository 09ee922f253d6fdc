"""Rollout, trainer and embedded engine feed the same FP4 values into both expert GEMMs (FC1 and FC2 inputs).

Three real code paths on one BF16 checkpoint and one routed input:
  * SGLang: `FusedMoE` (sglang 0.5.15.post1, TRACE's plugin hooks applied) with `--trace-mode emulate`, its
    weight loader and its CPU expert path (`moe_forward_native`, patch 0003 hooks the FC2 input there as 0002 does
    in the fused kernel sequence on the GPU), on one process and on a two-process MoE-TP group (gloo), where each
    rank holds half of the intermediate width;
  * the trainer's site code: `megatron_trace.sites.SiteNumerics` (MoE input, expert weight, FC2 input);
  * the embedded engine: `trace_rl.rollout.engine.EmbeddedEngine`'s expert forward on a transformers Qwen3-MoE.
The tensors entering every expert's FC1 and FC2 GEMM are observed with a `TorchFunctionMode` on `F.linear` (the
code under test runs unchanged) and must be bit-identical across the three, and equal to the NVFP4 values of the
reference codes (`trace_core.numerics.quant`) — per (token, expert) row for FC2, with the scale of the full row.
"""

from __future__ import annotations

import socket
from collections import defaultdict
from contextlib import contextmanager

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tests.sglang_cpu import load_trace_plugin

load_trace_plugin()

import sglang.srt.layers.moe.fused_moe_triton.layer as layer_mod  # noqa: E402

from tests.sglang.test_sglang_moe import load  # noqa: E402

E, H, INTER, TOPK, T, LAYER = 4, 64, 64, 2, 6, 1


def checkpoint() -> dict[str, torch.Tensor]:
    """Expert weights; the second half of the intermediate is ~30x larger than the first (see the TP test)."""
    gen = torch.Generator().manual_seed(11)
    boost = torch.ones(INTER, 1)
    boost[INTER // 2 :] = 30.0
    w = {}
    for e in range(E):
        w[f"{e}.gate"] = (torch.randn(INTER, H, generator=gen) * 0.05).to(torch.bfloat16)
        w[f"{e}.up"] = (torch.randn(INTER, H, generator=gen) * 0.02 * boost).to(torch.bfloat16)
        w[f"{e}.down"] = (torch.randn(H, INTER, generator=gen) * 0.03).to(torch.bfloat16)
    return w


def routed_input() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(T, H, generator=gen) * torch.logspace(-1, 1, T).view(-1, 1)).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(T)]).to(torch.int32)
    weights = torch.softmax(torch.randn(T, TOPK, generator=gen), dim=-1)
    return x, ids, weights


class GemmInputs(TorchFunctionMode):
    """Records `(input, weight)` of every `F.linear` call; the call itself runs unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            self.calls.append((args[0].detach().clone(), args[1]))
        return func(*args, **kwargs)


def rows_by_expert(calls, fc1: list[torch.Tensor], fc2: list[torch.Tensor], tokens: dict[int, list[int]]) -> dict:
    """{(expert, "fc1"/"fc2"): {token: input row}} from observed GEMM calls; `tokens[e]`: the tokens of expert e's
    rows in the order the path under test feeds them."""
    out: dict = defaultdict(dict)
    for x, w in calls:
        for kind, weights in (("fc1", fc1), ("fc2", fc2)):
            for e, we in enumerate(weights):
                if w.data_ptr() == we.data_ptr():
                    assert x.shape[0] == len(tokens[e]), (kind, e, x.shape)
                    out[(e, kind)] = dict(zip(tokens[e], x, strict=True))
    return out


def ascending_tokens(ids: torch.Tensor) -> dict[int, list[int]]:
    """Tokens routed to each expert in ascending order (the engine's and the trainer's row order)."""
    return {e: (ids == e).any(dim=1).nonzero().flatten().tolist() for e in range(E)}


def sglang_native_tokens(ids: torch.Tensor) -> dict[int, list[int]]:
    """Row order of SGLang's `moe_forward_native`: `topk_ids.view(-1).argsort()`, split by expert."""
    order = (ids.view(-1).argsort() // ids.shape[1]).tolist()
    counts = torch.bincount(ids.view(-1).long(), minlength=E).tolist()
    out, start = {}, 0
    for e, c in enumerate(counts):
        out[e], start = order[start : start + c], start + c
    return out


def sglang_layer(store: str, tp_group_world: int = 1, attention_layers: tuple = (0, 1), **server_args):
    """A patched FusedMoE (layer LAYER) loaded from `checkpoint()` through its weight loader, TRACE emulate on;
    its capturer is SGLang's global one. `server_args` override the `ServerArgs` below (a recipe, other sites)."""
    from sglang.srt.distributed.parallel_state import get_moe_tp_group, get_tp_group
    from sglang.srt.server_args import set_global_server_args_for_scheduler
    from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer

    from sglang_trace import hooks
    from sglang_trace.config import ModelLayout
    from tests.sglang_cpu import cpu_capturer, trace_server_args

    args = trace_server_args(store, **({"trace_sites": "moe_in", "tp_size": tp_group_world} | server_args))
    set_global_server_args_for_scheduler(args)
    layer = layer_mod.FusedMoE(
        num_experts=E, hidden_size=H, intermediate_size=INTER, layer_id=LAYER, top_k=TOPK, params_dtype=torch.bfloat16
    )
    load(layer, checkpoint(), range(E))
    moe_tp, tp = get_moe_tp_group(), get_tp_group()
    cap = cpu_capturer(
        args,
        ModelLayout("Qwen3MoeForCausalLM", 2, (0, LAYER), attention_layers, H, 1, 16, TOPK),
        weights=hooks.EXPERT_WEIGHTS,
        tp_rank=tp.rank_in_group,
        tp_size=tp.world_size,
        trace_group=hooks.trace_group(tp),
        moe_tp_group=moe_tp if moe_tp.world_size > 1 else None,
    )
    set_global_experts_capturer(cap)
    return layer


@contextmanager
def installed_layer(store: str, **server_args):
    """`sglang_layer` on a one-process SGLang TP group, its capturer SGLang's global one and its server arguments
    SGLang's published ones until the block ends (then the earlier ones again: TRACE's KV pool hooks read them)."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.state_capturer.routed_experts import set_global_experts_capturer

    from tests.sglang_cpu import init_cpu_parallel_state

    init_cpu_parallel_state()
    published = get_context()._server_args
    try:
        yield sglang_layer(store, **server_args)
    finally:
        set_global_experts_capturer(None)
        get_context()._server_args = published


def run_sglang(layer) -> tuple[dict, torch.Tensor]:
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    x, ids, weights = routed_input()
    topk = StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=None)
    with GemmInputs() as seen:
        out = layer.forward_impl(x, topk)
    w13 = [layer.w13_weight[e] for e in range(E)]
    w2 = [layer.w2_weight[e] for e in range(E)]
    return rows_by_expert(seen.calls, w13, w2, sglang_native_tokens(ids)), out


def reference_fc2_rows(full_h: torch.Tensor) -> torch.Tensor:
    """NVFP4 values of the reference codes of FC2-input rows, scale from each full row."""
    from trace_core.numerics.quant import dequantize, quantize

    return dequantize(quantize(full_h, "nvfp4", per_token=True), full_h.dtype)


def trainer_rows() -> dict:
    """The trainer's site code on the same input: MoE-input site, expert weights, FC2-input site."""
    from megatron_trace.config import TraceConfig
    from megatron_trace.sites import SiteNumerics
    from trace_core.records.spec import RecordSpec

    numerics = SiteNumerics(TraceConfig(mode="qat", spec=RecordSpec(moe_layers=(LAYER,)), replay_routes=False))
    x, ids, _ = routed_input()
    ckpt = checkpoint()
    xq = numerics.activation((LAYER, "moe_in"), x, None)
    out: dict = defaultdict(dict)
    for e in range(E):
        tokens = (ids == e).any(dim=1).nonzero().flatten()
        fc1 = numerics.weight(torch.cat([ckpt[f"{e}.gate"], ckpt[f"{e}.up"]]))
        gate, up = F.linear(xq[tokens], fc1).chunk(2, dim=-1)
        h = numerics.fc2_input(F.silu(gate) * up)
        for i, t in enumerate(tokens.tolist()):
            out[(e, "fc1")][t] = xq[t]
            out[(e, "fc2")][t] = h[i]
        out[(e, "fc2_bf16")] = dict(zip(tokens.tolist(), F.silu(gate) * up, strict=True))
    return out


@pytest.fixture(scope="module")
def engine_rows(tmp_path_factory) -> dict:
    """The embedded engine's expert forward on a transformers Qwen3-MoE holding `checkpoint()` in layer LAYER."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trace_core.records.spec import RecordSpec
    from trace_rl.rollout.engine import EmbeddedEngine

    cfg = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=H,
        intermediate_size=64,
        moe_intermediate_size=INTER,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=E,
        num_experts_per_tok=TOPK,
        norm_topk_prob=True,
    )
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    ckpt = checkpoint()
    experts = model.model.layers[LAYER].mlp.experts
    with torch.no_grad():
        for e in range(E):
            experts.gate_up_proj[e] = torch.cat([ckpt[f"{e}.gate"], ckpt[f"{e}.up"]])
            experts.down_proj[e] = ckpt[f"{e}.down"]
    path = tmp_path_factory.mktemp("engine")
    model.save_pretrained(path)
    engine = EmbeddedEngine(str(path), fp4=True, spec=RecordSpec(moe_layers=(LAYER,)), max_batch=1, max_len=T)
    x, ids, weights = routed_input()
    experts = engine.model.model.layers[LAYER].mlp.experts
    with GemmInputs() as seen:
        experts(x, ids.long(), weights.to(torch.bfloat16))
    w13 = [experts.gate_up_proj[e] for e in range(E)]
    w2 = [experts.down_proj[e] for e in range(E)]
    return rows_by_expert(seen.calls, w13, w2, ascending_tokens(ids))


@pytest.fixture(scope="module")
def sglang_tp1(tmp_path_factory):
    with installed_layer(str(tmp_path_factory.mktemp("store"))) as layer:
        yield run_sglang(layer)


def test_fc1_and_fc2_inputs_are_identical_on_rollout_trainer_and_engine(sglang_tp1, engine_rows):
    sglang, _ = sglang_tp1
    trainer = trainer_rows()
    x, ids, _ = routed_input()
    routed = 0
    for e in range(E):
        tokens = (ids == e).any(dim=1).nonzero().flatten().tolist()
        for t in tokens:
            routed += 1
            for kind in ("fc1", "fc2"):
                s, tr, en = sglang[(e, kind)][t], trainer[(e, kind)][t], engine_rows[(e, kind)][t]
                assert torch.equal(s, tr), (e, t, kind, "rollout vs trainer")
                assert torch.equal(s, en), (e, t, kind, "rollout vs engine")
            # FC2 input: the NVFP4 values of the reference codes of the full row (not the BF16 activation)
            h = trainer[(e, "fc2_bf16")][t]
            assert torch.equal(sglang[(e, "fc2")][t], reference_fc2_rows(h[None])[0])
            assert not torch.equal(sglang[(e, "fc2")][t], h)
    assert routed == T * TOPK


def _tp_worker(rank: int, port: int, store: str, out: dict) -> None:
    from tests.sglang_cpu import init_cpu_parallel_state

    load_trace_plugin()  # a spawned process: SGLang's plugins load per process, as in every scheduler process
    init_cpu_parallel_state(world_size=2, rank=rank, port=port)
    rows, result = run_sglang(sglang_layer(store, tp_group_world=2))
    out[rank] = ({k: {t: r for t, r in v.items()} for k, v in rows.items() if k[1] == "fc2"}, result)


@pytest.mark.slow
def test_fc2_input_codes_do_not_depend_on_moe_tp(sglang_tp1, tmp_path):
    """Two MoE-TP ranks (gloo), each with half of the intermediate: the halves they feed FC2 concatenate to the
    one-rank FC2 input — the row scale comes from the full row (max over the ranks), not from the local half."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    procs = [ctx.Process(target=_tp_worker, args=(r, port, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    full, _ = sglang_tp1
    _, ids, _ = routed_input()
    local_scale_differs = False
    for e in range(E):
        for t in (ids == e).any(dim=1).nonzero().flatten().tolist():
            halves = [out[r][0][(e, "fc2")][t] for r in range(2)]
            h = trainer_rows()[(e, "fc2_bf16")][t]
            assert torch.equal(torch.cat(halves), full[(e, "fc2")][t]), (e, t)
            assert torch.equal(torch.cat(halves), reference_fc2_rows(h[None])[0]), (e, t)
            # with per-shard scales the first half would differ: the test input separates the conventions
            local_scale_differs |= not torch.equal(reference_fc2_rows(h[None, : INTER // 2])[0], halves[0])
    assert local_scale_differs
