"""TRACE grouped experts (`megatron_trace.grouped`) on a tiny Megatron GPTModel (gloo, one CPU rank): Megatron's
TEGroupedMLP with our grouped_mm linears against SequentialMLP on the same weights, the row-scaled FC2 against its
twin, checkpoint keys, the once-per-step expert-weight fake-quant and what the autograd graph keeps (saved bytes per
mode), and the sites under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megatron_trace.sites as sites_mod
from megatron_trace.config import TraceConfig
from megatron_trace.emulate import emulate_rollout
from megatron_trace.grouped import (
    TraceGroupedLinear,
    group_offsets,
    grouped_expert_names,
    is_trace_grouped,
    row_scaled_grouped_mm,
    row_scaled_grouped_mm_reference,
)
from megatron_trace.model import MoEModelConfig, build_moe_model
from megatron_trace.rows import pack_microbatch
from megatron_trace.session import TraceSession
from megatron_trace.sites import SiteNumerics, expert_weight_fake_quant
from megatron_trace.source import SiteRows
from trace_core.numerics.quant import quantize
from trace_core.numerics.role_quant import quantize_role
from trace_core.records.spec import Record, RecordSpec

CFG = MoEModelConfig()
ALL_SITES = RecordSpec(bits=1, moe_layers=(0, 1), attn_layers=(0, 1))


pytestmark = pytest.mark.usefixtures("megatron_rank")


def trajectories(n: int = 4, seed: int = 0) -> list[tuple[int, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(9, 25, (n,), generator=g).tolist()
    return [(i, torch.randint(0, CFG.vocab, (length,), generator=g)) for i, length in enumerate(lengths)]


def grouped_twin(seq_model: torch.nn.Module, **overrides) -> torch.nn.Module:
    """A grouped-experts model with the weights of a SequentialMLP model (its parameters in SequentialMLP names,
    mapped by `grouped_expert_names`)."""
    model = build_moe_model(CFG, dtype=next(seq_model.parameters()).dtype, grouped=True, **overrides)
    full = dict(seq_model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            names = grouped_expert_names(name, 0, p.shape[0])
            p.copy_(torch.stack([full.pop(n) for n in names]) if names else full.pop(name))
    assert not full, sorted(full)  # every SequentialMLP parameter has its place
    return model


def stacked(model: torch.nn.Module, layer: int, linear: str, grad: bool = False) -> torch.Tensor:
    """Expert weights (or their gradients) of one linear of a layer as `[E, out, in]`."""
    experts = model.decoder.layers[layer].mlp.experts
    ws = [getattr(experts, linear).weight] if is_trace_grouped(experts) else None
    if ws is None:
        ws = [getattr(e, linear).weight for e in experts.local_experts]
    ts = [w.grad if grad else w for w in ws]
    return ts[0] if is_trace_grouped(experts) else torch.stack(ts)


def test_spec_builds_te_grouped_mlp_with_the_checkpoint_keys_of_sequential_mlp():
    seq = build_moe_model(CFG)
    grp = grouped_twin(seq)
    assert all(is_trace_grouped(layer.mlp.experts) for layer in grp.decoder.layers)
    # Local state dict: TE GroupedLinear naming (weight0 .. weight{E-1}), and it loads back.
    keys = [k for k in grp.state_dict() if ".experts." in k]
    assert keys[:2] == [
        "decoder.layers.0.mlp.experts.linear_fc1.weight0",
        "decoder.layers.0.mlp.experts.linear_fc1.weight1",
    ]
    other = build_moe_model(CFG, grouped=True, seed=3)
    other.load_state_dict(grp.state_dict())
    assert torch.equal(stacked(other, 1, "linear_fc2"), stacked(seq, 1, "linear_fc2"))

    # Sharded state dict: the same sharded keys, global shapes and expert offsets as SequentialMLP's.
    def expert_shards(model):
        out = {}
        for sh in model.sharded_state_dict().values():
            if "experts" not in sh.key or "_extra_state" in sh.key:
                continue
            for t in sh.build() if hasattr(sh, "build") else [sh]:  # gate/up factory -> two shards
                out[(t.key, t.global_offset)] = (t.global_shape, t.data)
        return out

    # Global naming (the parallel layouts' full state dicts): an EP rank's rows map to its experts' SequentialMLP names.
    assert grouped_expert_names("decoder.layers.3.mlp.experts.linear_fc2.weight", 8, 2) == [
        "decoder.layers.3.mlp.experts.local_experts.8.linear_fc2.weight",
        "decoder.layers.3.mlp.experts.local_experts.9.linear_fc2.weight",
    ]
    assert grouped_expert_names("decoder.layers.3.mlp.router.weight", 8, 2) is None

    a, b = expert_shards(seq), expert_shards(grp)
    assert a and a.keys() == b.keys()
    for key, (shape, data) in a.items():
        assert b[key][0] == shape and torch.equal(b[key][1], data), key


@pytest.mark.parametrize("mode", ["bf16", "qat", "trace"])
def test_grouped_experts_match_sequential_mlp_bit_for_bit(mode):
    check_grouped_matches_sequential(mode, torch.float32)


@pytest.mark.parametrize(
    ("recipe", "moe_layers"),
    [("mxfp4-w4a4-kv4", (0, 1)), ("mxfp4-w4a8-kv4", ())],  # W4A8 records no MoE input
)
def test_grouped_experts_match_sequential_mlp_under_other_recipes(recipe, moe_layers):
    """The grouped path asks the recipe for its weight and FC2-input formats as SequentialMLP's sites do."""
    spec = RecordSpec(bits=1, moe_layers=moe_layers, attn_layers=(0, 1), recipe=recipe)
    check_grouped_matches_sequential("trace", torch.float32, spec)


