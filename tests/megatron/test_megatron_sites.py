"""Trainer-side FP4 sites on a tiny Megatron GPTModel with MoE (local spec, SequentialMLP, gloo, one CPU rank).

The rollout side is emulated independently: the same model in `qat` mode, with a capture tap that turns each
site's input into records through `trace_core.numerics.quant.quantize` + `Record.from_quantized`. The trainer then runs
with perturbed weights (the engine-to-engine difference) and a different micro-batch layout, and every captured site's
output must equal `trace_core.numerics.guided.guided_round` of its input under those records, bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from megatron_trace.config import TraceConfig
from megatron_trace.emulate import emulate_rollout
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.rows import PAD, TokenRows, pack_microbatch
from megatron_trace.session import TraceSession
from megatron_trace.sites import SiteNumerics
from megatron_trace.source import SiteRows
from trace_core.metrics import code_flips as metrics_code_flips
from trace_core.metrics import low_bit_flips
from trace_core.numerics.guided import GuidanceStats, guided_quantize, guided_round
from trace_core.numerics.quant import dequantize, quantize
from trace_core.numerics.recipe import DEFAULT_RECIPE, Scale, get_recipe
from trace_core.records.spec import Record, RecordSpec

CFG = MoEModelConfig()
ALL_SITES = RecordSpec(bits=1, moe_layers=(0, 1), attn_layers=(0, 1))


pytestmark = pytest.mark.usefixtures("megatron_rank")


def trajectories(n: int = 5, seed: int = 0) -> list[tuple[int, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(9, 25, (n,), generator=g).tolist()
    return [(i, torch.randint(0, CFG.vocab, (length,), generator=g)) for i, length in enumerate(lengths)]


def perturb(model: torch.nn.Module, rel: float = 2e-3, seed: int = 1) -> None:
    """The trainer's weights differ slightly from the rollout's, as two engines' BF16 numerics do."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * rel * p.float().abs().mean()).to(p.dtype))


def quantize_as(recipe: str, kind: str, x: torch.Tensor):
    """The reference quantization of rows `x` under the recipe's role `kind`: the default recipe's per-token NVFP4
    MoE input and kv_fp4 K/V, or `nvfp4-w4a4-nvfp4kv`'s NVFP4 K/V at the static S_enc = 1."""
    role = get_recipe(recipe).role(kind)
    scale = {Scale.PER_TOKEN: {"per_token": True}, Scale.STATIC: {"global_scale": 1.0}}.get(role.scale, {})
    return quantize(x, role.fmt, **scale)


def rollout_rows(model, trajs, spec: RecordSpec) -> dict:
    """Independent rollout capture: {(site, traj, pos): rollout-side Quantized of that token row}."""
    table = {}
    recipe = spec.recipe or DEFAULT_RECIPE

    def tap(site, rows, x, y):
        q = quantize_as(recipe, site[1], x.detach())
        assert torch.equal(y, dequantize(q, x.dtype)), f"qat site {site} is not RTN"
        for i in range(len(rows)):
            if rows.traj[i] != PAD:
                table[(site, int(rows.traj[i]), int(rows.pos[i]))] = quantize_as(recipe, site[1], x[i : i + 1].detach())

    session = TraceSession(model, TraceConfig(mode="qat", spec=spec, replay_routes=False), tap=tap)
    mb = pack_microbatch(trajs)
    session.begin_microbatch(mb.rows)
    with torch.no_grad():
        model(mb.input_ids, mb.position_ids, mb.attention_mask)
    session.remove()
    return table


