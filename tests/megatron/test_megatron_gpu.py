"""GPU smoke test of the trainer side (run on the H200 with `pytest -m gpu tests/megatron/test_megatron_gpu.py`).

A tiny Megatron MoE in BF16 on CUDA, one NCCL rank: rollout emulation, then a trace-mode forward + backward whose
sites run the Triton kernels; every captured site must equal the CPU reference `guided_round` bit for bit, R3 must
reproduce the routes, and guided rounding must flip fewer codes than QAT.
"""

from __future__ import annotations

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.cpu import init_single_rank
from megatron_trace.emulate import emulate_rollout
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.rows import PAD, pack_microbatch
from megatron_trace.session import TraceSession
from trace_core.numerics.guided import guided_round
from trace_core.records.spec import Record, RecordSpec

pytestmark = pytest.mark.gpu

CFG = MoEModelConfig(hidden=128, layers=4, heads=8, kv_heads=2, head_dim=32, experts=8, topk=2, expert_ffn=64)
SPEC = RecordSpec.default(tuple(range(CFG.layers)), tuple(range(CFG.layers)), bits=1)


def cpu_record(r: Record) -> Record:
    gs = None if r.global_scale is None else r.global_scale.cpu()
    return Record(r.fmt, r.bits, r.n, r.low_bits.cpu(), r.scales.cpu(), gs)


def test_trace_step_on_gpu_matches_the_cpu_reference():
    init_single_rank()
    model = build_moe_model(CFG, dtype=torch.bfloat16)
    assert next(model.parameters()).is_cuda
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(24, 49, (6,), generator=g).tolist()
    trajs = [(i, torch.randint(0, CFG.vocab, (n,), generator=g)) for i, n in enumerate(lengths)]
    rollout_mbs = [pack_microbatch(trajs[:3]).to("cuda"), pack_microbatch(trajs[3:]).to("cuda")]
    source = emulate_rollout(model, rollout_mbs, SPEC, num_trajectories=6, max_positions=64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn_like(p.float()) * 2e-3 * p.float().abs().mean()).to(p.dtype))

    taps, routing = [], {}
    for i, layer in enumerate(model.decoder.layers):
        layer.mlp.router.register_forward_hook(lambda m, a, out, i=i: routing.__setitem__(i, out[1].detach()))
    flips = {}
    for mode in ("qat", "trace"):
        tap = (lambda *a: taps.append(a)) if mode == "trace" else None
        session = TraceSession(model, TraceConfig(mode=mode, spec=SPEC), tap=tap)
        mb = pack_microbatch([trajs[5], trajs[0], trajs[3]], seq_len=64).to("cuda")
        session.begin_microbatch(mb.rows, source)
        logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)
        logits.float().logsumexp(-1)[mb.valid].mean().backward()
        flips[mode] = session.end_step()
        session.remove()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        model.zero_grad(set_to_none=True)

    captured = set(SPEC.sites())
    assert captured <= {t[0] for t in taps}
    for site, rows, x, y in taps:
        if site not in captured:
            continue
        site_rows = source.records(site, rows)
        want = guided_round(
            x.detach().cpu(), cpu_record(site_rows.record), SPEC.bits, has_record=site_rows.has_record.cpu()
        )
        assert torch.equal(y.detach().cpu(), want), f"{site}: Triton guided fake-quant differs from the reference"
    keep = (mb.rows.traj != PAD) & ~mb.rows.last
    for layer, routing_map in routing.items():
        idx, _ = source.routes(layer, mb.rows)
        want = torch.zeros_like(routing_map).scatter_(1, idx, True)
        assert torch.equal(routing_map[keep], want[keep]), f"R3 did not replay layer {layer}"
    for site in captured:
        key = f"trace/L{site[0]}.{site[1]}/code_flip_rate"
        assert flips["trace"][key] < flips["qat"][key], key
