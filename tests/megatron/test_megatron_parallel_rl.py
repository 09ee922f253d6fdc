"""The RL loop with a parallel trainer layout on CPU: the controller runs the trainer as a Ray group of two gloo
ranks (`trace_rl.parallel_trainer`), each rank reading its own trajectories' records from the store (and its
stage's sites), the sessions slicing them by KV head and sequence-parallel chunk; two `trace` steps with R3 at
TP = 2 + SP with EP = 2 (alltoall, EP carved out of TP), DP = 2 and PP = 2 (the latter two with gradient
accumulation over two micro-batches per rank, 1F1B under PP), against the same run on one rank, one micro-batch
(`trace_rl.trainer.MegatronTrainer`). Summed over the ranks, every site's guided / fallback counters equal the single
rank's: each row and KV head is guided exactly once. The group steps Megatron's distributed optimizer (on the CPU
with `patches/megatron`), the single rank torch's AdamW; both trainers run the default experts (grouped, weights
fake-quantized in place), and every rank's expert weights are checked to be the fake-quantized copies of masters the
fake-quant never wrote (`verify_in_place_weights`), in FP32 (the group's own masters of those weights) and BF16.

Tolerance: the trainer is FP32 (`trainer_dtype`), so the layouts differ from one rank only by the order of FP32 sums
(TP all-reduces, the vocab-parallel log-softmax, the DP gradient reduction, the per-token loss normalised over the
step), about 1e-7 relative (tests/megatron/test_megatron_parallel.py measures it per gradient). Every metric of
every step is compared with rtol 1e-4: the rollout engine receives the trained weights as BF16, and a master weight
1e-7 away from a BF16 rounding boundary can round the other way, moving the next step's rollout log-probs by a BF16
ulp in the few tokens that use it. Counters (guided rows, fallbacks, placeholders), rewards and sampled lengths must
match exactly. Checkpoints are Megatron distributed checkpoints: each layout's last one exports on one rank to the
group's policy bit for bit, and the single rank's checkpoint of step 1 resumes at TP = 2 + SP with EP = 2 to the
single rank's step 2. A step refused for a fault on one rank (a non-finite gradient, a bad route) is refused on
every rank and leaves nothing behind.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_trace.model import MoEModelConfig
from megatron_trace.parallel import Layout
from tests.rl_small import SMALL_RUN, overflow_gradient, trainer_state
from trace_rl.cli import export_run
from trace_rl.config import ConfigError, RLConfig, load_config
from trace_rl.controller import Controller
from trace_rl.parallel_trainer import check_layout
from trace_rl.rundir import remove_checkpoint
from trace_rl.warmup import PRESETS

pytestmark = pytest.mark.xdist_group("ray")  # one local Ray instance at a time (pytest-xdist --dist loadgroup)
RUN = SMALL_RUN | dict(checkpoint_every=1, trainer_dtype="float32")
LAYOUTS = {
    "tp2_ep2": dict(tp=2, ep=2),
    "dp2_microbatch2": dict(dp=2, train_micro_batch=2),  # two micro-batches per rank
    "pp2_microbatch4": dict(pp=2, train_micro_batch=4),  # 1F1B over two micro-batches
}


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return str(tiny_model(10))


@pytest.fixture(scope="module")
def single(model_dir, tmp_path_factory):
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path_factory.mktemp("single")), **RUN)
    with Controller(cfg, resume=False) as ctrl:
        return ctrl.run(), ctrl.trainer.hf_weights(), ctrl.out


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="ray is a dependency of trace_rl; this install lacks it")
    root = str(Path(__file__).resolve().parents[2])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, old) if p)
    gpus = torch.cuda.device_count()
    ray.init(address="local", num_cpus=2, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    if old is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = old


def _close(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6)


def _assert_same_steps(history: list[dict], reference: list[dict]) -> None:
    """Every metric of every step: counters exactly, the rest within the tolerance above."""
    for got, ref in zip(history, reference, strict=True):
        step = ref["step"]
        keys = {k for k in ref if not k.startswith("time/")}
        assert keys == {k for k in got if not k.startswith("time/")}, step
        assert ref["trace/rtn_fallback_real_tokens"] == 0 and ref["r3/placeholder_rows"] > 0
        assert ref["actor/grad_norm"] > 0 and ref["actor/pg_loss"] != 0
        for k in sorted(keys):
            if isinstance(ref[k], str) or k.endswith(("/guided", "/rtn_fallback", "/redirected", "placeholder_rows")):
                assert got[k] == ref[k], (step, k, got[k], ref[k])
            else:
                assert _close(got[k], ref[k]), (step, k, got[k], ref[k])


def _rank_state(rank) -> list[torch.Tensor]:
    """`trainer_state` of a `TrainerGroup` rank's trainer (run in the rank's actor; collective)."""
    return trainer_state(rank.obj)


def _overflow(rank, on: bool) -> None:
    """On one rank: an inf in the first parameter's accumulated gradient (`overflow_gradient`), or no more."""
    if on:
        rank.fault = rank.obj.params[0].register_post_accumulate_grad_hook(overflow_gradient)
    else:
        rank.fault.remove()