@pytest.mark.parametrize("recipe", [DEFAULT_RECIPE, "nvfp4-w4a4-nvfp4kv"])
@pytest.mark.parametrize("bits", [1, 2, 4])
def test_guided_sites_equal_guided_round_of_rollout_records(bits, recipe):
    """Every captured site guided from its records; padding rows (no record) take the role's RTN: per-token NVFP4
    MoE input, kv_fp4 K/V, or NVFP4 K/V at the static S_enc = 1 under `nvfp4-w4a4-nvfp4kv`."""
    spec = RecordSpec(bits=bits, moe_layers=(0, 1), attn_layers=(0, 1), recipe=recipe)
    model = build_moe_model(CFG, dtype=torch.bfloat16)
    trajs = trajectories()
    expected_records = rollout_rows(model, trajs, spec)
    # Rollout batches differ from the trainer's: other grouping, order and padding.
    source = emulate_rollout(
        model, [pack_microbatch(trajs[:3]), pack_microbatch(trajs[3:])], spec, num_trajectories=5, max_positions=32
    )
    perturb(model)
    taps = []
    session = TraceSession(model, TraceConfig(mode="trace", spec=spec), tap=lambda *a: taps.append(a))
    mb = pack_microbatch([trajs[4], trajs[1], trajs[2]], seq_len=28)
    session.begin_microbatch(mb.rows, source)
    model(mb.input_ids, mb.position_ids, mb.attention_mask).float().sum().backward()
    metrics = session.end_step()
    session.remove()

    assert {t[0] for t in taps} == set(spec.sites())
    redirected = 0
    flipped = {site: 0 for site in spec.sites()}
    compared = {site: 0 for site in spec.sites()}
    for site, rows, x, y in taps:
        for i in range(len(rows)):
            xi, yi = x[i : i + 1].detach(), y[i : i + 1].detach()
            if rows.traj[i] == PAD:
                rtn = dequantize(quantize_as(recipe, site[1], xi), xi.dtype)
                assert torch.equal(yi, rtn), f"{site}: padding row is not RTN"
                continue
            q = expected_records[(site, int(rows.traj[i]), int(rows.pos[i]))]
            stats = GuidanceStats()
            rec = Record.from_quantized(q, bits)
            want = guided_round(xi, rec, bits, stats=stats)
            assert torch.equal(yi, want), f"{site} row {i}: trainer value differs from guided_round"
            redirected += stats.redirected
            # the code-flip count (by the guided kernel's pass for b < 4), against the reference's guided codes
            codes = guided_quantize(xi, rec, bits)[0].codes
            flips = metrics_code_flips(codes, q.codes) if bits == 4 else low_bit_flips(codes, rec.code_bits(), bits)
            flipped[site] += int(flips.sum())
            compared[site] += xi.numel()
    assert redirected > 0, "the perturbation should move some elements across a rounding boundary"
    for site in spec.sites():
        rate = metrics[f"trace/L{site[0]}.{site[1]}/code_flip_rate"]
        assert rate == flipped[site] / compared[site], site
    pad_rows = int((mb.rows.traj == PAD).sum())
    assert metrics["trace/L0.moe_in/rtn_fallback"] == pad_rows * CFG.hidden
    assert metrics["trace/L1.k/rtn_fallback"] == pad_rows * CFG.kv_heads * CFG.head_dim
    assert metrics["trace/rtn_fallback"] == pad_rows * 2 * (CFG.hidden + 2 * CFG.kv_heads * CFG.head_dim)


def test_trace_reproduces_rollout_logits_and_cuts_code_flips():
    model = build_moe_model(CFG, dtype=torch.bfloat16)
    trajs = trajectories(4, seed=3)
    mb = pack_microbatch(trajs)
    source = emulate_rollout(model, [mb], ALL_SITES, num_trajectories=4, max_positions=32)
    # Rollout logits: qat sites with native routing.
    session = TraceSession(model, TraceConfig(mode="qat", spec=ALL_SITES, replay_routes=False))
    session.begin_microbatch(mb.rows)
    with torch.no_grad():
        rollout_logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)
    session.remove()
    # Same weights: guided rounding picks the rollout's codes, R3 its routes, so the logits agree exactly on every
    # token the rollout routed (final tokens carry placeholder routes, padding is not compared).
    session = TraceSession(model, TraceConfig(mode="trace", spec=ALL_SITES))
    session.begin_microbatch(mb.rows, source)
    with torch.no_grad():
        logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)
    session.remove()
    routed = (mb.valid & ~mb.rows.last.view(-1, len(trajs)).t()).bool()
    assert torch.equal(logits[routed], rollout_logits[routed])

    perturb(model)
    flip = {}
    for mode in ("qat", "trace"):
        s = TraceSession(model, TraceConfig(mode=mode, spec=ALL_SITES))
        s.begin_microbatch(mb.rows, source)
        with torch.no_grad():
            model(mb.input_ids, mb.position_ids, mb.attention_mask)
        flip[mode] = s.end_step()
        s.remove()
    for site in ALL_SITES.sites():
        key = f"trace/L{site[0]}.{site[1]}/code_flip_rate"
        assert flip["qat"][key] > flip["trace"][key], key
    assert "trace/L0.moe_in/rtn_fallback" not in flip["qat"]


