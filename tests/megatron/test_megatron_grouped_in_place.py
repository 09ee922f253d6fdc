"""TRACE grouped experts with the expert weights fake-quantized in place (`TraceConfig.expert_weights_in_place`):
the same values, outputs, FP4 codes and gradients as the per-step copy, over optimizer steps on FP32 masters; no
weight copy kept; stale or never-quantized weights refused; why quantization happens once per master write."""

from __future__ import annotations

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.emulate import emulate_rollout
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.rows import pack_microbatch
from megatron_trace.session import TraceSession
from megatron_trace.sites import expert_weight_fake_quant
from tests.megatron.test_megatron_grouped import ALL_SITES, CFG, moe_saved_bytes, trajectories
from trace_core.numerics.recipe import get_recipe
from trace_core.numerics.role_quant import quantize_role

pytestmark = pytest.mark.usefixtures("megatron_rank")


def train(model: torch.nn.Module, mode: str, in_place: bool, mbs, source, steps: int = 2):
    """`steps` optimizer steps (two micro-batches each, MoE recompute) with SGD on FP32 masters copied into the BF16
    parameters after each step, as the trainer does. Per step: logits, every parameter's gradient, and the expert
    parameters' values during the step."""
    params = dict(model.named_parameters())
    masters = {n: p.detach().float().clone() for n, p in params.items()}
    opt = torch.optim.SGD(list(masters.values()), lr=0.5)
    session = TraceSession(model, TraceConfig(mode=mode, spec=ALL_SITES, expert_weights_in_place=in_place))
    out = []
    for _ in range(steps):
        if in_place:
            session.quantize_weights_in_place()
        used = {n: p.detach().clone() for n, p in params.items() if ".experts." in n}
        logits = []
        for mb in mbs:
            session.begin_microbatch(mb.rows, source)
            y = model(mb.input_ids, mb.position_ids, mb.attention_mask)
            y.float().square().mean().backward()
            logits.append(y.detach())
        session.end_step()
        grads = {n: p.grad.clone() for n, p in params.items()}
        for n, p in params.items():
            masters[n].grad = p.grad.float()
        opt.step()
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(masters[n])
        out.append((logits, grads, used))
    session.remove()
    return out, masters


@pytest.mark.parametrize("mode", ["qat", "trace"])
def test_in_place_weights_match_the_weight_copy_bit_for_bit_over_optimizer_steps(mode):
    check_in_place_matches_copy(mode)


def check_in_place_matches_copy(mode: str) -> None:
    """BF16 model, same initial weights: the parameters hold exactly the copy path's fake-quantized values (so the
    same FP4 codes), and logits, gradients of every parameter (the experts' inputs included) and the masters after
    two steps are identical, atol=0: the straight-through gradient reaches the masters unchanged."""
    trajs = trajectories(4, seed=5)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mbs = [pack_microbatch(trajs[:2]).to(device), pack_microbatch(trajs[2:]).to(device)]
    overrides = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
    copy, in_place = (build_moe_model(CFG, dtype=torch.bfloat16, grouped=True, **overrides) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(copy.parameters(), in_place.parameters(), strict=True))
    source = emulate_rollout(copy, mbs, ALL_SITES, num_trajectories=4, max_positions=32)
    w0 = {n: p.detach().clone() for n, p in copy.named_parameters() if ".experts." in n}
    (ref, ref_masters), (got, got_masters) = (train(m, mode, m is in_place, mbs, source) for m in (copy, in_place))
    role = TraceConfig(mode=mode, spec=ALL_SITES).role("weights")
    for (l_r, g_r, _), (l_g, g_g, used) in zip(ref, got, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(l_r, l_g, strict=True))
        assert g_r.keys() == g_g.keys() and all(torch.equal(g_r[n], g_g[n]) for n in g_r)
        assert all(bool(g_g[n].abs().sum() > 0) for n in used)
    for n, w in w0.items():  # step 1: the initial weights' fake-quant, codes included
        q = expert_weight_fake_quant(w, role)
        assert torch.equal(got[0][2][n], q)
        assert all(torch.equal(quantize_role(role, q[e]).codes, quantize_role(role, w[e]).codes) for e in range(len(w)))
    assert all(torch.equal(ref_masters[n], got_masters[n]) for n in ref_masters)
    assert any(not torch.equal(got[0][2][n], got[1][2][n]) for n in w0)  # the steps moved the weights