def check_grouped_matches_sequential(mode: str, dtype: torch.dtype, spec: RecordSpec = ALL_SITES) -> None:
    """Same weights, same micro-batches (two, with MoE recompute): same fake-quantized expert weights (hence FP4
    codes), same FC2 inputs, logits, and gradients of every parameter, atol=0."""
    trajs = trajectories(4, seed=5)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mbs = [pack_microbatch(trajs[:2]).to(device), pack_microbatch(trajs[2:]).to(device)]
    overrides = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}
    seq = build_moe_model(CFG, dtype=dtype, **overrides)
    grp = grouped_twin(seq, **overrides)
    source = emulate_rollout(seq, mbs, spec, num_trajectories=4, max_positions=32)
    results = []
    for model in (seq, grp):
        fc2_in: list[torch.Tensor] = []

        def keep(module, args, fc2_in=fc2_in):
            fc2_in.append(args[0].detach().clone())

        hooks = [
            m.register_forward_pre_hook(keep)
            for layer in model.decoder.layers
            for m in (
                [e.linear_fc2 for e in layer.mlp.experts.local_experts]
                if hasattr(layer.mlp.experts, "local_experts")
                else [layer.mlp.experts.linear_fc2]
            )
        ]
        session = TraceSession(model, TraceConfig(mode=mode, spec=spec))
        logits = []
        for mb in mbs:
            session.begin_microbatch(mb.rows, source)
            out = model(mb.input_ids, mb.position_ids, mb.attention_mask)
            out.square().mean().backward()
            logits.append(out.detach())
        metrics = session.end_step()
        for h in hooks:
            h.remove()
        session.remove()
        grads = {n: p.grad for n, p in model.named_parameters() if ".experts." not in n}
        expert_grads = [
            stacked(model, i, lin, grad=True) for i in range(CFG.layers) for lin in ("linear_fc1", "linear_fc2")
        ]
        results.append((torch.cat(fc2_in), logits, grads, expert_grads, metrics))
    (f_s, l_s, g_s, e_s, m_s), (f_g, l_g, g_g, e_g, m_g) = results
    assert torch.equal(f_s, f_g)  # all FC2 input rows, in expert order, forward and recompute
    assert all(torch.equal(a, b) for a, b in zip(l_s, l_g, strict=True))
    assert m_s == m_g
    assert g_s.keys() == g_g.keys() and all(bool(e.abs().sum() > 0) for e in e_g)
    if mode == "bf16":  # Megatron's own probability placement in both: the same gradients bit for bit
        assert all(torch.equal(g_s[n], g_g[n]) for n in g_s)
        assert all(torch.equal(a, b) for a, b in zip(e_s, e_g, strict=True))
    else:  # probabilities after FC2: the grouped FC2 takes their gradient on its input side (other rounding)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        pairs = [(n, g_s[n], g_g[n]) for n in g_s] + [("experts", a, b) for a, b in zip(e_s, e_g, strict=True)]
        for name, a, b in pairs:
            assert float((b.float() - a.float()).norm() / a.float().norm()) < tol, name
    if mode != "bf16":  # weight FP4 codes: all experts in one launch = each matrix on its own
        numerics = SiteNumerics(TraceConfig(mode=mode, spec=spec))
        role = numerics.cfg.role("weights")
        for i in range(CFG.layers):
            for lin in ("linear_fc1", "linear_fc2"):
                w = stacked(grp, i, lin)
                ours = expert_weight_fake_quant(w, role)
                theirs = torch.stack([numerics.weight(we) for we in stacked(seq, i, lin)])
                assert torch.equal(ours, theirs)
                codes = [quantize_role(role, ours[e]).codes for e in range(CFG.experts)]
                assert all(torch.equal(c, quantize_role(role, theirs[e]).codes) for e, c in enumerate(codes))


