"""Site state keyed by micro-batch: forward-only passes keep nothing, recomputation in a micro-batch's backward
reads that micro-batch's records and routes in any backward order, leftovers at `end_step` are errors, and the
settings the sites do not handle are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_trace.config import TraceConfig, check_megatron_config
from megatron_trace.emulate import emulate_rollout
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.rows import pack_microbatch
from megatron_trace.session import TraceSession
from trace_core.records.spec import RecordSpec

CFG = MoEModelConfig()
SPEC = RecordSpec(bits=1, moe_layers=(0, 1), attn_layers=(0, 1))
RECOMPUTE = {"recompute_granularity": "selective", "recompute_modules": ["moe", "core_attn"]}


pytestmark = pytest.mark.usefixtures("megatron_rank")


def _batches():
    g = torch.Generator().manual_seed(3)
    trajs = [(i, torch.randint(0, CFG.vocab, (n,), generator=g)) for i, n in enumerate((11, 17, 9, 14, 20, 12))]
    return [pack_microbatch(trajs[0:2]), pack_microbatch(trajs[2:4]), pack_microbatch(trajs[4:6])]


def _setup(recompute: bool):
    """A perturbed trainer model (fp32) under a trace session, and the rollout source of all micro-batches."""
    model = build_moe_model(CFG, dtype=torch.float32, **(RECOMPUTE if recompute else {}))
    mbs = _batches()
    source = emulate_rollout(model, mbs, SPEC, num_trajectories=6, max_positions=32)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 3e-2 * p.abs().mean())
    return model, TraceSession(model, TraceConfig(mode="trace", spec=SPEC)), source, mbs


def _forward(model, session, source, mb):
    session.begin_microbatch(mb.rows, source)
    return model(mb.input_ids, mb.position_ids, mb.attention_mask).square().mean()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference() -> dict[str, torch.Tensor]:
    """Gradients of micro-batches 1 and 2 without recomputation: nothing to replay, so nothing to get wrong."""
    model, session, source, mbs = _setup(recompute=False)
    for mb in mbs[1:]:
        _forward(model, session, source, mb).backward()
    session.end_step()
    return _grads(model)


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_forward_only_pass_leaves_nothing_a_recompute_would_replay():
    """The stale-queue bug: a no-grad forward (logp_old, evaluation) of micro-batch 0 before a training step on
    micro-batches 1, 2 with MoE + core-attention recomputation. With a global FIFO the recomputation replayed
    micro-batch 0's records and routes (relative gradient error 1.22 on an expert weight, no error raised)."""
    model, session, source, mbs = _setup(recompute=True)
    with torch.no_grad():
        _forward(model, session, source, mbs[0])
    for mb in mbs[1:]:
        _forward(model, session, source, mb).backward()
    assert not session._pending
    session.end_step()
    _assert_same(_grads(model), _reference())


def test_recompute_follows_each_micro_batch_in_any_backward_order():
    """Both forwards first, then the backwards in reverse order (a FIFO would pop micro-batch 1's state for 2)."""
    model, session, source, mbs = _setup(recompute=True)
    losses = [_forward(model, session, source, mb) for mb in mbs[1:]]
    with torch.no_grad():  # a forward-only pass between forwards and backwards
        _forward(model, session, source, mbs[0])
    for loss in reversed(losses):
        loss.backward()
    session.end_step()
    _assert_same(_grads(model), _reference())


def test_leftover_micro_batch_and_missing_begin_are_errors():
    model, session, source, mbs = _setup(recompute=True)
    _forward(model, session, source, mbs[0])  # with grad, never backwarded
    with pytest.raises(RuntimeError, match="never backwarded"):
        session.end_step()
    session.begin_microbatch(mbs[1].rows, source)
    with torch.no_grad():
        model(mbs[1].input_ids, mbs[1].position_ids, mbs[1].attention_mask)
        with pytest.raises(RuntimeError, match="begin_microbatch"):  # one begin per forward
            model(mbs[1].input_ids, mbs[1].position_ids, mbs[1].attention_mask)
    session.end_step()
    session.begin_microbatch(mbs[1].rows, source)
    with pytest.raises(NotImplementedError, match="packed_seq_params"):
        model(mbs[1].input_ids, mbs[1].position_ids, mbs[1].attention_mask, packed_seq_params=object())
    session.remove()


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("moe_expert_capacity_factor", 1.0, ValueError),
        ("moe_token_dropping", True, ValueError),
        ("overlap_moe_expert_parallel_comm", True, NotImplementedError),
    ],
)
def test_unhandled_settings_are_refused_by_name(field, value, error):
    model = build_moe_model(CFG)
    bad = copy.copy(model.config)
    setattr(bad, field, value)
    with pytest.raises(error, match=field):
        check_megatron_config(bad, TraceConfig(mode="qat"))


def test_shared_expert_overlap_refused_when_shared_experts_see_fp4_input():
    model = build_moe_model(CFG)
    bad = copy.copy(model.config)
    bad.moe_shared_expert_overlap, bad.moe_shared_expert_intermediate_size = True, 64
    with pytest.raises(NotImplementedError, match="moe_shared_expert_overlap"):
        check_megatron_config(bad, TraceConfig(mode="trace"))
    check_megatron_config(bad, TraceConfig(mode="bf16"))  # BF16: the shared experts see BF16 anyway