def _duplicate_routes(rank, on: bool) -> None:
    """On one rank: every replayed route of the batches it reads names its first expert twice, or no more."""
    trainer = rank.obj
    if not on:
        del trainer.prepare  # the class's method again
        return
    prepare = trainer.prepare

    def faulty(*args, **kwargs):
        batch = prepare(*args, **kwargs)
        for ids, _ in batch.source._routes.values():
            ids[..., 1] = ids[..., 0]
        return batch

    trainer.prepare = faulty


def _refuse_step_1_on_one_rank(ctrl: Controller) -> None:
    """Rollout step 1 refused twice, each time for a fault on rank 1 alone: an inf in one gradient after accumulation
    (as an overflow would; the global norm carries it to every rank), then duplicate expert ids in its replayed routes
    (the ranks share the route check's verdict: the others would otherwise wait in the optimizer's reductions). Every
    rank refuses by name; parameters, masters, moments and policy version stay as they were. The batch then goes back
    into the rollout pipeline, for the next `train_step`."""
    import ray

    batch = ctrl.rollout(1)
    rewards = torch.tensor([f.result() for f in batch.rewards])
    args = (batch.trajectories, rewards, ctrl.cfg.group_size, str(ctrl.store), batch.step, batch.version)
    ranks = ctrl.trainer.group.ranks
    before = ray.get([r.__ray_call__.remote(_rank_state) for r in ranks])
    overflow = [(FloatingPointError, "gradient norm inf: ")] * 2
    routes = [(ValueError, "a bad rollout route on another rank"), (ValueError, "duplicate expert ids")]
    for fault, errors in ((_overflow, overflow), (_duplicate_routes, routes)):
        ray.get(ranks[1].__ray_call__.remote(fault, True))
        refused = [r.call.remote("step", *args) for r in ranks]
        for ref, (error, message) in zip(refused, errors, strict=True):
            with pytest.raises(error, match=f"(?s){message}.*rollout step 1 refused"):
                ray.get(ref)
        ray.get(ranks[1].__ray_call__.remote(fault, False))
    assert ctrl.trainer.policy_version() == 1
    for after, was in zip(ray.get([r.__ray_call__.remote(_rank_state) for r in ranks]), before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(after, was, strict=True))
    ctrl.pending.append(batch)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_rl_steps_with_a_trainer_layout_match_one_rank(name, model_dir, single, ray_cluster, tmp_path):
    """Two RL steps of the layout equal the single rank's, with step 1 refused on every rank for a fault on one rank
    first (`_refuse_step_1_on_one_rank`): nothing of the refused steps (gradients, site counters, routes) reaches
    step 1, whose counters are exactly the single rank's (they came out doubled when a refused step's sessions were
    not ended)."""
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path), **RUN, **LAYOUTS[name])
    with Controller(cfg, resume=False) as ctrl:
        ctrl.train_step()
        _refuse_step_1_on_one_rank(ctrl)
        history = ctrl.run()
        weights = ctrl.trainer.hf_weights()
        assert min(ctrl.trainer.group.call("verify_in_place_weights")) > 0
    single_history, single_weights, _ = single
    assert len(history) == len(single_history) == RUN["steps"]
    _assert_same_steps(history, single_history)
    # The policy the rollout gets, gathered across the shards: equal up to a BF16 rounding flip (one ulp: at most
    # 2^-7 of the value), except where Adam magnifies the layout's other FP32 sum order. An element whose gradient is
    # near zero moves by up to lr per step whatever the gradient's size, so a rounding-level change of that gradient
    # can move it by a fraction of lr (measured: 1 of 125,824 elements at TP = 2 + EP = 2, by 0.15 lr). At most 1 in
    # 10,000 elements may do so, each by at most lr per step.
    assert sorted(weights) == sorted(single_weights)
    beyond, total = 0, 0
    for k, w in weights.items():
        ref = single_weights[k].float()
        diff, ulp = (w.float() - ref).abs(), (torch.finfo(torch.bfloat16).eps * ref.abs()).clamp_min(1e-6)
        beyond, total = beyond + int((diff > ulp).sum()), total + w.numel()
        assert (diff <= cfg.lr * RUN["steps"]).all(), (k, float(diff.max()), cfg.lr)
    assert beyond <= total // 10_000, (beyond, total)
    # The layout's last checkpoint (a distributed checkpoint of every rank's shards) loads on one rank: the exported
    # policy is the group's, bit for bit.
    exported = load_file(export_run(tmp_path, tmp_path / "hf") / "model.safetensors")
    assert exported.keys() == weights.keys()
    for k, w in weights.items():
        assert torch.equal(exported[k], w), k


