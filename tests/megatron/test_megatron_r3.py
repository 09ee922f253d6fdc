"""R3 on a tiny Megatron MoE (CPU, gloo): the rollout's routes replace the router's top-k in the forward and in the
recomputation during backward; bad or missing routes and router fusion are refused."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_trace.config import TraceConfig, check_megatron_config
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.rows import pack_microbatch
from megatron_trace.session import TraceSession
from megatron_trace.source import TensorRolloutSource
from trace_core.records.spec import RecordSpec

CFG = MoEModelConfig(layers=2)
T, P = 3, 20


pytestmark = pytest.mark.usefixtures("megatron_rank")


LENGTHS = (12, 17, 9)


def random_routes(seed: int = 0) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Distinct random experts per token, different from what the router would pick on its own; like SGLang, no
    route for each trajectory's final token."""
    g = torch.Generator().manual_seed(seed)
    has = torch.arange(P)[None, :] < torch.tensor(LENGTHS)[:, None] - 1
    routes = {}
    for layer in range(CFG.layers):
        idx = torch.rand(T, P, CFG.experts, generator=g).argsort(dim=-1)[..., : CFG.topk]
        routes[layer] = (idx, has.clone())
    return routes


def batch(lengths=LENGTHS):
    g = torch.Generator().manual_seed(1)
    return pack_microbatch([(i, torch.randint(0, CFG.vocab, (n,), generator=g)) for i, n in enumerate(lengths)])


def chosen(routing_map: torch.Tensor) -> list[set[int]]:
    return [set(r.nonzero().flatten().tolist()) for r in routing_map]


@pytest.mark.parametrize("recompute", [False, True])
def test_replay_makes_routing_identical_to_given_routes(recompute):
    overrides = {"recompute_granularity": "selective", "recompute_modules": ["moe"]} if recompute else {}
    model = build_moe_model(CFG, **overrides)
    routes = random_routes()
    source = TensorRolloutSource({}, routes)
    mb = batch()
    seen: dict[int, list] = {i: [] for i in range(CFG.layers)}
    for i, layer in enumerate(model.decoder.layers):
        layer.mlp.router.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[1].detach().clone()))
    session = TraceSession(model, TraceConfig(mode="bf16", spec=RecordSpec(), replay_routes=True))
    session.begin_microbatch(mb.rows, source)
    out = model(mb.input_ids, mb.position_ids, mb.attention_mask)
    out.float().square().mean().backward()
    metrics = session.end_step()
    rows = mb.rows
    check = ~rows.is_pad & ~rows.last
    for layer in range(CFG.layers):
        assert len(seen[layer]) == (2 if recompute else 1)  # forward, then recomputation in backward
        idx, _ = routes[layer]
        pairs = zip(rows.traj[check].tolist(), rows.pos[check].tolist(), strict=True)
        want = [set(idx[t, p].tolist()) for t, p in pairs]
        for routing_map in seen[layer]:
            assert [s for s, k in zip(chosen(routing_map), check.tolist(), strict=True) if k] == want
        router = model.decoder.layers[layer].mlp.router
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0  # gates still train
        assert router.router_replay.replay_backward_list == []
    assert metrics["r3/placeholder_rows"] == CFG.layers * int((rows.is_pad | rows.last).sum())


def test_missing_duplicate_and_out_of_range_routes_are_errors():
    model = build_moe_model(CFG)
    mb = batch()
    session = TraceSession(model, TraceConfig(mode="bf16", spec=RecordSpec()))
    routes = random_routes()
    routes[1][1][2, 5] = False  # trajectory 2, position 5: a token in the middle
    session.begin_microbatch(mb.rows, TensorRolloutSource({}, routes))  # builds indices without reading back
    with pytest.raises(ValueError, match=r"missing .*trajectory 2, position 5"):
        session.check_routes()
    routes = random_routes()
    routes[0][0][1, 3] = torch.tensor([2, 2])
    session.begin_microbatch(mb.rows, TensorRolloutSource({}, routes))  # builds indices without reading back
    with pytest.raises(ValueError, match=r"duplicate expert ids .*trajectory 1, position 3"):
        session.check_routes()
    routes = random_routes()
    routes[0][0][0, 0, 0] = CFG.experts
    session.begin_microbatch(mb.rows, TensorRolloutSource({}, routes))  # builds indices without reading back
    with pytest.raises(ValueError, match="out of range"):
        session.check_routes()
    with pytest.raises(ValueError, match="RolloutSource"):
        session.begin_microbatch(mb.rows, None)
    with pytest.raises(KeyError, match="no routes for MoE layer 1"):
        session.begin_microbatch(mb.rows, TensorRolloutSource({}, {0: random_routes()[0]}))
    session.remove()


def test_router_fusion_and_missing_replay_flag_are_refused():
    model = build_moe_model(CFG)
    fused = copy.copy(model.config)
    fused.moe_router_fusion = True
    with pytest.raises(ValueError, match="moe_router_fusion"):
        check_megatron_config(fused, TraceConfig(mode="bf16"))
    check_megatron_config(fused, TraceConfig(mode="bf16", replay_routes=False))
    no_replay = build_moe_model(CFG, routing_replay=False)
    with pytest.raises(ValueError, match="moe_enable_routing_replay"):
        TraceSession(no_replay, TraceConfig(mode="bf16"))
    for field, value in (("fp8", "e4m3"), ("moe_apply_probs_on_input", True), ("gradient_accumulation_fusion", True)):
        bad = copy.copy(model.config)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=field):
            check_megatron_config(bad, TraceConfig(mode="qat", replay_routes=False))
    cp = copy.copy(model.config)
    cp.context_parallel_size = 2
    with pytest.raises(NotImplementedError, match="context parallel"):
        check_megatron_config(cp, TraceConfig(mode="qat"))