@pytest.mark.parametrize(
    ("dtype", "scale_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_row_scaled_fc2_matches_its_twin_and_the_unfused_product(dtype, scale_dtype):
    check_row_scaled_fc2(dtype, scale_dtype, "cuda" if torch.cuda.is_available() else "cpu")


def check_row_scaled_fc2(dtype: torch.dtype, scale_dtype: torch.dtype, device: str) -> None:
    """FC2 with the top-k weights on its output rows: output and gradients equal the per-expert-loop twin bit for
    bit (an expert without rows, a zero weight included); against autograd of the unfused `(grouped_mm * scale)`
    the output and the weight gradient are bit-identical, the input and scale gradients the same up to rounding."""
    g = torch.Generator().manual_seed(1)
    counts = [5, 0, 9, 3]
    n, out_f, in_f = sum(counts), 48, 32

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device, dt)

    x, w, grad = rand(n, in_f), rand(len(counts), out_f, in_f), rand(n, out_f)
    scale = torch.rand(n, generator=g).to(device, scale_dtype)
    scale[3] = 0
    offs = group_offsets(counts, torch.device(device))
    leaves = [t.clone().requires_grad_() for t in (x, w, scale)]
    out = row_scaled_grouped_mm(leaves[0], leaves[1], offs, leaves[2])
    dx, dw, dscale = torch.autograd.grad(out, leaves, grad)
    ref = row_scaled_grouped_mm_reference(x, w, counts, scale, grad)
    assert all(torch.equal(a, b) for a, b in zip((out, dx, dw, dscale), ref, strict=True))
    leaves = [t.clone().requires_grad_() for t in (x, w, scale)]
    unfused = (F.grouped_mm(leaves[0], leaves[1].transpose(-2, -1), offs=offs) * leaves[2].unsqueeze(-1)).to(dtype)
    dx_u, dw_u, dscale_u = torch.autograd.grad(unfused, leaves, grad)
    assert torch.equal(out, unfused) and torch.equal(dw, dw_u)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in ((dx, dx_u), (dscale, dscale_u)):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < tol
    assert not dx[3].any() and dscale[3] != 0  # a zero weight stops the input gradient, not its own


def moe_saved_bytes(model: torch.nn.Module, mode: str, mb, source, *, in_place: bool = False) -> int:
    """Bytes of the tensors the autograd graph keeps from inside the MoE layers for one micro-batch: activations and
    the step's fake-quantized expert weights; parameters excluded (`in_place`: the weights are fake-quantized in
    the parameters, `TraceConfig.expert_weights_in_place`)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    inside = [False]
    total = 0

    def pack(t):
        nonlocal total
        s = t.untyped_storage()
        if inside[0] and s.data_ptr() not in params and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
        return t

    hooks = []
    for layer in model.decoder.layers:
        hooks.append(layer.mlp.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
        hooks.append(layer.mlp.register_forward_hook(lambda *_: inside.__setitem__(0, False)))
    session = TraceSession(model, TraceConfig(mode=mode, spec=ALL_SITES, expert_weights_in_place=in_place))
    if in_place:
        session.quantize_weights_in_place()
    session.begin_microbatch(mb.rows, source)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(mb.input_ids, mb.position_ids, mb.attention_mask).square().mean()
    loss.backward()
    session.end_step()
    session.remove()
    for h in hooks:
        h.remove()
    return total


def test_moe_layers_save_at_most_bf16_activations_plus_the_weight_copy_in_qat_and_trace():
    """Issue-15 memory target on the expert block, as saved bytes: what the MoE layers keep for the backward in
    `qat` / `trace` is at most 1.1 x what they keep in `bf16`, plus the step's one fake-quantized copy of the expert
    weights (hidden / FFN = 8 / 3 as Qwen3-30B-A3B). Without the row-scaled FC2 the FC2 output rows stayed in the
    graph for the top-k weights' gradient (1.18 x at these shapes)."""
    cfg = MoEModelConfig(hidden=128, expert_ffn=48)
    trajs = trajectories(4, seed=7)
    mb = pack_microbatch(trajs)
    model = build_moe_model(cfg, grouped=True)
    source = emulate_rollout(model, [mb], ALL_SITES, num_trajectories=4, max_positions=32)
    weight_copy = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    saved = {mode: moe_saved_bytes(model, mode, mb, source) for mode in ("bf16", "qat", "trace")}
    for mode in ("qat", "trace"):
        assert saved[mode] <= 1.1 * saved["bf16"] + weight_copy, (saved, weight_copy)
    assert saved["qat"] >= weight_copy  # the copy is kept (once), not recomputed


def test_expert_weights_fake_quantized_once_per_step(monkeypatch):
    """Two micro-batches with MoE recompute: one fake-quant per grouped linear per step (2 per MoE layer); an
    optimizer step (in-place update) or a new step recomputes it; the straight-through gradient is exact."""
    calls = []

    def counting(w, role):
        calls.append(tuple(w.shape))
        return expert_weight_fake_quant(w, role)

    monkeypatch.setattr(sites_mod, "expert_weight_fake_quant", counting)
    trajs = trajectories(4, seed=2)
    mbs = [pack_microbatch(trajs[:2]), pack_microbatch(trajs[2:])]
    model = build_moe_model(CFG, grouped=True, recompute_granularity="selective", recompute_modules=["moe"])
    session = TraceSession(model, TraceConfig(mode="qat", spec=ALL_SITES, replay_routes=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        for mb in mbs:
            session.begin_microbatch(mb.rows)
            model(mb.input_ids, mb.position_ids, mb.attention_mask).square().mean().backward()
        assert len(calls) == 2 * CFG.layers * (step + 1)
        opt.step()
        opt.zero_grad()
        session.end_step()
    # An in-place update inside a step (the version counter moves) is seen without end_step.
    with torch.no_grad():
        session.begin_microbatch(mbs[0].rows)
        model(mbs[0].input_ids, mbs[0].position_ids, mbs[0].attention_mask)
        model.decoder.layers[0].mlp.experts.linear_fc1.weight.mul_(1.5)
        session.begin_microbatch(mbs[0].rows)
        model(mbs[0].input_ids, mbs[0].position_ids, mbs[0].attention_mask)
    assert len(calls) == 2 * CFG.layers * 3 + 1
    session.remove()


def test_straight_through_gradient_of_the_grouped_linear_is_exact():
    """d/dW of the fake-quantized grouped GEMM equals the plain grouped GEMM's gradient taken at the
    fake-quantized weights (identity through the quantizer), per expert, including an expert without rows."""
    lin = build_moe_model(CFG, grouped=True).decoder.layers[0].mlp.experts.linear_fc1
    numerics = SiteNumerics(TraceConfig(mode="qat", spec=ALL_SITES))
    lin.weight_quant = numerics.expert_weights
    counts = [5, 0, 9, 3]
    x = torch.randn(sum(counts), lin.in_features, requires_grad=True)
    y, _ = lin(x, counts)
    y.sum().backward()
    wq = expert_weight_fake_quant(lin.weight).requires_grad_()
    xr = x.detach().clone().requires_grad_()
    bounds = torch.tensor([0, *counts]).cumsum(0).tolist()
    ref = torch.cat([xr[bounds[e] : bounds[e + 1]] @ wq[e].T for e in range(len(counts))])
    ref.sum().backward()
    assert torch.equal(y, ref) and torch.equal(x.grad, xr.grad) and torch.equal(lin.weight.grad, wq.grad)
    assert not lin.weight.grad[1].any()


def saved_bytes_per_microbatch(model, mode: str, mbs) -> list[int]:
    """Bytes of tensor storages the autograd graph keeps that no earlier micro-batch already kept."""
    session = TraceSession(model, TraceConfig(mode=mode, spec=ALL_SITES, replay_routes=False))
    seen: set[int] = set()
    per_mb, graphs = [], []
    for mb in mbs:
        new = 0

        def pack(t):
            nonlocal new
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                new += s.nbytes()
            return t

        session.begin_microbatch(mb.rows)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            graphs.append(model(mb.input_ids, mb.position_ids, mb.attention_mask).square().mean())
        per_mb.append(new)
    for loss in graphs:
        loss.backward()
    session.remove()
    return per_mb


def test_no_bf16_weight_copy_per_micro_batch_in_the_autograd_graph():
    """Three micro-batches in flight (graphs kept, as in pipeline schedules): in qat the grouped experts keep the
    one fake-quantized weight copy of the step, so later micro-batches save what bf16 saves plus the
    fake-quantized activations; SequentialMLP saves a new full copy of all expert weights in each."""
    trajs = trajectories(6, seed=4)
    mbs = [pack_microbatch(trajs[i : i + 2], seq_len=24) for i in (0, 2, 4)]
    seq = build_moe_model(CFG)
    grp = grouped_twin(seq)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in grp.named_parameters() if ".experts." in n)
    g_bf16, g_qat = (saved_bytes_per_microbatch(grp, m, mbs) for m in ("bf16", "qat"))
    s_bf16, s_qat = (saved_bytes_per_microbatch(seq, m, mbs) for m in ("bf16", "qat"))
    # bf16 keeps the parameters, qat the step's one fake-quantized copy instead; later micro-batches add activations.
    assert g_qat[0] >= expert_bytes and g_bf16[0] >= expert_bytes
    for k in (1, 2):
        assert g_qat[k] - g_bf16[k] < 0.25 * expert_bytes, (g_qat, g_bf16, expert_bytes)
        assert s_qat[k] - s_bf16[k] >= expert_bytes, (s_qat, s_bf16, expert_bytes)


def test_sites_trace_under_torch_compile_without_graph_breaks():
    """Guided (with rows lacking a record, flip counting on) and RTN activation sites, the FC2-input site and
    the all-experts weight fake-quant compile with fullgraph=True (no host sync, no data-dependent shape) and
    give the eager values and counters."""
    spec = RecordSpec(bits=1, moe_layers=(0,), attn_layers=())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 64, generator=g) * torch.rand(12, 1, generator=g) * 4
    rollout = quantize(x + 0.05 * torch.randn(x.shape, generator=g), "nvfp4", per_token=True)
    has = torch.tensor([True] * 9 + [False] * 3)
    rows = SiteRows(Record.from_quantized(rollout, 1), has)
    w = torch.randn(3, 32, 64, generator=g)
    outs = []
    for compiled in (False, True):
        numerics = SiteNumerics(TraceConfig(mode="trace", spec=spec))
        numerics.track([(0, "moe_in"), (1, "moe_in")])

        def run(x, w, numerics=numerics):
            return (
                numerics.activation((0, "moe_in"), x, rows),
                numerics.activation((1, "moe_in"), x, rows),
                numerics.fc2_input(x),
                expert_weight_fake_quant(w),
            )

        fn = torch.compile(run, fullgraph=True, backend="eager") if compiled else run
        outs.append((fn(x, w), numerics.metrics()))
    (eager, m_eager), (comp, m_comp) = outs
    assert all(torch.equal(a, b) for a, b in zip(eager, comp, strict=True))
    assert m_eager == m_comp and m_eager["trace/L0.moe_in/rtn_fallback"] == 3 * 64
    assert 0 < m_eager["trace/L1.moe_in/code_flip_rate"] < 1


def test_session_refuses_te_expert_linears_by_name_before_installing_anything():
    """TEGroupedMLP whose linears are not TRACE's (TE's `GroupedLinear` when TE is installed), and SequentialMLP with
    another linear than Megatron's local ones (a TE linear), are refused in `qat` naming the classes, and the model
    is left without hooks (`bf16`, which has no weight or FC2-input site, then installs)."""

    class GroupedLinear(torch.nn.Module):  # the class names of TE's linears; TE is not installed here
        pass

    class TEColumnParallelLinear(torch.nn.Module):
        pass

    grouped, sequential = build_moe_model(CFG, grouped=True), build_moe_model(CFG)
    grouped.decoder.layers[1].mlp.experts.linear_fc1 = GroupedLinear()
    sequential.decoder.layers[1].mlp.experts.local_experts[2].linear_fc1 = TEColumnParallelLinear()
    cases = [
        (grouped, r"layer 1: experts TEGroupedMLP with linears \['GroupedLinear', 'TraceGroupedLinear'\]"),
        (sequential, r"layer 1: SequentialMLP expert linear TEColumnParallelLinear"),
    ]
    for model, message in cases:
        with pytest.raises(NotImplementedError, match=message):
            TraceSession(model, TraceConfig(mode="qat", spec=ALL_SITES))
        assert not model._forward_pre_hooks and not model.decoder.layers[1].mlp.router._forward_pre_hooks
        TraceSession(model, TraceConfig(mode="bf16", spec=ALL_SITES)).remove()


def test_grouped_linear_refuses_what_it_does_not_implement():
    from megatron_trace.model import transformer_config

    config = transformer_config(CFG)
    kwargs = dict(
        parallel_mode="column",
        config=config,
        init_method=torch.nn.init.zeros_,
        skip_bias_add=False,
        is_expert=True,
        tp_comm_buffer_name=None,
    )
    with pytest.raises(NotImplementedError, match="bias"):
        TraceGroupedLinear(2, 8, 8, bias=True, **kwargs)
    lin = TraceGroupedLinear(2, 8, 8, bias=False, **kwargs)
    lin.row_scale = torch.ones(4)  # probabilities of another micro-batch's rows
    with pytest.raises(ValueError, match=r"row_scale \(4,\) does not match the 5 input rows"):
        lin(torch.randn(5, 8), [2, 3])
    assert lin.row_scale is None  # taken by the call that refused it
    config.delay_wgrad_compute = True
    with pytest.raises(NotImplementedError, match="delay_wgrad"):
        TraceGroupedLinear(2, 8, 8, bias=False, **kwargs)