@pytest.mark.slow
def test_a_single_rank_checkpoint_resumes_at_a_layout(model_dir, single, ray_cluster, tmp_path):
    """The single-rank run's checkpoint of step 1 resumes under TP = 2 + SP with EP = 2 (each rank loads its shards
    of the distributed checkpoint) and step 2 is the single rank's step 2."""
    single_history, _, out = single
    run = tmp_path / "run"
    shutil.copytree(out, run)
    remove_checkpoint(run / "checkpoint-00000002.pt")
    cfg = RLConfig(model_dir=model_dir, out_dir=str(run), **RUN, **LAYOUTS["tp2_ep2"])
    with Controller(cfg) as ctrl:
        assert ctrl.step == 1 and ctrl.trainer.policy_version() == 1
        history = ctrl.run()
    _assert_same_steps(history[1:], single_history[1:])


def _bf16_group_keeps_its_masters(model_dir: str, tmp_path: Path, **layout) -> None:
    """The production combination: BF16 parameters, Megatron's distributed optimizer with its own FP32 masters, the
    grouped expert weights fake-quantized in place after every all-gather. After the steps, and after a resume from
    the step-1 checkpoint, every rank's expert weights are the fake-quantized copies of untouched masters, and the
    resumed step 2 is the uninterrupted one (BF16 steps are not compared with one rank: the DP reduction rounds
    differently)."""
    settings = RUN | dict(trainer_dtype="bfloat16") | layout
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path / "run"), **settings)
    with Controller(cfg, resume=False) as ctrl:
        history = ctrl.run()
        assert min(ctrl.trainer.group.call("verify_in_place_weights")) > 0
    assert all(math.isfinite(h["actor/grad_norm"]) and h["actor/grad_norm"] > 0 for h in history)
    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", run)
    remove_checkpoint(run / "checkpoint-00000002.pt")
    with Controller(cfg.replace(out_dir=str(run))) as ctrl:
        assert ctrl.step == 1
        resumed = ctrl.run()
        assert min(ctrl.trainer.group.call("verify_in_place_weights")) > 0
    _assert_same_steps(resumed[1:], history[1:])


@pytest.mark.slow
def test_bf16_group_keeps_its_masters_with_in_place_expert_weights(model_dir, ray_cluster, tmp_path):
    """`_bf16_group_keeps_its_masters` at DP = 2 on CPU ranks."""
    _bf16_group_keeps_its_masters(model_dir, tmp_path, dp=2)


@pytest.mark.gpu
def test_bf16_group_on_gpus_keeps_its_masters_with_in_place_expert_weights(model_dir, ray_cluster, tmp_path):
    """`_bf16_group_keeps_its_masters` with NCCL, one GPU per rank (DP = 2 on two GPUs, 1 on one), two
    micro-batches per step (so that one GPU runs the group trainer too, not the single-rank one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dp = min(2, torch.cuda.device_count())
    _bf16_group_keeps_its_masters(model_dir, tmp_path, dp=dp, device="cuda", train_micro_batch=2)


@pytest.mark.gpu
def test_rl_steps_with_the_distributed_optimizer_on_gpus_match_one_gpu(model_dir, ray_cluster, tmp_path):
    """On GPUs (NCCL, one Ray actor per GPU) the group trainer with Megatron's distributed optimizer and the grouped
    in-place expert weights: DP = 2 on two GPUs (DP = 1 on one: the optimizer's copy-back and all-gather paths
    without a peer), two micro-batches per step, gives the single-rank trainer's steps (FP32 trainer, the tolerance
    above; the in-place weights' own FP32 masters), and its distributed checkpoint of step 1 (each rank's ranges of
    the masters and moments) resumes the group to the same step 2."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dp = min(2, torch.cuda.device_count())
    gpu = RUN | dict(device="cuda")
    with Controller(RLConfig(model_dir=model_dir, out_dir=str(tmp_path / "single"), **gpu), resume=False) as ctrl:
        single_history = ctrl.run()
    cfg = RLConfig(model_dir=model_dir, out_dir=str(tmp_path / "group"), **gpu, dp=dp, train_micro_batch=2)
    with Controller(cfg, resume=False) as ctrl:
        assert ctrl.trainer.group.call("layout_name") == [f"tp=1 ep=1 pp=1 vpp=None dp={dp}"] * dp
        history = ctrl.run()
        weights = ctrl.trainer.hf_weights()
        assert min(ctrl.trainer.group.call("verify_in_place_weights")) > 0
    _assert_same_steps(history, single_history)
    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "group", run)
    remove_checkpoint(run / "checkpoint-00000002.pt")
    with Controller(cfg.replace(out_dir=str(run))) as ctrl:
        assert ctrl.step == 1 and ctrl.trainer.policy_version() == 1
        resumed = ctrl.run()
    _assert_same_steps(resumed[1:], history[1:])
    # The distributed optimizer's checkpoint loads on one rank (AdamW over full masters): the group's policy exactly.
    exported = load_file(export_run(tmp_path / "group", tmp_path / "hf") / "model.safetensors")
    assert exported.keys() == weights.keys()
    for k, w in weights.items():
        assert torch.equal(exported[k], w), k