def test_in_place_weights_keep_no_weight_copy():
    """Issue-15 memory target with the weight copy counted: in `qat` / `trace` the MoE layers keep at most 1.1 x
    what `bf16` keeps (hidden / FFN = 8 / 3 as Qwen3-30B-A3B); the per-step copy path keeps the copy on top."""
    cfg = MoEModelConfig(hidden=128, expert_ffn=48)
    mb = pack_microbatch(trajectories(4, seed=7))
    model = build_moe_model(cfg, grouped=True)
    source = emulate_rollout(model, [mb], ALL_SITES, num_trajectories=4, max_positions=32)
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    weight_copy = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    bf16 = moe_saved_bytes(model, "bf16", mb, source)
    for mode in ("qat", "trace"):
        copied = moe_saved_bytes(model, mode, mb, source)
        assert copied > 1.1 * bf16 and copied >= weight_copy  # what in place removes
        in_place = moe_saved_bytes(model, mode, mb, source, in_place=True)
        assert in_place <= 1.1 * bf16, (in_place, bf16, weight_copy)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(masters[n])


def test_in_place_weights_refuse_stale_or_unquantized_weights():
    """The forward refuses weights that were never quantized in place or were written since (an optimizer step
    without `quantize_weights_in_place`); SequentialMLP and a config without the flag are refused by name."""
    mb = pack_microbatch(trajectories(2, seed=1))
    model = build_moe_model(CFG, grouped=True)
    session = TraceSession(
        model, TraceConfig(mode="qat", spec=ALL_SITES, replay_routes=False, expert_weights_in_place=True)
    )

    def forward():
        session.begin_microbatch(mb.rows)
        with torch.no_grad():
            return model(mb.input_ids, mb.position_ids, mb.attention_mask)

    with pytest.raises(RuntimeError, match="quantize_weights_in_place"):
        forward()
    session.quantize_weights_in_place()
    first = forward()
    with torch.no_grad():
        model.decoder.layers[1].mlp.experts.linear_fc2.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="written after their in-place fake-quant"):
        forward()
    session.quantize_weights_in_place()
    assert not torch.equal(forward(), first)
    session.remove()
    assert model.decoder.layers[0].mlp.experts.linear_fc1.quantized_version is None  # bf16 again, no check
    plain = TraceSession(model, TraceConfig(mode="qat", spec=ALL_SITES))
    with pytest.raises(ValueError, match="expert_weights_in_place=True"):
        plain.quantize_weights_in_place()
    plain.remove()
    with pytest.raises(
        NotImplementedError, match="expert_weights_in_place needs the TRACE grouped experts, not SequentialMLP"
    ):
        TraceSession(build_moe_model(CFG), TraceConfig(mode="qat", spec=ALL_SITES, expert_weights_in_place=True))


def test_requantizing_nvfp4_weights_is_not_the_identity_for_subnormal_block_scales():
    """Why the parameters are quantized once per master write and never again: RTN of already fake-quantized NVFP4
    weights returns them unchanged when every block scale is a normal E4M3 number, but not when a block's amax is
    so far below the matrix amax that its scale is subnormal (block amax < ~amax * 2^-6 / 448)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4, 64, 256, generator=g) * 0.02).bfloat16()
    q = expert_weight_fake_quant(w)
    assert torch.equal(expert_weight_fake_quant(q), q)
    tiny = w.clone()
    tiny[:, :, :16] *= torch.exp(torch.empty(4, 64, 1).uniform_(-14, -6, generator=g)).bfloat16()
    q = expert_weight_fake_quant(tiny)
    assert not torch.equal(expert_weight_fake_quant(q), q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", ["nvfp4-w4a4-kv4", "mxfp4-w4a4-kv4"])
def test_expert_weight_fake_quant_into_its_own_storage(recipe, dtype):
    check_fake_quant_into_own_storage(recipe, "cpu", dtype)


def check_fake_quant_into_own_storage(recipe: str, device: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """The fake-quant written over the weights it reads (`out=w`, the in-place path) equals a fresh output bit for
    bit, including a matrix whose amax comes from a negative element and an all-zero matrix; BF16 parameters and
    FP32 ones (the FP32 trainer's, which `verify_in_place_weights` checks against the fresh output)."""
    role = get_recipe(recipe).weights
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(5, 48, 256, generator=g) * 0.02).to(dtype).to(device)
    w[1, 7, 9] = -1.5
    w[4] = 0
    ref = expert_weight_fake_quant(w, role)
    assert expert_weight_fake_quant(w, role, out=w) is w
    assert torch.equal(w, ref)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        expert_weight_fake_quant(ref, role, out=torch.empty(5, 256, 48, dtype=w.dtype, device=device).transpose(1, 2))