@pytest.mark.parametrize(("bits", "record_bits"), [(1, 1), (2, 2), (1, 2), (1, 4), (4, 4)])
def test_code_flips_at_a_captured_site_equal_the_references(bits, record_bits):
    """A captured site's code-flip rate: for records of fewer than 4 bits counted by the guided kernel's own pass,
    for whole codes by the reference quantization; both equal the reference's count over the rows with a record."""
    g = torch.Generator().manual_seed(bits * 10 + record_bits)
    x_roll = torch.randn(24, CFG.hidden, generator=g).to(torch.bfloat16)
    x = (x_roll.float() + 0.3 * torch.randn(x_roll.shape, generator=g)).to(torch.bfloat16)  # far: flips happen
    q = quantize_as(DEFAULT_RECIPE, "moe_in", x_roll)
    rec = Record.from_quantized(q, record_bits)
    has = torch.rand(24, generator=g) < 0.7
    spec = RecordSpec(bits=bits, moe_layers=(0,), attn_layers=())
    numerics = SiteNumerics(TraceConfig(mode="trace", spec=spec))
    for _ in range(2):  # two micro-batches add into the same counters
        numerics.activation((0, "moe_in"), x, SiteRows(rec, has))
    codes = guided_quantize(x, rec, bits)[0].codes
    flips = (
        metrics_code_flips(codes, q.codes) if record_bits == 4 else low_bit_flips(codes, rec.code_bits(), record_bits)
    )
    want = int((flips & has.unsqueeze(-1)).sum())
    assert want > 0
    assert numerics.metrics()["trace/L0.moe_in/code_flip_rate"] == want / (int(has.sum()) * CFG.hidden)


def test_uncaptured_sites_use_rtn_and_need_no_record():
    model = build_moe_model(CFG, dtype=torch.bfloat16)
    trajs = trajectories(2, seed=5)
    spec = RecordSpec(bits=2, moe_layers=(1,), attn_layers=(1,))
    source = emulate_rollout(model, [pack_microbatch(trajs)], spec, num_trajectories=2, max_positions=32)
    taps = []
    session = TraceSession(model, TraceConfig(mode="trace", spec=spec), tap=lambda *a: taps.append(a))
    mb = pack_microbatch(trajs)
    session.begin_microbatch(mb.rows, source)
    with torch.no_grad():
        model(mb.input_ids, mb.position_ids, mb.attention_mask)
    metrics = session.end_step()
    for site, _, x, y in taps:
        if site[0] == 0:
            rtn = dequantize(quantize_as(DEFAULT_RECIPE, site[1], x), x.dtype)
            assert torch.equal(y, rtn), site
    assert "trace/L0.moe_in/rtn_fallback" not in metrics and "trace/L1.moe_in/rtn_fallback" in metrics


def test_ste_gradients_are_identity_at_every_site():
    numerics = SiteNumerics(TraceConfig(mode="qat", spec=ALL_SITES))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=g, dtype=torch.float32).to(torch.bfloat16).requires_grad_()
    grad = torch.randn(6, 64, generator=g).to(torch.bfloat16)
    for fn in (
        lambda t: numerics.activation((0, "moe_in"), t, None),
        lambda t: numerics.activation((0, "k"), t, None),
        numerics.weight,
        numerics.fc2_input,
    ):
        x.grad = None
        y = fn(x)
        assert not torch.equal(y, x), "fake quant should change a random tensor"
        y.backward(grad)
        assert torch.equal(x.grad, grad)
    # Experts that receive no token give zero-row inputs.
    empty = torch.zeros(0, 64, dtype=torch.bfloat16, requires_grad=True)
    assert numerics.fc2_input(empty).shape == (0, 64) and numerics.activation((1, "v"), empty, None).shape == (0, 64)


def test_bf16_mode_leaves_the_model_untouched():
    model = build_moe_model(CFG, dtype=torch.bfloat16)
    mb = pack_microbatch(trajectories(2))
    with torch.no_grad():
        ref = model(mb.input_ids, mb.position_ids, mb.attention_mask)
    session = TraceSession(model, TraceConfig(mode="bf16", spec=ALL_SITES, replay_routes=False))
    session.begin_microbatch(mb.rows)
    with torch.no_grad():
        out = model(mb.input_ids, mb.position_ids, mb.attention_mask)
    assert torch.equal(out, ref)


