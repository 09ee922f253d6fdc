"""Parallel layouts on CPU (gloo, torchrun, two ranks): TP=2 + SP, EP=2 (alltoall dispatcher), PP=2 and DP=2 with
Megatron's DDP and distributed optimizer, all through `get_forward_backward_func`, against the same step on one rank;
and TP=2 x EP=2 x PP=2 on four ranks (and, opt-in with TRACE_TEST_8_RANKS=1, TP=2 x EP=2 x PP=2 x DP=2 on eight).

The single-rank run writes the full model, the rollout's records and routes, its loss, its gradients, the update of
one Adam step through Megatron's distributed optimizer (on the CPU with `patches/megatron` applied) and every
guided site's output per token. Each layout loads that full state into its shards, runs the same four
micro-batches (split over DP ranks) in `trace` mode with R3, steps its distributed optimizer (at DP = 2 each rank
updates its half of every parameter, then the halves are all-gathered) and must give the same loss, the same
gradients, the same update and the same guided-site values (the same FP4 codes under the same record scales);
gathering the shards must give back the full state exactly (what the HF export reads).

Tolerance: the model is FP32; TP all-reduces, the vocab-parallel log-softmax, the EP all-to-all and DP gradient
reductions add in another order, which moves values by about 1e-7 relative. Guided sites round toward the record,
so their values match exactly (asserted). Gradients are compared with rtol 1e-5 / atol 1e-7: observed worst
relative norm error 6e-7 (TP=2, a QK-norm weight, summed over TP), 1e-7 (EP, DP), 0 (PP). An RTN site (expert
weight, FC2 input) could flip a code on a rounding boundary and exceed that; none does on these inputs, which are
fixed, so the test is deterministic.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CFG_KW = dict(vocab=96, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, experts=4, topk=2, expert_ffn=32)
SEQ = 24
LR = 1e-3
LAYOUTS = {
    "tp2_sp": dict(tp=2),
    "ep2_alltoall": dict(ep=2, dispatcher="alltoall"),
    "pp2": dict(pp=2),
    "pp2_vpp2": dict(pp=2, vpp=2),
    "dp2_distopt": dict(),
}
# Layouts of four ranks: TP x EP x PP composed (EP carved out of TP, two pipeline stages of it).
LAYOUTS_4 = {"tp2_ep2_pp2": dict(tp=2, ep=2, pp=2)}
# Eight ranks: TP x EP x PP x DP, every size 2 (DP = 8 / (TP * PP)). Opt-in (TRACE_TEST_8_RANKS=1): eight torchrun
# ranks on a 2-core CI machine take minutes.
LAYOUTS_8 = {"tp2_ep2_pp2_dp2": dict(tp=2, ep=2, pp=2)}


def _trajectories():
    g = torch.Generator().manual_seed(21)
    lengths = torch.randint(10, SEQ + 1, (8,), generator=g).tolist()
    return [(i, torch.randint(0, CFG_KW["vocab"], (n,), generator=g)) for i, n in enumerate(lengths)]


def _worker(name: str, layout_kw: dict, work: Path) -> None:
    from megatron.core import parallel_state

    from megatron_trace.config import TraceConfig
    from megatron_trace.emulate import emulate_rollout
    from megatron_trace.loss import grpo_loss_terms, token_logprobs
    from megatron_trace.model import MoEModelConfig, build_moe_model
    from megatron_trace.parallel import (
        Layout,
        MicroBatchInput,
        build_chunks,
        forward_backward,
        gather_full_state,
        load_full_state,
        make_optimizer,
        step_optimizer,
        wrap_ddp,
    )
    from megatron_trace.rows import PAD, pack_microbatch
    from megatron_trace.session import TraceSession
    from trace_core.records.spec import RecordSpec

    layout = Layout(**layout_kw)
    layout.init()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    cfg = MoEModelConfig(**CFG_KW)
    spec = RecordSpec(bits=1, moe_layers=(1, 2, 3), attn_layers=(0, 3))
    trajs = _trajectories()
    mbs = [pack_microbatch(trajs[i : i + 2], seq_len=SEQ) for i in range(0, 8, 2)]
    chunks = build_chunks(
        lambda v: build_moe_model(cfg, dtype=torch.float32, vp_stage=v, **layout.config_overrides()), layout
    )
    if name == "single":
        full = {k: v.clone() for k, v in chunks[0].state_dict().items() if not k.endswith("_extra_state")}
        source = emulate_rollout(chunks[0], mbs, spec, num_trajectories=8, max_positions=SEQ)
        g = torch.Generator().manual_seed(4)  # the trainer's weights differ from the rollout's
        full = {k: v + torch.randn(v.shape, generator=g) * 3e-2 * v.abs().mean() for k, v in full.items()}
        torch.save({"full": full, "source": source}, work / "inputs.pt")
    inputs = torch.load(work / "inputs.pt", weights_only=False)
    source = inputs["source"]
    for c in chunks:
        load_full_state(c, inputs["full"])
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    sites: dict[str, list] = {}

    def tap(site, rows, x, y):
        if site not in spec.sites():
            return
        col = tp_rank * y.shape[1] if site[1] != "moe_in" and layout.tp > 1 else 0
        for i in (rows.traj != PAD).nonzero().flatten().tolist():
            key = f"{site[0]}.{site[1]}.{int(rows.traj[i])}.{int(rows.pos[i])}"
            sites.setdefault(key, []).append((col, y[i].tolist()))

    for c in chunks:
        TraceSession(c, TraceConfig(mode="trace", spec=spec), tap=tap)
    chunks = wrap_ddp(chunks)
    optimizer = make_optimizer(chunks, lr=LR)
    before = {k: v.clone() for k, v in gather_full_state(chunks).items()}  # on the CPU: views of the parameters
    for k, v in before.items():  # gathering the shards gives back the full state they were loaded from
        assert torch.equal(v, inputs["full"][k]), k
    assert not before or before.keys() == {k for k in inputs["full"] if "rotary" not in k}, sorted(before)[:5]
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per = len(mbs) // dp
    mine = [MicroBatchInput(mb, source, {}) for mb in mbs[dp_rank * per : (dp_rank + 1) * per]]
    tp_group = parallel_state.get_tensor_model_parallel_group() if layout.tp > 1 else None

    def loss_terms(logits, item):
        ids = item.mb.input_ids
        logp = token_logprobs(logits[:, :-1], ids[:, 1:], tp_group)
        adv = torch.linspace(-1.0, 1.0, ids.shape[0])
        total, n, _ = grpo_loss_terms(logp, logp.detach() + 0.05, logp.detach() - 0.1, adv, item.mb.valid[:, 1:])
        return total, n, {"sum": total.detach().clone(), "tokens": n.clone()}

    for c in chunks:
        c.zero_grad_buffer()
    # force_all_reduce: every DP rank keeps the whole reduced gradient (the distributed optimizer still steps on its
    # shard only), so the gradients can be compared.
    reports = forward_backward(chunks, mine, loss_terms, force_all_reduce=True)
    grads = gather_full_state(chunks, lambda p: p.main_grad)
    step_optimizer(optimizer)
    for c in chunks:
        c.module._trace_session.end_step()
    after = gather_full_state(chunks)
    out = {"rank": rank, "dp_rank": dp_rank, "world": world, "sites": sites}
    if reports:
        out["sum"] = float(sum(r["sum"] for r in reports))
        out["tokens"] = int(sum(r["tokens"] for r in reports))
    if after:
        torch.save({"grad": grads, "update": {k: after[k] - before[k] for k in after}}, work / f"update.{rank}.pt")
    (work / f"result.{rank}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(name: str, nproc: int, work: Path) -> list[dict]:
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    cmd += ["--master_port", str(_free_port()), __file__, name, str(work)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120 + 150 * nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((work / f"result.{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    work = tmp_path_factory.mktemp("single")
    (result,) = _launch("single", 1, work)
    return work, result, torch.load(work / "update.0.pt")


def _check_against_reference(reference, results: list[dict], work: Path) -> None:
    ref_dir, ref, ref_update = reference
    # Loss: the last pipeline stage of every DP rank reports its micro-batches' sums; each (DP rank) counted once.
    losses = {}
    for r in results:
        if "sum" in r:
            losses.setdefault(r["dp_rank"], (r["sum"], r["tokens"]))
    total, tokens = map(sum, zip(*losses.values(), strict=True))
    assert tokens == ref["tokens"]
    assert total / tokens == pytest.approx(ref["sum"] / ref["tokens"], rel=1e-5, abs=1e-6)
    # Gradients of every parameter (DP-reduced, per-token normalised over the step), gathered to the first stage.
    got = torch.load(work / "update.0.pt")
    assert got["grad"].keys() == ref_update["grad"].keys()
    for k, v in ref_update["grad"].items():
        torch.testing.assert_close(got["grad"][k], v, rtol=1e-5, atol=1e-7, msg=k)
    # One Adam step through the (distributed) optimizer: the same update wherever the gradient is not vanishingly
    # small (Adam's first step is lr * g / (|g| + eps): a gradient near eps moves it by more than its own error).
    for k, v in ref_update["update"].items():
        big = ref_update["grad"][k].abs() > 1e-5
        torch.testing.assert_close(got["update"][k][big], v[big], rtol=1e-2, atol=LR * 1e-2, msg=k)
    # Guided sites: every (site, token) of the single-rank run, the same values (codes) on the rank that holds it.
    sites: dict[str, list] = {}
    for r in results:
        for key, parts in r["sites"].items():
            sites.setdefault(key, []).extend(parts)
    assert sites.keys() == ref["sites"].keys()
    for key, ((_, values),) in ref["sites"].items():
        assert [x for _, part in sorted(sites[key]) for x in part] == values, key


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_single_rank(name, reference, tmp_path):
    (tmp_path / "inputs.pt").symlink_to(reference[0] / "inputs.pt")
    _check_against_reference(reference, _launch(name, 2, tmp_path), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS_4))
def test_four_rank_layout_matches_single_rank(name, reference, tmp_path):
    (tmp_path / "inputs.pt").symlink_to(reference[0] / "inputs.pt")
    _check_against_reference(reference, _launch(name, 4, tmp_path), tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRACE_TEST_8_RANKS") != "1", reason="eight ranks: opt-in, TRACE_TEST_8_RANKS=1")
@pytest.mark.parametrize("name", sorted(LAYOUTS_8))
def test_eight_rank_layout_matches_single_rank(name, reference, tmp_path):
    (tmp_path / "inputs.pt").symlink_to(reference[0] / "inputs.pt")
    _check_against_reference(reference, _launch(name, 8, tmp_path), tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_optimizer_is_megatrons_step(dtype):
    """`step_optimizer` takes Megatron's `ChainedOptimizer.step` in its pieces, each once: on the same gradients
    (clipped: their norm is above `clip_grad`), two steps of it and of Megatron's own step give the same norms,
    parameters, masters and moments bit for bit (dense and expert optimizers, one rank)."""
    from megatron_trace import checkpoint
    from megatron_trace.cpu import init_single_rank
    from megatron_trace.model import MoEModelConfig, build_moe_model
    from megatron_trace.parallel import make_optimizer, step_optimizer, unwrap, wrap_ddp

    init_single_rank()
    models = [build_moe_model(MoEModelConfig(**CFG_KW), dtype=dtype, routing_replay=False, grouped=True) for _ in "ab"]
    models[1].load_state_dict(models[0].state_dict())
    chunks = [wrap_ddp([m])[0] for m in models]
    optimizers = [make_optimizer([c], lr=LR, clip_grad=1.0) for c in chunks]
    params = [list(unwrap(c).parameters()) for c in chunks]
    for seed in (0, 1):
        norms = []
        for chunk, ps, optimizer, step in zip(chunks, params, optimizers, ("ours", "megatron"), strict=True):
            chunk.zero_grad_buffer()
            g = torch.Generator().manual_seed(seed)
            for p in ps:
                p.main_grad.copy_(torch.randn(p.shape, generator=g))
            norms.append(step_optimizer(optimizer) if step == "ours" else optimizer.step()[1])
        assert norms[0] == norms[1] > 1.0
        (master, moments, count), (ref_master, ref_moments, ref_count) = (
            checkpoint.adam_state(ps, o) for ps, o in zip(params, optimizers, strict=True)
        )
        assert count == ref_count == seed + 1
        ours = [*params[0], *master, *moments["exp_avg"], *moments["exp_avg_sq"]]
        ref = [*params[1], *ref_master, *ref_moments["exp_avg"], *ref_moments["exp_avg_sq"]]
        assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_gradient_is_refused_before_the_update(dtype):
    """Without a loss scaler Megatron's optimizer steps a NaN gradient element into a NaN master and reports success;
    `step_optimizer` refuses the step on the global norm (dense and expert optimizers, one rank) and leaves
    parameters, masters and moments as they were; with the gradient made finite it steps."""
    from megatron_trace import checkpoint
    from megatron_trace.cpu import init_single_rank
    from megatron_trace.model import MoEModelConfig, build_moe_model
    from megatron_trace.parallel import make_optimizer, step_optimizer, unwrap, wrap_ddp

    init_single_rank()
    (chunk,) = wrap_ddp([build_moe_model(MoEModelConfig(**CFG_KW), dtype=dtype, routing_replay=False, grouped=True)])
    optimizer = make_optimizer([chunk], lr=LR, clip_grad=1.0)
    params = list(unwrap(chunk).parameters())
    before = [p.detach().clone() for p in params]
    chunk.zero_grad_buffer()
    g = torch.Generator().manual_seed(0)
    for p in params:
        p.main_grad.copy_(torch.randn(p.shape, generator=g))
    params[-1].main_grad.view(-1)[0] = float("nan")
    with pytest.raises(FloatingPointError, match="gradient norm nan: the optimizer step is refused"):
        step_optimizer(optimizer)
    master, moments, step = checkpoint.adam_state(params, optimizer)
    assert step == 0
    for p, b, m, *ms in zip(params, before, master, *moments.values(), strict=True):
        assert torch.equal(p, b) and torch.equal(m, b.float()) and not any(x.any() for x in ms)
    params[-1].main_grad.view(-1)[0] = 0.0
    assert step_optimizer(optimizer) > 0
    assert checkpoint.adam_state(params, optimizer)[2] == 1
    assert all(p.isfinite().all() for p in params) and not all(map(torch.equal, params, before))


if __name__ == "__main__":
    layout_name, work_dir = sys.argv[1], Path(sys.argv[2])
    _worker(layout_name, (LAYOUTS | LAYOUTS_4 | LAYOUTS_8).get(layout_name, {}), work_dir)