def _rendezvous() -> tuple[int, int, list[int]]:
    """torch.distributed (gloo) from the torchrun environment the group sets in each actor, and one collective."""
    torch.distributed.init_process_group("gloo")
    try:
        ranks: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, torch.distributed.get_rank())
        return torch.distributed.get_rank(), torch.distributed.get_world_size(), ranks
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_trainer_group_runs_torchrun_code_across_its_actors(ray_cluster):
    """`TrainerGroup.run(fn)` calls `fn` on every rank at once with the torchrun environment set (rank, world size,
    rendezvous on rank 0's node): torch.distributed initialised from it joins the actors, as Megatron's process groups
    do in the layout tests above."""
    from trace_rl.trainer_group import TrainerGroup

    group = TrainerGroup(2, cpus_per_rank=1)
    try:
        assert group.run(_rendezvous) == [(0, 2, [0, 1]), (1, 2, [0, 1])]
    finally:
        group.shutdown()


def test_a_layout_the_cluster_cannot_place_is_refused(ray_cluster):
    from trace_rl.trainer_group import TrainerGroup

    world = torch.cuda.device_count() + 2  # more GPU ranks than the cluster has
    with pytest.raises(RuntimeError, match=rf"{world} ranks of \{{'CPU': 1, 'GPU': 1\}} were not placed within 2 s"):
        TrainerGroup(world, gpus_per_rank=1, placement_timeout_s=2)


def test_layout_keys_are_validated():
    with pytest.raises(ConfigError, match=r"ep=2 must divide dp \* tp = 1"):
        RLConfig(ep=2)
    with pytest.raises(ConfigError, match="dp=3 must divide the 128 trajectories"):
        RLConfig(dp=3)
    with pytest.raises(ConfigError, match="tp=16 exceeds gpus_per_node=8"):
        RLConfig(tp=16, device="cuda")
    with pytest.raises(ConfigError, match="12 GPUs do not fill nodes of gpus_per_node=8"):
        RLConfig(tp=4, dp=3, prompts_per_step=3, device="cuda")
    with pytest.raises(ConfigError, match="tp=0 must be >= 1"):
        RLConfig(tp=0)
    with pytest.raises(ConfigError, match="trainer_dtype='fp16'"):
        RLConfig(trainer_dtype="fp16")


QWEN3_30B_A3B = MoEModelConfig(  # the dimensions of Qwen3-30B-A3B's config.json
    vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, experts=128, topk=8, expert_ffn=768
)


@pytest.mark.parametrize(
    "config, dims",
    [
        ("configs/2gpu-trainer-ep2.toml", PRESETS["small"]),
        ("configs/qwen3-30b-a3b-8gpu-sglang.toml", QWEN3_30B_A3B),
    ],
)
def test_example_layout_configs_are_valid_for_their_models(config, dims):
    cfg = load_config(Path(__file__).resolve().parents[2] / config)
    assert cfg.parallel_trainer() and cfg.device == "cuda"
    check_layout(dims, Layout(tp=cfg.tp, ep=cfg.ep, pp=cfg.pp), cfg.dp)
    with pytest.raises(ValueError, match=f"experts={dims.experts} is not divisible by ep=3"):
        check_layout(dims, Layout(ep=3), 3)