def test_qat_trains_experts_through_the_fake_quant_and_recompute_matches():
    """QAT with probabilities after FC2 gives every expert weight a gradient, and MoE + core-attention
    recomputation (two micro-batches, records replayed from the FIFO) gives the same gradients as none."""
    trajs = trajectories(4, seed=7)
    mbs = [pack_microbatch(trajs[:2]), pack_microbatch(trajs[2:])]
    grads = []
    for overrides in ({}, {"recompute_granularity": "selective", "recompute_modules": ["moe", "core_attn"]}):
        model = build_moe_model(CFG, dtype=torch.float32, **overrides)
        source = emulate_rollout(model, mbs, ALL_SITES, num_trajectories=4, max_positions=32)
        perturb(model)
        session = TraceSession(model, TraceConfig(mode="trace", spec=ALL_SITES))
        for mb in mbs:
            session.begin_microbatch(mb.rows, source)
            out = model(mb.input_ids, mb.position_ids, mb.attention_mask)
            out.square().mean().backward()
        assert not session._pending  # every micro-batch forwarded with grad was backwarded
        session.end_step()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        if "local_experts" in name:
            assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_trace_needs_records_and_matching_rows():
    model = build_moe_model(CFG, dtype=torch.bfloat16)
    trajs = trajectories(2)
    mb = pack_microbatch(trajs)
    source = emulate_rollout(model, [mb], ALL_SITES, num_trajectories=2, max_positions=32)
    session = TraceSession(model, TraceConfig(mode="trace", spec=ALL_SITES, replay_routes=False))
    with pytest.raises(ValueError, match="RolloutSource"):
        session.begin_microbatch(mb.rows, None)
    wrong = pack_microbatch(trajs, seq_len=mb.input_ids.shape[1] + 2)
    session.begin_microbatch(wrong.rows, source)  # identity of a longer batch than the one fed
    with pytest.raises(ValueError, match="rows"), torch.no_grad():
        model(mb.input_ids, mb.position_ids, mb.attention_mask)
    with pytest.raises(RuntimeError, match="already"):
        TraceSession(model, TraceConfig(mode="qat", spec=ALL_SITES, replay_routes=False))
    session.remove()
    s = TraceSession(model, TraceConfig(mode="qat", spec=ALL_SITES, replay_routes=False))
    with torch.no_grad(), pytest.raises(RuntimeError, match="begin_microbatch"):
        model(mb.input_ids, mb.position_ids, mb.attention_mask)
    s.remove()


def test_row_identity_follows_megatron_order_and_sequence_parallel_chunks():
    mb = pack_microbatch([(7, torch.arange(3)), (2, torch.arange(5))])
    # rows are [s, b]: (s0,b0) (s0,b1) (s1,b0) ...
    assert mb.rows.traj.tolist() == [7, 2, 7, 2, 7, 2, PAD, 2, PAD, 2]
    assert mb.rows.pos.tolist() == [0, 0, 1, 1, 2, 2, 0, 3, 0, 4]
    assert mb.rows.last.tolist() == [False, False, False, False, True, False, False, False, False, True]
    assert bool(mb.attention_mask[0, 0, 0, 4]) and not bool(mb.attention_mask[1, 0, 4, 4])
    assert mb.rows.chunk(1, 2).traj.tolist() == [2, PAD, 2, PAD, 2]
    with pytest.raises(ValueError, match="chunks"):
        mb.rows.chunk(0, 3)
    with pytest.raises(ValueError, match="distinct"):
        pack_microbatch([(1, torch.arange(3)), (1, torch.arange(2))])
    with pytest.raises(ValueError, match="int64"):
        TokenRows(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=bool))


def test_records_through_the_store_drive_the_trainer_like_in_memory_records(tmp_path):
    """Rollout records written with the record store's StepWriter and loaded with its RecordReader (in another
    order, trajectory ids replaced by batch slots) give the trainer exactly the values in-memory records give."""
    from megatron_trace.source import source_from_store
    from trace_core.records.layout import TrajectoryRecords
    from trace_core.records.reader import RecordReader
    from trace_core.records.store import StepWriter, finalize_step

    model = build_moe_model(CFG, dtype=torch.bfloat16)
    trajs = trajectories(3, seed=11)
    spec = RecordSpec(bits=2, moe_layers=(1,), attn_layers=(0, 1))
    source = emulate_rollout(model, [pack_microbatch(trajs)], spec, num_trajectories=3, max_positions=32)
    shard = {}
    for t, ids in trajs:
        n = len(ids)
        rows = TokenRows(torch.full((n,), t), torch.arange(n), torch.arange(n) == n - 1)
        records = {site: source.records(site, rows).record for site in spec.sites()}
        routes = torch.stack([source.routes(layer, rows)[0] for layer in (0, 1)], dim=1).to(torch.int32)
        shard[t] = TrajectoryRecords(num_tokens=n, records=records, routes=routes)
    StepWriter(tmp_path, 0).write(shard)
    finalize_step(tmp_path, 0)
    order = [2, 0, 1]
    loaded = RecordReader(tmp_path, 0).load([(order[j], 0, len(trajs[order[j]][1])) for j in range(3)], pad_to=30)
    store_source = source_from_store(loaded, moe_layers=(0, 1), lengths=[len(trajs[k][1]) for k in order])
    perturb(model)

    outputs = []
    for src, mb in (
        (source, pack_microbatch([trajs[k] for k in order], seq_len=30)),
        (store_source, pack_microbatch([(j, trajs[k][1]) for j, k in enumerate(order)], seq_len=30)),
    ):
        taps = []
        session = TraceSession(model, TraceConfig(mode="trace", spec=spec), tap=lambda *a, taps=taps: taps.append(a[3]))
        session.begin_microbatch(mb.rows, src)
        with torch.no_grad():
            logits = model(mb.input_ids, mb.position_ids, mb.attention_mask)
        metrics = session.end_step()
        session.remove()
        outputs.append((logits, taps, metrics))
    (la, ta, ma), (lb, tb, mb_metrics) = outputs
    assert len(ta) == len(tb) and all(torch.equal(a, b) for a, b in zip(ta, tb, strict=True))
    assert torch.equal(la, lb)
    assert ma == mb_metrics and ma["trace/L1.moe_in/redirected"] > 0


def test_records_wider_than_the_spec_guide_like_records_of_the_spec_bits():
    """A rollout that keeps 4 bits (for metrics) guides a b = 1 trainer exactly as a 1-bit capture would, and its
    code flips then compare whole codes."""
    model = build_moe_model(CFG, dtype=torch.bfloat16)
    trajs = trajectories()
    mbs = [pack_microbatch(trajs)]
    wide_spec = RecordSpec(bits=4, moe_layers=(0, 1), attn_layers=(0, 1))
    wide = emulate_rollout(model, mbs, wide_spec, num_trajectories=5, max_positions=32)
    narrow = emulate_rollout(model, mbs, ALL_SITES, num_trajectories=5, max_positions=32)
    perturb(model)
    outputs, flips = [], []
    for source in (wide, narrow):
        taps: list = []
        session = TraceSession(model, TraceConfig(mode="trace", spec=ALL_SITES), tap=lambda *a, t=taps: t.append(a))
        session.begin_microbatch(mbs[0].rows, source)
        with torch.no_grad():
            model(mbs[0].input_ids, mbs[0].position_ids, mbs[0].attention_mask)
        metrics = session.end_step()
        session.remove()
        outputs.append({t[0]: t[3] for t in taps})
        flips.append(metrics)
    assert outputs[0].keys() == outputs[1].keys()
    for site in outputs[0]:
        assert torch.equal(outputs[0][site], outputs[1][site]), site
    assert "trace/flip_distance/1" in flips[0] and "trace/flip_distance/1" not in flips[1]


def test_bf16_session_with_a_tap_sees_every_site_unchanged():
    model = build_moe_model(CFG, dtype=torch.bfloat16)
    mb = pack_microbatch(trajectories())
    taps = []
    cfg = TraceConfig(mode="bf16", spec=ALL_SITES, replay_routes=False)
    session = TraceSession(model, cfg, tap=lambda *a: taps.append(a))
    session.begin_microbatch(mb.rows)
    with torch.no_grad():
        tapped = model(mb.input_ids, mb.position_ids, mb.attention_mask)
    session.remove()
    with torch.no_grad():
        plain = model(mb.input_ids, mb.position_ids, mb.attention_mask)
    assert {t[0] for t in taps} == set(ALL_SITES.sites())
    assert all(t[3] is t[2] for t in taps)
    assert torch.equal(tapped, plain)
